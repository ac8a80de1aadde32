# Shared by the run_*_gpt.sh, run_*_bert.sh and run_*_llama.sh launchers; sourced, never run. It holds every
# default and check of their environment variables, builds the trainer's flags, runs the flag
# pre-check and starts (or, with --dry-run, prints) torchrun. A launcher sets LAUNCH_NAME (the
# prefix of its messages), sources this file and calls `launch_main ROLE MODEL "$@"`, which runs,
# in this order (`launch_slurm MODEL "$@"`, the run_slurm_*.sh launchers', runs them around SLURM's
# node list, below):
#   launch_set_model MODEL     gpt | bert | llama: its entry point, recipes and sample data
#   launch_parse_args "$@"     --dry-run (anywhere) -> DRY_RUN=1; --strategy FILE -> STRATEGY_FILE;
#                              the other arguments -> EXTRA_ARGS
#   launch_check_layout_env    USE_DPP, PP, TP, VPP, NPROC, RANKS_PER_GPU as given (before any slow setup)
#   launch_check_nodes ROLE    single | master | worker | slurm: NNODES, NODE_RANK, MASTER_ADDR,
#                              MASTER_PORT, NODE_IPS (slurm: after setting NNODES and NODE_IPS)
#   launch_prepare             Python environment, GPU-dependent defaults, recipe, data; the user's
#                              flags over them (megatron_dpp.launcher_flags) -> ALL_FLAGS
#                              (GPUs: PP=2 where they hold two stages, else 1; NPROC = the GPUs,
#                              rounded down to a multiple of PP x TP. CPU: PP=2, NPROC=2)
#   launch_precheck [NODE]     bad flags: one line, exit 2, before torchrun starts
#   launch_start NODE_RANK     prints the layout and execs torchrun (megatron_dpp.rank_launcher: one
#                              line when ranks fail), or prints its command (DRY_RUN)
# Paths are the caller's: a relative path in a path-valued flag (LAUNCH_PATH_FLAGS, --strategy),
# in DATA_DIR, DATA_ARGS or DPP_VENV, is resolved against the directory the launcher was run from,
# before anything changes directory (the precheck and torchrun run in the repository root).
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CALLER_DIR="$PWD"
# The trainer's flags that name files or directories (megatron_dpp/arguments.py); the data paths
# (LAUNCH_BLEND_FLAGS) also take a blend, W1 PREFIX1 W2 PREFIX2 ...
LAUNCH_BLEND_FLAGS=(--data-path --train-data-path --valid-data-path --test-data-path)
LAUNCH_PATH_FLAGS=("${LAUNCH_BLEND_FLAGS[@]}" --data-args-path --per-split-data-args-path
                   --data-cache-path --vocab-file --merge-file --save --load --trace-dir
                   --tensorboard-dir --wandb-save-dir)

# launch_abspath VAR PATH: VAR = PATH made absolute against CALLER_DIR (a leading ~ is the home
# directory, as DATA_ARGS's words are not expanded by a shell); empty and absolute paths unchanged.
launch_abspath() {
  local abspath="$2"  # not the caller's VAR: its name is never "abspath"
  case "$abspath" in
    "~") abspath="$HOME" ;;
    "~/"*) abspath="$HOME/${abspath#"~/"}" ;;
  esac
  if [ -n "$abspath" ] && [[ "$abspath" != /* ]]; then
    while [[ "$abspath" == ./* ]]; do abspath="${abspath#./}"; abspath="${abspath#"${abspath%%[!/]*}"}"; done
    if [ -z "$abspath" ] || [ "$abspath" = . ]; then abspath="$CALLER_DIR"; else abspath="$CALLER_DIR/$abspath"; fi
  fi
  printf -v "$1" '%s' "$abspath"
}

if [ -n "${DPP_VENV:-}" ]; then launch_abspath DPP_VENV "$DPP_VENV"; fi
VENV="${DPP_VENV:-$REPO_ROOT/.venv}"
PY="$VENV/bin/python"
# Both sides of a multi-node job must agree on the port, so it cannot be picked at random.
DEFAULT_MULTINODE_MASTER_PORT=29500

# launch_set_model MODEL: what differs between the models, all here.
launch_set_model() {
  LAUNCH_MODEL="$1"
  ENTRY_ARGS=()  # flags the entry module takes before the training flags
  case "$LAUNCH_MODEL" in
    gpt)
      ENTRY_MODULE=megatron_dpp.pretrain_gpt
      RECIPE_DIR="$REPO_ROOT/examples/gpt3"; CPU_RECIPE=gpt3_tiny; GPU_RECIPE=gpt3_125m ;;
    bert)
      ENTRY_MODULE=megatron_dpp.pretrain_bert
      RECIPE_DIR="$REPO_ROOT/examples/bert"; CPU_RECIPE=bert_tiny; GPU_RECIPE=bert_base ;;
    llama)
      # The one entry point with the model named; Llama trains on GPT's sample data.
      ENTRY_MODULE=megatron_dpp.pretrain; ENTRY_ARGS=(--model llama)
      RECIPE_DIR="$REPO_ROOT/examples/llama"; CPU_RECIPE=llama_tiny; GPU_RECIPE=llama_tiny ;;  # llama2_7b, llama3_8b: their own data
    *)
      launch_fail "unknown model $LAUNCH_MODEL (gpt, bert or llama)" ;;
  esac
}

# launch_sample_data_flags DATA_DIR -> SAMPLE_MARKER, SAMPLE_PREFIX, SAMPLE_TOKENIZER_FLAGS: the
# model's files of the sample data (launch_prepare_sample_if_used makes them where a flag uses them).
launch_sample_data_flags() {
  local dir="$1"
  if [ "$LAUNCH_MODEL" = bert ]; then
    SAMPLE_MARKER="$dir/sample_bert_text_sentence.idx"
    SAMPLE_PREFIX="$dir/sample_bert_text_sentence"
    SAMPLE_TOKENIZER_FLAGS=(--vocab-file "$dir/bert-vocab.txt" --tokenizer-type BertWordPieceLowerCase)
  else
    SAMPLE_MARKER="$dir/sample_text_document.idx"
    SAMPLE_PREFIX="$dir/sample_text_document"
    SAMPLE_TOKENIZER_FLAGS=(--vocab-file "$dir/vocab.json" --merge-file "$dir/merges.txt")
  fi
}

# launch_prepare_sample_if_used DATA_DIR: prepare_sample makes the sample data when a flag of
# ALL_FLAGS names one of its files (the user's own data and tokenizer replace them) and it is missing.
launch_prepare_sample_if_used() {
  local dir="$1" word
  [ -f "$SAMPLE_MARKER" ] && return 0
  for word in "${ALL_FLAGS[@]}"; do
    if [[ "$word" == "$dir/"* ]]; then
      (cd "$REPO_ROOT" && "$PY" -m megatron_dpp.data.prepare_sample --output-dir "$dir")
      return 0
    fi
  done
}

# launch_value_in VAR FLAG WORDS_NAME: VAR = the value of the last FLAG (`--flag V` or `--flag=V`)
# among the array named WORDS_NAME; false when it gives no FLAG.
launch_value_in() {
  local -n words="$3"
  local i found=1 word
  for ((i = 0; i < ${#words[@]}; i++)); do
    word="${words[i]}"
    if [ "$word" = "$2" ]; then
      printf -v "$1" '%s' "${words[i + 1]:-}"; found=0
    elif [[ "$word" == "$2"=* ]]; then
      printf -v "$1" '%s' "${word#*=}"; found=0
    fi
  done
  return "$found"
}

# launch_layout_from_flags: PP, TP and VPP as the user's own layout flags give them (one choice,
# stated once: a variable that says otherwise is refused), so that the process count, the banner
# and --use-dpp follow the command line as written. An example script's layout (EXAMPLE_FLAGS:
# Megatron-LM's examples/ scripts) applies where neither a variable nor a user's flag gives one.
launch_layout_from_flags() {
  local pair var flag value given
  for pair in PP:--pipeline-model-parallel-size TP:--tensor-model-parallel-size \
              VPP:--num-virtual-stages-per-pipeline-rank; do
    var="${pair%%:*}"; flag="${pair#*:}"
    given="${!var:-}"
    if launch_value_in value "$flag" EXTRA_ARGS; then
      if [ -n "$STRATEGY_FILE" ]; then
        launch_fail "$flag and --strategy both choose the layout; remove $flag"
      fi
    elif [ -z "$given" ] && [ -n "${EXAMPLE_FLAGS+set}" ] && launch_value_in value "$flag" EXAMPLE_FLAGS; then
      given=""
    else
      continue
    fi
    if ! [[ "$value" =~ ^[0-9]+$ ]] || [ "$((10#$value))" -lt 1 ]; then
      launch_fail "$flag $value is not a positive whole number"
    fi
    if [ -n "$given" ] && [ "$((10#$given))" != "$((10#$value))" ]; then
      launch_fail "$var=$given and $flag $value disagree; give the layout once"
    fi
    printf -v "$var" '%s' "$((10#$value))"
  done
}

# launch_assemble_flags RECIPE_FLAGS_NAME STRATEGY_NAME LAUNCHER_NAME USER_NAME (array names) ->
# ALL_FLAGS, RECIPE_APPLIED, PROVENANCE_LINES: megatron_dpp.launcher_flags puts the user's flags
# over the launcher's defaults and the strategy's over the recipe's (the recipe only when RECIPE
# names it or the user gives no model shape; a user's choice replaces every flag of that choice).
launch_assemble_flags() {
  local -n recipe_words="$1" strategy_words="$2" launcher_words="$3" user_words="$4"
  local out provenance status asked=()
  out="$(mktemp)"; provenance="$(mktemp)"
  if [ "$RECIPE_ASKED_FOR" = 1 ]; then asked=(--recipe-asked-for); fi
  if ! status="$(cd "$REPO_ROOT" && "$PY" -m megatron_dpp.launcher_flags --recipe "$RECIPE" \
       "${asked[@]}" --output "$out" --provenance "$provenance" ::recipe "${recipe_words[@]}" \
       ::strategy "${strategy_words[@]}" ::launcher "${launcher_words[@]}" ::user "${user_words[@]}" 2>&1)"; then
    rm -f "$out" "$provenance"
    launch_fail "${status#error: }"
  fi
  mapfile -d '' -t ALL_FLAGS <"$out"
  mapfile -t PROVENANCE_LINES <"$provenance"
  rm -f "$out" "$provenance"
  if [ "$status" = "recipe applied" ]; then RECIPE_APPLIED=1; else RECIPE_APPLIED=0; fi
}

# launch_resolve_paths: every path of ALL_FLAGS (the LAUNCH_PATH_FLAGS, as `--flag VALUE` or
# `--flag=VALUE`) made absolute against the caller's directory; in a blend `--data-path W1 P1 W2 P2`
# (or a per-split path's)
# the prefixes only (as megatron_dpp.data.datasets.parse_data_path reads it: one value is a prefix,
# an even number are weight-prefix pairs; anything else is left for the flag check to refuse).
launch_resolve_paths() {
  local resolved=() n=${#ALL_FLAGS[@]} i=0 j word name path values
  while [ "$i" -lt "$n" ]; do
    word="${ALL_FLAGS[i]}"
    i=$((i + 1))
    name="${word%%=*}"
    if [[ " ${LAUNCH_PATH_FLAGS[*]} " != *" $name "* ]]; then
      resolved+=("$word")
    elif [ "$name" != "$word" ]; then  # --flag=VALUE: one value
      launch_abspath path "${word#*=}"
      resolved+=("$name=$path")
    elif [[ " ${LAUNCH_BLEND_FLAGS[*]} " == *" $name "* ]]; then
      values=()
      while [ "$i" -lt "$n" ] && [[ "${ALL_FLAGS[i]}" != -* ]]; do
        values+=("${ALL_FLAGS[i]}")
        i=$((i + 1))
      done
      if [ "${#values[@]}" -eq 1 ]; then
        launch_abspath 'values[0]' "${values[0]}"
      elif [ $((${#values[@]} % 2)) -eq 0 ]; then
        for ((j = 1; j < ${#values[@]}; j += 2)); do
          launch_abspath "values[$j]" "${values[j]}"
        done
      fi
      resolved+=("$word" "${values[@]}")
    else
      resolved+=("$word")
      if [ "$i" -lt "$n" ] && [[ "${ALL_FLAGS[i]}" != -* ]]; then
        launch_abspath path "${ALL_FLAGS[i]}"
        resolved+=("$path")
        i=$((i + 1))
      fi
    fi
  done
  ALL_FLAGS=("${resolved[@]}")
}

launch_fail() {
  echo "$LAUNCH_NAME: $*" >&2
  exit 2
}

# launch_require_int NAME MIN MAX DESCRIPTION: the variable NAME holds a whole number in MIN..MAX
# (MAX empty: no upper bound); else "NAME=VALUE is not DESCRIPTION" and exit 2.
launch_require_int() {
  local name="$1" min="$2" max="$3" description="$4" value="${!1}"
  if ! [[ "$value" =~ ^[0-9]+$ ]] || [ "$((10#$value))" -lt "$min" ] \
     || { [ -n "$max" ] && [ "$((10#$value))" -gt "$max" ]; }; then
    launch_fail "$name=$value is not $description"
  fi
}

launch_parse_args() {
  DRY_RUN=0
  EXTRA_ARGS=()
  STRATEGY_FILE=""
  while [ $# -gt 0 ]; do
    case "$1" in
      --dry-run) DRY_RUN=1 ;;
      --strategy)
        [ $# -ge 2 ] || launch_fail "--strategy needs a FILE (the strategy JSON of start-search.sh)"
        STRATEGY_FILE="$2"; shift ;;
      --strategy=*) STRATEGY_FILE="${1#--strategy=}" ;;
      --num-gpus | --num-gpus=*)  # MegatronDPP's: the GPUs (processes) of this node
        local gpus="${1#--num-gpus=}"
        if [ "$1" = --num-gpus ]; then
          [ $# -ge 2 ] || launch_fail "--num-gpus needs a number (the GPUs of this node)"
          gpus="$2"; shift
        fi
        if [ -n "${NPROC:-}" ] && [ "$NPROC" != "$gpus" ]; then
          launch_fail "NPROC=$NPROC and --num-gpus $gpus disagree; give the processes of this node once"
        fi
        NPROC="$gpus" ;;
      *) EXTRA_ARGS+=("$1") ;;
    esac
    shift
  done
  if [ -n "$STRATEGY_FILE" ]; then
    [ -f "$STRATEGY_FILE" ] || launch_fail "--strategy $STRATEGY_FILE: no such file"
    STRATEGY_FILE="$(cd "$(dirname "$STRATEGY_FILE")" && pwd)/$(basename "$STRATEGY_FILE")"
  fi
}

launch_check_layout_env() {
  USE_DPP="${USE_DPP:-1}"
  if [ "$USE_DPP" != "0" ] && [ "$USE_DPP" != "1" ]; then
    launch_fail "USE_DPP=$USE_DPP; set it to 1 (dynamic pipeline schedule) or 0 (Megatron's)"
  fi
  local name
  for name in PP TP VPP NPROC RANKS_PER_GPU; do
    if [ -n "${!name:-}" ]; then
      launch_require_int "$name" 1 "" "a positive whole number"
    fi
  done
  if [ -n "$STRATEGY_FILE" ]; then
    for name in PP TP VPP; do
      if [ -n "${!name:-}" ]; then
        launch_fail "$name=${!name} and --strategy both choose the layout; unset $name"
      fi
    done
  fi
}

# launch_read_strategy: the strategy's model, processes, nodes and flags (STRATEGY_FLAGS), checked
# against this launcher; PP, TP, VPP and USE_DPP as the strategy's flags set them.
launch_read_strategy() {
  local read=("$PY" -m megatron_dpp.search.strategy "$STRATEGY_FILE" --print) value flags_text
  value="$("${read[@]}" model)" || exit 2
  if [ "$value" != "$LAUNCH_MODEL" ]; then
    launch_fail "--strategy $STRATEGY_FILE is a $value strategy; start it with run_*_$value.sh"
  fi
  value="$("${read[@]}" num_nodes)" || exit 2
  if [ "$value" != "$NNODES" ]; then
    launch_fail "--strategy $STRATEGY_FILE was searched for $value node(s); this job has $NNODES"
  fi
  value="$("${read[@]}" nproc_per_node)" || exit 2
  if [ -n "${NPROC:-}" ] && [ "$NPROC" != "$value" ]; then
    launch_fail "NPROC=$NPROC, but --strategy $STRATEGY_FILE was searched for $value processes per node; unset NPROC"
  fi
  NPROC="$value"
  flags_text="$("${read[@]}" flags)" || exit 2
  mapfile -t STRATEGY_FLAGS <<<"$flags_text"
  PP=1; TP=1; VPP=1; USE_DPP=0
  local i
  for ((i = 0; i < ${#STRATEGY_FLAGS[@]}; i++)); do
    case "${STRATEGY_FLAGS[i]}" in
      --pipeline-model-parallel-size) PP="${STRATEGY_FLAGS[i + 1]}" ;;
      --tensor-model-parallel-size) TP="${STRATEGY_FLAGS[i + 1]}" ;;
      --num-virtual-stages-per-pipeline-rank) VPP="${STRATEGY_FLAGS[i + 1]}" ;;
      --use-dpp) USE_DPP=1 ;;
    esac
  done
}

launch_check_nodes() {
  local role="$1"
  LAUNCH_ROLE="$role"
  if [ "$role" = single ]; then
    NNODES=1; NODE_RANK=0; NODE_IPS=""
    if [ -n "${MASTER_PORT:-}" ]; then
      launch_require_int MASTER_PORT 1 65535 "a TCP port (1..65535; unset: torchrun picks a free one)"
    fi
    return
  fi
  if [ "$role" != slurm ]; then  # launch_slurm takes NNODES from SLURM
    NNODES="${NNODES:-2}"
  fi
  launch_require_int NNODES 1 "" "a number of nodes (1 or more)"
  NODE_IPS="${NODE_IPS:-}"
  if [ "$NNODES" -gt 1 ] && [ -z "$NODE_IPS" ]; then
    launch_fail "NODE_IPS is not set; set it to the $NNODES nodes' addresses in node-rank order, e.g. NODE_IPS=10.0.0.1,10.0.0.2"
  fi
  case "$role" in
    master)
      NODE_RANK="${NODE_RANK:-0}"
      if [ "$NODE_RANK" != 0 ]; then
        launch_fail "NODE_RANK=$NODE_RANK; the master is node 0 (start the other nodes with run_worker_$LAUNCH_MODEL.sh)"
      fi
      if [ -z "${MASTER_ADDR:-}" ]; then
        if [ -n "$NODE_IPS" ]; then
          MASTER_ADDR="${NODE_IPS%%,*}"
        else
          MASTER_ADDR="$(hostname -I 2>/dev/null | awk '{print $1}')" || true
        fi
      fi
      if [ -z "$MASTER_ADDR" ]; then
        launch_fail "MASTER_ADDR is not set and hostname -I gives no address; set it to this node's address"
      fi
      ;;
    worker)
      if [ "$NNODES" -lt 2 ]; then
        launch_fail "NNODES=$NNODES; a worker joins a job of 2 or more nodes"
      fi
      if [ -z "${NODE_RANK:-}" ]; then
        launch_fail "NODE_RANK is not set; set it to this worker's node rank, 1..$((NNODES - 1))"
      fi
      launch_require_int NODE_RANK 1 "$((NNODES - 1))" \
        "a worker's node rank (1..$((NNODES - 1)) with NNODES=$NNODES; the master is node 0)"
      if [ -z "${MASTER_ADDR:-}" ]; then
        launch_fail "MASTER_ADDR is not set; set it to the master's address (node 0, the first of NODE_IPS)"
      fi
      ;;
    slurm)
      MASTER_ADDR="${MASTER_ADDR:-${NODE_IPS%%,*}}"
      ;;
  esac
  MASTER_PORT="${MASTER_PORT:-$DEFAULT_MULTINODE_MASTER_PORT}"
  launch_require_int MASTER_PORT 1 65535 "a TCP port (1..65535), free on the master"
}

# launch_check_ranks_per_gpu GPUS: RANKS_PER_GPU=N (N ranks on each GPU, under a private MPS
# daemon that megatron_dpp.rank_launcher starts: megatron_dpp/shared_gpu.py) where it can work.
launch_check_ranks_per_gpu() {
  local gpus="$1"
  [ "$RANKS_PER_GPU" -gt 1 ] || return 0
  if [ "$gpus" -eq 0 ]; then
    launch_fail "RANKS_PER_GPU=$RANKS_PER_GPU shares GPUs between ranks; this machine has none (unset it: CPU ranks share the cores)"
  fi
  if ! command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
    launch_fail "RANKS_PER_GPU=$RANKS_PER_GPU needs NVIDIA's MPS: nvidia-cuda-mps-control is not on PATH"
  fi
  if [ "$TP" -gt 1 ]; then
    launch_fail "RANKS_PER_GPU=$RANKS_PER_GPU with TP=$TP: the tensor-parallel all-reduces of every layer would go over gloo through the host; use TP=1"
  fi
}

launch_prepare() {
  if [ ! -x "$PY" ]; then
    bash "$REPO_ROOT/run_scripts/setup_env.sh"
  fi
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

  STRATEGY_FLAGS=()
  if [ -n "$STRATEGY_FILE" ]; then
    launch_read_strategy
  fi
  launch_layout_from_flags
  local gpus group
  # The GPUs torch sees; without an NVIDIA device node there are none, and importing torch to
  # learn that would cost seconds on every launch of a CPU machine. (DPP_NVIDIA_DEVICE_NODES: where
  # to look instead of /dev, for tests that stand in a machine with GPUs.)
  if compgen -G "${DPP_NVIDIA_DEVICE_NODES:-/dev/nvidia[0-9]*}" >/dev/null; then
    gpus="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
  else
    gpus=0
  fi
  TP="${TP:-1}"
  RANKS_PER_GPU="${RANKS_PER_GPU:-1}"
  RANKS_PER_GPU="$((10#$RANKS_PER_GPU))"
  launch_check_ranks_per_gpu "$gpus"
  local slots=$((gpus * RANKS_PER_GPU))  # the ranks this node's GPUs take
  VPP="${VPP:-1}"
  if [ -n "${RECIPE:-}" ]; then RECIPE_ASKED_FOR=1; else RECIPE_ASKED_FOR=0; fi
  # The user's own model (a shape, no RECIPE): Megatron-LM's layout, PP=1, unless PP or the user's
  # flags say otherwise. The recipes' default runs get a pipeline, for --use-dpp to schedule.
  local user_words=() status
  if [ -n "${DATA_ARGS:-}" ]; then read -r -a user_words <<<"$DATA_ARGS"; fi
  user_words+=("${EXTRA_ARGS[@]}")
  if [ -z "${PP:-}" ] && [ "$RECIPE_ASKED_FOR" = 0 ] && [ -z "${EXAMPLE_FLAGS+set}" ] && [ -z "$STRATEGY_FILE" ]; then
    status="$(cd "$REPO_ROOT" && "$PY" -m megatron_dpp.launcher_flags --gives-shape ::user "${user_words[@]}" 2>&1)" \
      || launch_fail "${status#error: }"
    if [ "$status" = shape ]; then PP=1; fi
  fi
  if [ "$gpus" -gt 0 ]; then
    RECIPE="${RECIPE:-$GPU_RECIPE}"
    # A pipeline whenever the GPUs hold two stages, so that --use-dpp has a schedule to run.
    if [ -z "${PP:-}" ]; then
      if [ "$slots" -ge "$((2 * TP))" ]; then PP=2; else PP=1; fi
    fi
    if [ -z "${NPROC:-}" ]; then
      group=$((PP * TP))
      NPROC=$((slots / group * group))
      if [ "$NPROC" -eq 0 ]; then
        if [ "$RANKS_PER_GPU" -gt 1 ]; then
          launch_fail "PP=$PP x TP=$TP needs $group ranks; $gpus GPUs at RANKS_PER_GPU=$RANKS_PER_GPU take $slots (lower PP or TP, raise RANKS_PER_GPU, or set NPROC)"
        fi
        launch_fail "PP=$PP x TP=$TP needs $group GPUs; this machine has $gpus (lower PP or TP, or set NPROC)"
      fi
      if [ "$NPROC" -ne "$slots" ]; then
        if [ "$RANKS_PER_GPU" -gt 1 ]; then
          echo "$LAUNCH_NAME: NPROC=$NPROC: $NPROC of the $slots ranks $gpus GPUs take at RANKS_PER_GPU=$RANKS_PER_GPU, a multiple of PP x TP = $group"
        else
          echo "$LAUNCH_NAME: NPROC=$NPROC: $NPROC of the $gpus GPUs, a multiple of PP x TP = $group"
        fi
      fi
    fi
    if [ "$RANKS_PER_GPU" -gt 1 ]; then
      if [ $((NPROC % RANKS_PER_GPU)) -ne 0 ]; then
        launch_fail "RANKS_PER_GPU=$RANKS_PER_GPU does not divide NPROC=$NPROC, the node's ranks; give a multiple of $RANKS_PER_GPU"
      fi
      if [ $((NPROC / RANKS_PER_GPU)) -gt "$gpus" ]; then
        launch_fail "NPROC=$NPROC at RANKS_PER_GPU=$RANKS_PER_GPU needs $((NPROC / RANKS_PER_GPU)) GPUs; this machine has $gpus"
      fi
      GPU_MEMORY_BYTES="$("$PY" -c 'import torch; print(torch.cuda.get_device_properties(0).total_memory)')"
    fi
  else
    NPROC="${NPROC:-2}"; PP="${PP:-2}"; RECIPE="${RECIPE:-$CPU_RECIPE}"
  fi

  if [ -n "${EXAMPLE_FLAGS+set}" ]; then
    # A Megatron-LM examples/ script: its flags are the recipe, always applied (RECIPE is its name).
    RECIPE="$LAUNCH_NAME"; RECIPE_ASKED_FOR=1
    MODEL_ARGS=("${EXAMPLE_FLAGS[@]}"); TRAINING_ARGS=(); LOGGING_ARGS=()
  else
    local recipe_file="$RECIPE_DIR/$RECIPE.sh"
    if [[ "$RECIPE" == train_* ]] && [ -f "$recipe_file" ]; then
      launch_fail "RECIPE=$RECIPE is one of Megatron-LM's example scripts, not a recipe; run it: bash ${recipe_file#"$REPO_ROOT/"} ARGUMENTS"
    fi
    if [ ! -f "$recipe_file" ]; then
      launch_fail "no recipe $recipe_file; set RECIPE to one of: $(cd "$RECIPE_DIR" && ls *.sh | grep -v '^train_' | sed 's/\.sh$//' | tr '\n' ' ')"
    fi
    # shellcheck source=/dev/null
    source "$recipe_file"
  fi

  # The launcher's defaults: the sample data and its tokenizer (DATA_ARGS, the user's own data
  # flags, replace them), the environment's layout and schedule, the nodes.
  local user_flags=() launcher_flags=() recipe_flags=("${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${LOGGING_ARGS[@]}")
  if [ -n "${DATA_ARGS:-}" ]; then
    read -r -a user_flags <<<"$DATA_ARGS"
  fi
  user_flags+=("${EXTRA_ARGS[@]}")
  launch_abspath DATA_DIR "${DATA_DIR:-$REPO_ROOT/data/sample}"
  launch_sample_data_flags "$DATA_DIR"
  if [ -z "${EXAMPLE_FLAGS+set}" ]; then  # an example script names its own data
    launcher_flags=(--data-path "$SAMPLE_PREFIX" "${SAMPLE_TOKENIZER_FLAGS[@]}" --split 98,2,0)
  fi
  # The strategy's flags (model shape, batch, layout, schedule) replace the environment's sizes.
  if [ -z "$STRATEGY_FILE" ]; then
    launcher_flags+=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP")
    if [ "$VPP" -gt 1 ]; then
      launcher_flags+=(--num-virtual-stages-per-pipeline-rank "$VPP")
    fi
    if [ "$USE_DPP" = "1" ] && [ "$PP" -ge 2 ]; then
      launcher_flags+=(--use-dpp)
    fi
  fi
  if [ -n "$NODE_IPS" ]; then
    launcher_flags+=(--multi-node --node-ips "$NODE_IPS")
  fi
  launch_assemble_flags recipe_flags STRATEGY_FLAGS launcher_flags user_flags
  launch_prepare_sample_if_used "$DATA_DIR"
  launch_resolve_paths
}

launch_precheck() {
  # launch_precheck [NODE_RANK]: torchrun's variables as every rank will see them;
  # megatron_dpp.comm.nodes counts the nodes with GROUP_WORLD_SIZE, and with GROUP_RANK (this node's
  # rank, when it runs here: not under --dry-run, which may print another machine's commands) the
  # check also finds this node's --node-ips address among this machine's.
  local node=()
  if [ -n "${1:-}" ] && [ "$DRY_RUN" = 0 ]; then node=(GROUP_RANK="$1"); fi
  local shared=()
  if [ "$RANKS_PER_GPU" -gt 1 ]; then  # the ranks' backend and the GPU's memory (shared_gpu_memory.py)
    shared=(DPP_RANKS_PER_GPU="$RANKS_PER_GPU" DPP_GPU_MEMORY_BYTES="$GPU_MEMORY_BYTES")
  fi
  (cd "$REPO_ROOT" && env "${node[@]}" "${shared[@]}" WORLD_SIZE="$((NNODES * NPROC))" LOCAL_WORLD_SIZE="$NPROC" \
     GROUP_WORLD_SIZE="$NNODES" RANK=0 "$PY" -m megatron_dpp.arguments "$LAUNCH_MODEL" "${ALL_FLAGS[@]}")
}

# launch_torchrun_command NODE_RANK -> TORCHRUN (the command line of that node)
launch_torchrun_command() {
  local node_rank="$1" rendezvous
  if [ "$LAUNCH_ROLE" = single ]; then
    if [ -n "${MASTER_PORT:-}" ]; then
      rendezvous=(--master-addr 127.0.0.1 --master-port "$MASTER_PORT")
    else
      rendezvous=(--standalone)
    fi
  else
    # Static rendezvous: every node names the master and its own rank.
    rendezvous=(--node-rank "$node_rank" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
  fi
  local shared=()
  if [ "$RANKS_PER_GPU" -gt 1 ]; then shared=(--ranks-per-gpu "$RANKS_PER_GPU"); fi
  TORCHRUN=("$PY" -m megatron_dpp.rank_launcher "${shared[@]}" --nnodes "$NNODES" "${rendezvous[@]}"
            --nproc-per-node "$NPROC" -m "$ENTRY_MODULE" "${ENTRY_ARGS[@]}" "${ALL_FLAGS[@]}")
}

# launch_print_command NODE_RANK: "node R: <that node's torchrun command>", quoted for a shell
# only where a word needs it (printf %q alone would also escape the commas of --node-ips).
launch_print_command() {
  local line="" word quoted
  launch_torchrun_command "$1"
  for word in "${TORCHRUN[@]}"; do
    if [[ "$word" =~ ^[A-Za-z0-9_./,:=@%+-]+$ ]]; then quoted="$word"; else printf -v quoted '%q' "$word"; fi
    line+="${line:+ }$quoted"
  done
  echo "node $1: $line"
}

# launch_schedule_state: the banner's word on the schedule; with USE_DPP=1 and no pipeline it says
# that --use-dpp is off, and why (launch_prepare passes --use-dpp only from PP=2 on).
launch_schedule_state() {
  if [ "$USE_DPP" = 1 ] && [ "$PP" -lt 2 ]; then
    echo "--use-dpp off (USE_DPP=1 but PP=$PP: the dynamic schedule needs a pipeline; set PP>=2)"
  else
    echo "USE_DPP=$USE_DPP"
  fi
}

# launch_print_provenance: under --dry-run, each flag that did not come from the user, by source,
# and each one the user's replaced (megatron_dpp.launcher_flags), a line each.
launch_print_provenance() {
  local line
  for line in "${PROVENANCE_LINES[@]}"; do
    echo "$LAUNCH_NAME: $line"
  done
}

launch_describe() {
  local node_rank="$1" schedule recipe_words="recipe $RECIPE"
  schedule="$(launch_schedule_state)"
  if [ "$RANKS_PER_GPU" -gt 1 ]; then
    schedule+=", RANKS_PER_GPU=$RANKS_PER_GPU ($RANKS_PER_GPU ranks on each GPU under MPS, gloo collectives)"
  fi
  if [ "$RECIPE_APPLIED" = 0 ]; then recipe_words="no recipe (your model shape)"; fi
  if [ "$LAUNCH_ROLE" = single ]; then
    echo "$LAUNCH_NAME: $NPROC processes, TP=$TP PP=$PP VPP=$VPP, $schedule, $recipe_words${STRATEGY_FILE:+, strategy $STRATEGY_FILE}"
  else
    echo "$LAUNCH_NAME: node $node_rank of $NNODES, $NPROC processes per node, TP=$TP PP=$PP" \
         "VPP=$VPP, $schedule, $recipe_words${STRATEGY_FILE:+, strategy $STRATEGY_FILE}," \
         "master $MASTER_ADDR:$MASTER_PORT"
  fi
}

launch_start() {
  local node_rank="$1"
  launch_describe "$node_rank"
  if [ "$DRY_RUN" = 1 ]; then
    launch_print_command "$node_rank"
    launch_print_provenance
    exit 0
  fi
  launch_torchrun_command "$node_rank"
  cd "$REPO_ROOT"
  exec "${TORCHRUN[@]}"
}

# launch_main ROLE MODEL ARGS...: a whole launch (single, master or worker) of MODEL.
launch_main() {
  local role="$1" model="$2"
  shift 2
  launch_set_model "$model"
  launch_parse_args "$@"
  launch_check_layout_env
  launch_check_nodes "$role"
  launch_prepare
  if [ "$role" = worker ]; then
    launch_precheck "$NODE_RANK"
    launch_start "$NODE_RANK"
  else
    launch_precheck 0
    launch_start 0
  fi
}

# launch_example ROLE MODEL ARGS...: a script with the name, positional arguments and variables of
# one of Megatron-LM's examples/ scripts (examples/*/train_*.sh), run through this launcher. The
# script sets LAUNCH_NAME and EXAMPLE_FLAGS (its flags: a recipe that the user's appended flags
# replace choice by choice), then calls this with the arguments after its positional ones.
# Megatron-LM's variables give the job's layout: GPUS_PER_NODE (the processes of this node, as
# NPROC or MegatronDPP's --num-gpus), NUM_NODES (NNODES), NODE_RANK, MASTER_ADDR, MASTER_PORT
# (default 6000 across nodes, as in Megatron-LM's scripts). ROLE auto: one node alone, else the
# master (NODE_RANK 0) or a worker; the nodes' addresses come from --node-ips (MegatronDPP's) or
# NODE_IPS.
launch_example() {
  local role="$1" model="$2" ips=""
  shift 2
  if [ -n "${GPUS_PER_NODE:-}" ]; then
    if [ -n "${NPROC:-}" ] && [ "$NPROC" != "$GPUS_PER_NODE" ]; then
      launch_fail "NPROC=$NPROC and GPUS_PER_NODE=$GPUS_PER_NODE disagree; set one"
    fi
    NPROC="$GPUS_PER_NODE"
  fi
  if [ -n "${NUM_NODES:-}" ]; then
    if [ -n "${NNODES:-}" ] && [ "$NNODES" != "$NUM_NODES" ]; then
      launch_fail "NNODES=$NNODES and NUM_NODES=$NUM_NODES disagree; set one"
    fi
    NNODES="$NUM_NODES"
  fi
  local args=("$@")
  if launch_value_in ips --node-ips args; then
    if [ -n "${NODE_IPS:-}" ] && [ "$NODE_IPS" != "$ips" ]; then
      launch_fail "NODE_IPS=$NODE_IPS and --node-ips $ips disagree; give the nodes' addresses once"
    fi
    NODE_IPS="$ips"
    if [ -z "${NNODES:-}" ]; then  # one address per node
      NNODES="$(awk -F, '{print NF}' <<<"$ips")"
    fi
  fi
  if [ "$role" = auto ]; then
    if [ "${NNODES:-1}" -le 1 ] 2>/dev/null; then
      role=single
    elif [ "${NODE_RANK:-0}" = 0 ]; then
      role=master
    else
      role=worker
    fi
  fi
  if [ "$role" != single ]; then
    MASTER_PORT="${MASTER_PORT:-6000}"
  fi
  launch_main "$role" "$model" "$@"
}

# launch_example_positionals COUNT USAGE ARGS...: one line (exit 2) unless ARGS begin with COUNT
# positional arguments (none a flag), as USAGE names them.
launch_example_positionals() {
  local count="$1" usage="$2" i
  shift 2
  for ((i = 1; i <= count; i++)); do
    if [ $# -lt "$i" ] || [[ "${!i}" == -* ]]; then
      launch_fail "usage: bash examples/$usage (argument $i of $count is missing)"
    fi
  done
}

# launch_slurm MODEL ARGS...: run_slurm_<model>.sh, which sets LAUNCH_NAME and SCRIPT_DIR (its
# run_scripts directory, also from sbatch's copy of it) first. In a job step: this node's torchrun.
# Outside one (the batch script, or an salloc shell): checks everything, then starts
# $SCRIPT_DIR/$LAUNCH_NAME.sh once per node with srun.
launch_slurm() {
  launch_set_model "$1"
  shift
  launch_parse_args "$@"
  launch_check_layout_env

  NNODES="${SLURM_STEP_NUM_NODES:-${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-}}}"
  NODELIST="${SLURM_STEP_NODELIST:-${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}}"
  if [ -z "$NNODES" ] || [ -z "$NODELIST" ]; then
    launch_fail "not in a SLURM job (SLURM_JOB_NUM_NODES and SLURM_JOB_NODELIST are not set); submit with sbatch or run inside salloc"
  fi
  IN_STEP=0
  if [ -n "${SLURM_STEP_ID:-}" ] && [ "$DRY_RUN" = 0 ]; then
    IN_STEP=1
    if [ "${SLURM_STEP_NUM_TASKS:-$NNODES}" != "$NNODES" ]; then
      launch_fail "the job step runs $SLURM_STEP_NUM_TASKS tasks on $NNODES nodes; start one per node (srun --ntasks-per-node=1)"
    fi
    if [ -z "${SLURM_NODEID:-}" ]; then
      launch_fail "SLURM_NODEID is not set in this job step; start this script with srun"
    fi
    NODE_RANK="$SLURM_NODEID"
    launch_require_int NODE_RANK 0 "$((NNODES - 1))" "a node rank of this $NNODES-node job (SLURM_NODEID)"
  elif [ "$DRY_RUN" = 0 ] && ! command -v srun >/dev/null; then
    launch_fail "srun not found; run this script in a SLURM job (sbatch, or salloc then bash), or pass --dry-run"
  fi

  if [ -z "${NODE_IPS:-}" ]; then
    if [ ! -x "$PY" ]; then
      bash "$REPO_ROOT/run_scripts/setup_env.sh"
    fi
    # Resolved here, once: the batch script hands the result to every node through srun.
    NODE_IPS="$(cd "$REPO_ROOT" && "$PY" -m megatron_dpp.comm.slurm addresses "$NODELIST")"
  fi
  launch_check_nodes slurm
  launch_prepare
  # In a job step this is node NODE_RANK: the check also finds its --node-ips address here.
  if [ "$IN_STEP" = 1 ]; then launch_precheck "$NODE_RANK"; else launch_precheck; fi

  if [ "$DRY_RUN" = 1 ]; then
    launch_describe "0..$((NNODES - 1))"
    for ((rank = 0; rank < NNODES; rank++)); do
      launch_print_command "$rank"
    done
    launch_print_provenance
    exit 0
  fi
  if [ "$IN_STEP" = 0 ]; then
    # The batch script (or an salloc shell): start this script once on every node of the job.
    # One job key for all its nodes, drawn here where none is given: srun hands it to each, and
    # it never travels through the rendezvous store (megatron_dpp/comm/job_key.py).
    if [ -z "${DPP_JOB_KEY:-}" ]; then
      DPP_JOB_KEY="$(cd "$REPO_ROOT" && "$PY" -m megatron_dpp.comm.job_key new)" ||
        launch_fail "cannot draw a job key (python -m megatron_dpp.comm.job_key new)"
    fi
    export NODE_IPS MASTER_ADDR MASTER_PORT DPP_JOB_KEY
    exec srun --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \
      bash "$SCRIPT_DIR/$LAUNCH_NAME.sh" "$@"
  fi
  launch_start "$NODE_RANK"
}
