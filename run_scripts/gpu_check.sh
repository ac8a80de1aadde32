#!/usr/bin/env bash
# One check of this project on a GPU machine. It runs, each step logged under --output-dir:
#   tests      the GPU tests (pytest -m gpu: CUDA IPC, GPT/BERT bf16, the runtime without host syncs,
#              DPP against Megatron's schedule on 2+ GPUs)
#   transport  benchmarks/transport_bench.py --device cuda --json (CUDA IPC one-way times against a
#              device copy; NCCL on 2+ GPUs)
#   transport-mps  the same under NVIDIA's Multi-Process Service, where nvidia-cuda-mps-control is
#              on PATH: the two processes then share the GPU without switching between them, each
#              with half the SMs. A private MPS daemon (its own pipe and log directories) runs for
#              the step (python -m megatron_dpp.shared_gpu, as RANKS_PER_GPU=2 runs ranks).
#   attention-shapes  benchmarks/sdpa_shapes.py --device cuda --json: SDPA forward+backward per
#              backend at one repeated sequence length against a new length each call, the shapes
#              --variable-seq-lengths makes (cuDNN's attention builds a graph for every new shape)
#   gpt, bert  run_single_gpt.sh / run_single_bert.sh with the GPU recipes (gpt3_125m, bert_base)
#              at pp=1 on one GPU, a few iterations; tokens/s from the log
#   gpt-fused  the GPT run again with Megatron-Core's torch.compile'd bias-gelu and bias-dropout-add
#              fusions, which the gpt3_125m recipe turns off (host time against device time)
#   gpt-graphs the GPT run again with --cuda-graph-impl local (Megatron-Core's CUDA graphs of each
#              transformer layer: the host launches one graph per layer instead of its kernels)
#   anchor     benchmarks/gpu_speed_anchor.py: a plain PyTorch GPT of the GPT run's shape and work,
#              SDPA attention and, for reference, attention written out (--unfused)
# and prints one table (what ran, pass/fail, GPT tokens/s against the SDPA anchor, whose target is
# >= 0.8x, and the IPC figures), also written to OUTPUT_DIR/summary.txt and summary.json.
# Without a GPU it says so in one line and exits 0. It exits 1 when a step failed.
#
# With --pipeline, in place of the one-GPU steps above (transport ... anchor), first:
#   pipeline/*  a GPT pipeline on ONE GPU, its ranks sharing it (RANKS_PER_GPU = the pipeline size:
#              a private MPS daemon, each rank its share of the SMs, activations by CUDA IPC), at
#              pp=2 and pp=4, on packed data and on unpacked variable-length documents
#              (--variable-seq-lengths), each with Megatron's 1F1B (USE_DPP=0), --use-dpp,
#              --use-dpp --dpp-split-backward and the V placement (--use-dpp
#              --num-virtual-stages-per-pipeline-rank 2 --dpp-stage-placement v
#              --dpp-split-backward; --pipeline-v-policy zb-v adds --dpp-policy zb-v), all with
#              --trace, then profiling/aggregate.py on each trace; the same seed, data and
#              batches, no dropout
# then the tests step. One table, OUTPUT_DIR/pipeline.txt and pipeline.json: per run ms per
# iteration and tokens/s (global batch x --seq-length over the median iteration, the first 3
# left out), the ratio to 1F1B of the same pp and data (median over the iterations paired batch
# by batch) with its quartiles, the bubble (aggregate.py's total), each rank's peak allocated
# memory, and the largest relative difference of its losses from 1F1B's.
#
# Flags:
#   --output-dir DIR            where logs and results go (default: runs/gpu_check-<UTC time>)
#   --train-iters N             iterations of each smoke run (default 30)
#   --gpt-global-batch-size N   GPT smoke run's global batch, micro-batches of 4 (default 32: 8 per
#                               step, as the anchor's default)
#   --bert-global-batch-size N  BERT smoke run's global batch (default 64)
#   --anchor-steps N            measured steps of each anchor run (default 10)
#   --step-timeout SECONDS      stop a step that runs longer (exit status 124 in the table,
#                               "timed out"), so that one hung step leaves the others (default 1200)
#   --skip-tests                leave out pytest -m gpu
#   --whole-suite               the tests step runs the whole suite, not only -m gpu: the CPU tests
#                               pin their ranks to the CPU (tests/conftest.py), the GPU tests run
#                               on the GPUs
#   --test-workers N            run the tests step in N pytest-xdist workers (pytest -n N; needs
#                               pytest-xdist in the environment), e.g. to fit the whole suite into
#                               a lent machine's minutes
#   --skip-mps                  leave out transport-mps
#   --pipeline                  the pipeline comparison above, then the tests step, instead of
#                               the one-GPU steps
#   --pipeline-layers N         the pipeline GPT's layers (default 8; a multiple of 8: pp=4 with
#                               two virtual stages per rank)
#   --pipeline-hidden-size N    its hidden size (default 1024, heads of 64: a multiple of 64)
#   --pipeline-seq-length N     its sequence length (default 1024)
#   --pipeline-iters N          iterations of each pipeline run (default 12, at least 6; 8
#                               micro-batches of 2 each)
#   --pipeline-v-policy P       the V placement's --dpp-policy (default: the runtime's; e.g. zb-v)
#   --dry-run                   print each pipeline run's command (one line each, "NAME: COMMAND")
#                               and exit 0, on any machine; with --pipeline only
#   -h, --help                  this text
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Relative paths (DPP_VENV, --output-dir) are the caller's; this script later runs in REPO_ROOT.
if [ -n "${DPP_VENV:-}" ] && [[ "$DPP_VENV" != /* ]]; then DPP_VENV="$PWD/$DPP_VENV"; fi
PY="${DPP_VENV:-$REPO_ROOT/.venv}/bin/python"
NAME=gpu_check
# The GPU recipes' sequence lengths, passed to the smoke runs and the anchor alike.
GPT_SEQ_LENGTH=2048
BERT_SEQ_LENGTH=512
GPT_MICRO_BATCH=4

OUTPUT_DIR=""
TRAIN_ITERS=30
GPT_GBS=32
BERT_GBS=64
ANCHOR_STEPS=10
STEP_TIMEOUT=1200
RUN_TESTS=1
RUN_MPS=1
WHOLE_SUITE=0
TEST_WORKERS=""
PIPELINE=0
PIPELINE_LAYERS=8
PIPELINE_HIDDEN=1024
PIPELINE_SEQ=1024
PIPELINE_ITERS=12
PIPELINE_V_POLICY=""
DRY_RUN=0
# The pipeline runs' batch: 8 micro-batches of 2 (enough for pp=4 to fill its pipeline).
PIPELINE_MICRO_BATCH=2
PIPELINE_GBS=16

fail_usage() {
  echo "$NAME: $*" >&2
  exit 2
}

require_count() {  # FLAG VALUE
  [[ "$2" =~ ^[1-9][0-9]*$ ]] || fail_usage "$1 $2: expected a positive whole number"
}

while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    --skip-tests) RUN_TESTS=0 ;;
    --skip-mps) RUN_MPS=0 ;;
    --whole-suite) WHOLE_SUITE=1 ;;
    --pipeline) PIPELINE=1 ;;
    --dry-run) DRY_RUN=1 ;;
    --output-dir|--train-iters|--gpt-global-batch-size|--bert-global-batch-size|--anchor-steps|--step-timeout|--test-workers|\
    --pipeline-layers|--pipeline-hidden-size|--pipeline-seq-length|--pipeline-iters|--pipeline-v-policy)
      [ $# -ge 2 ] || fail_usage "$1 needs a value (see --help)"
      case "$1" in
        --output-dir) OUTPUT_DIR="$2" ;;
        --train-iters) require_count "$1" "$2"; TRAIN_ITERS="$2" ;;
        --gpt-global-batch-size) require_count "$1" "$2"; GPT_GBS="$2" ;;
        --bert-global-batch-size) require_count "$1" "$2"; BERT_GBS="$2" ;;
        --anchor-steps) require_count "$1" "$2"; ANCHOR_STEPS="$2" ;;
        --step-timeout) require_count "$1" "$2"; STEP_TIMEOUT="$2" ;;
        --test-workers) require_count "$1" "$2"; TEST_WORKERS="$2" ;;
        --pipeline-layers) require_count "$1" "$2"; PIPELINE_LAYERS="$2" ;;
        --pipeline-hidden-size) require_count "$1" "$2"; PIPELINE_HIDDEN="$2" ;;
        --pipeline-seq-length) require_count "$1" "$2"; PIPELINE_SEQ="$2" ;;
        --pipeline-iters) require_count "$1" "$2"; PIPELINE_ITERS="$2" ;;
        --pipeline-v-policy)
          [[ "$2" =~ ^[a-z0-9:+_-]+$ ]] || fail_usage "--pipeline-v-policy $2: expected a --dpp-policy name (e.g. zb-v)"
          PIPELINE_V_POLICY="$2" ;;
      esac
      shift ;;
    *) fail_usage "unknown argument $1 (see --help)" ;;
  esac
  shift
done
if [ $((GPT_GBS % GPT_MICRO_BATCH)) -ne 0 ]; then
  fail_usage "--gpt-global-batch-size $GPT_GBS: expected a multiple of the micro-batch, $GPT_MICRO_BATCH"
fi
if [ "$TRAIN_ITERS" -lt 10 ]; then
  fail_usage "--train-iters $TRAIN_ITERS: expected at least 10 (tokens/s leaves out the first 5)"
fi
if [ "$RUN_TESTS" = 0 ] && { [ "$WHOLE_SUITE" = 1 ] || [ -n "$TEST_WORKERS" ]; }; then
  fail_usage "--skip-tests leaves the tests out; remove it, or --whole-suite / --test-workers"
fi
if [ "$PIPELINE" = 0 ] && [ "$DRY_RUN" = 1 ]; then
  fail_usage "--dry-run prints the pipeline runs; add --pipeline"
fi
if [ $((PIPELINE_LAYERS % 8)) -ne 0 ]; then
  fail_usage "--pipeline-layers $PIPELINE_LAYERS: expected a multiple of 8 (pp=4 x 2 virtual stages)"
fi
if [ $((PIPELINE_HIDDEN % 64)) -ne 0 ]; then
  fail_usage "--pipeline-hidden-size $PIPELINE_HIDDEN: expected a multiple of 64 (heads of 64)"
fi
if [ "$PIPELINE_ITERS" -lt 6 ]; then
  fail_usage "--pipeline-iters $PIPELINE_ITERS: expected at least 6 (the first 3 are left out)"
fi

# pipeline_runs: PIPELINE_NAMES and, per name, PIPELINE_COMMAND_<i> (the run_single_gpt.sh command
# of each pipeline run, traced into OUTPUT_DIR/pipeline/traces/NAME), in the order they run: per
# pp and data, 1F1B first, each DPP variant after it.
pipeline_runs() {
  local pp data schedule name i=0 flags words
  PIPELINE_NAMES=()
  for pp in 2 4; do
    for data in packed varlen; do
      for schedule in 1f1b dpp dpp-split v; do
        name="pp$pp-$data-$schedule"
        flags=(--num-layers "$PIPELINE_LAYERS" --hidden-size "$PIPELINE_HIDDEN"
               --num-attention-heads "$((PIPELINE_HIDDEN / 64))" --seq-length "$PIPELINE_SEQ"
               --max-position-embeddings "$PIPELINE_SEQ" --micro-batch-size "$PIPELINE_MICRO_BATCH"
               --global-batch-size "$PIPELINE_GBS" --train-iters "$PIPELINE_ITERS" --lr 1e-4
               --lr-warmup-iters 0 --bf16 --hidden-dropout 0 --attention-dropout 0 --seed 1234
               --log-interval 1 --eval-iters 0 --trace --trace-dir "$OUTPUT_DIR/pipeline/traces/$name")
        [ "$data" = packed ] || flags+=(--variable-seq-lengths)
        case "$schedule" in
          1f1b) words=(env USE_DPP=0) ;;
          dpp) words=(env USE_DPP=1) ;;
          dpp-split) words=(env USE_DPP=1); flags+=(--dpp-split-backward) ;;
          v) words=(env USE_DPP=1)
             flags+=(--num-virtual-stages-per-pipeline-rank 2 --dpp-stage-placement v --dpp-split-backward)
             [ -z "$PIPELINE_V_POLICY" ] || flags+=(--dpp-policy "$PIPELINE_V_POLICY") ;;
        esac
        words+=(PP="$pp" TP=1 NPROC="$pp" RANKS_PER_GPU="$pp" bash run_scripts/run_single_gpt.sh "${flags[@]}")
        PIPELINE_NAMES+=("$name")
        printf -v "PIPELINE_COMMAND_$i" '%q ' "${words[@]}"
        i=$((i + 1))
      done
    done
  done
}

if [ -n "$OUTPUT_DIR" ] && [[ "$OUTPUT_DIR" != /* ]]; then OUTPUT_DIR="$PWD/$OUTPUT_DIR"; fi
OUTPUT_DIR="${OUTPUT_DIR:-$REPO_ROOT/runs/gpu_check-$(date -u +%Y%m%d-%H%M%S)}"
if [ "$DRY_RUN" = 1 ]; then
  pipeline_runs
  for i in "${!PIPELINE_NAMES[@]}"; do
    command_var="PIPELINE_COMMAND_$i"
    echo "${PIPELINE_NAMES[i]}: ${!command_var% }"
  done
  exit 0
fi
[ -x "$PY" ] || fail_usage "no Python environment at $(dirname "$(dirname "$PY")"); run run_scripts/setup_env.sh first"
if [ -n "$TEST_WORKERS" ] && ! "$PY" -c "import xdist" >/dev/null 2>&1; then
  fail_usage "--test-workers $TEST_WORKERS needs pytest-xdist in $(dirname "$(dirname "$PY")") (pip install pytest-xdist)"
fi

GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
if [ "$GPUS" -eq 0 ]; then
  echo "$NAME: no CUDA GPU here (torch.cuda.is_available() is False); nothing to check"
  exit 0
fi

mkdir -p "$OUTPUT_DIR"
OUTPUT_DIR="$(cd "$OUTPUT_DIR" && pwd)"
STEPS="$OUTPUT_DIR/steps.tsv"
: >"$STEPS"
cd "$REPO_ROOT"

# step NAME LOG COMMAND...: runs COMMAND with its output in OUTPUT_DIR/LOG, at most STEP_TIMEOUT
# seconds (then TERM, KILL 10 s later: exit status 124 or 137); records its exit status.
step() {
  local name="$1" log="$2" started status=0
  shift 2
  echo "$NAME: $name ... (log: $OUTPUT_DIR/$log)"
  started=$SECONDS
  timeout --kill-after=10 "$STEP_TIMEOUT" "$@" >"$OUTPUT_DIR/$log" 2>&1 || status=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$log" "$((SECONDS - started))" >>"$STEPS"
}

# One GPU, no pipeline, the recipe's model; the log reports every 5 iterations.
# The recipes' warm-up (200, 10000 iterations) must be shorter than the run.
SMOKE_FLAGS=(--train-iters "$TRAIN_ITERS" --log-interval 5 --eval-iters 0 --lr-warmup-iters 2)
tests_step() {
  [ "$RUN_TESTS" = 1 ] || return 0
  TEST_ARGS=(-q -p no:cacheprovider)
  [ "$WHOLE_SUITE" = 1 ] || TEST_ARGS+=(-m gpu)
  [ -z "$TEST_WORKERS" ] || TEST_ARGS+=(-n "$TEST_WORKERS")
  # The whole suite's CPU ranks want one thread each, as run_tests.sh sets.
  step tests tests.log env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 "$PY" -m pytest "${TEST_ARGS[@]}" tests
}

if [ "$PIPELINE" = 1 ]; then
  # The pipeline first (its figures are what a lent machine's minutes are for), then the tests.
  mkdir -p "$OUTPUT_DIR/pipeline/traces"
  pipeline_runs
  for i in "${!PIPELINE_NAMES[@]}"; do
    name="${PIPELINE_NAMES[i]}"
    command_var="PIPELINE_COMMAND_$i"
    step "pipeline/$name" "pipeline/$name.log" bash -c "${!command_var}"
    if [ "$(tail -n 1 "$STEPS" | cut -f 2)" = 0 ]; then
      step "aggregate/$name" "pipeline/$name-aggregate.log" "$PY" profiling/aggregate.py \
        --benchmark_dir "$OUTPUT_DIR/pipeline/traces/$name"
    fi
  done
  tests_step
  status=0
  "$PY" "$REPO_ROOT/run_scripts/_gpu_pipeline_report.py" "$OUTPUT_DIR" --seq-length "$PIPELINE_SEQ" \
    | tee "$OUTPUT_DIR/pipeline.txt" || status=$?
  exit "$status"
fi
tests_step
step transport transport.log "$PY" benchmarks/transport_bench.py --device cuda \
  --json "$OUTPUT_DIR/transport_cuda.json"
if [ "$RUN_MPS" = 1 ]; then
  if command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
    # Under a private MPS daemon, as RANKS_PER_GPU=2 runs ranks (megatron_dpp.shared_gpu: its
    # directories under a fresh /tmp/dpp_mps.*, each process with 50% of the SMs, the daemon
    # stopped after, also when the step's timeout stops the benchmark).
    step transport-mps transport_mps.log "$PY" -m megatron_dpp.shared_gpu --ranks-per-gpu 2 -- \
      "$PY" benchmarks/transport_bench.py --device cuda --json "$OUTPUT_DIR/transport_cuda_mps.json"
  else
    echo "$NAME: transport-mps left out: nvidia-cuda-mps-control is not on PATH"
  fi
fi
# What a new sequence length costs each attention backend (docs/gpu.md, "Variable lengths").
step attention-shapes attention_shapes.log "$PY" benchmarks/sdpa_shapes.py --device cuda \
  --json "$OUTPUT_DIR/sdpa_shapes.json"
GPT_RUN=(env PP=1 TP=1 NPROC=1 bash run_scripts/run_single_gpt.sh "${SMOKE_FLAGS[@]}"
         --seq-length "$GPT_SEQ_LENGTH" --max-position-embeddings "$GPT_SEQ_LENGTH"
         --micro-batch-size "$GPT_MICRO_BATCH" --global-batch-size "$GPT_GBS")
step gpt gpt.log "${GPT_RUN[@]}"
# The same run with Megatron-Core's torch.compile'd fusions, which the recipe turns off (docs/gpu.md).
step gpt-fused gpt_fused.log "${GPT_RUN[@]}" --bias-gelu-fusion --bias-dropout-fusion
# The same run with Megatron-Core's CUDA graphs of each layer (docs/gpu.md, "CUDA graphs").
step gpt-graphs gpt_graphs.log "${GPT_RUN[@]}" --cuda-graph-impl local
step bert bert.log env PP=1 TP=1 NPROC=1 bash run_scripts/run_single_bert.sh "${SMOKE_FLAGS[@]}" \
  --seq-length "$BERT_SEQ_LENGTH" --max-position-embeddings "$BERT_SEQ_LENGTH" \
  --global-batch-size "$BERT_GBS"
ANCHOR_FLAGS=(--seq-length "$GPT_SEQ_LENGTH" --micro-batch-size "$GPT_MICRO_BATCH"
              --micro-batches "$((GPT_GBS / GPT_MICRO_BATCH))" --steps "$ANCHOR_STEPS")
step anchor anchor.log "$PY" benchmarks/gpu_speed_anchor.py "${ANCHOR_FLAGS[@]}" \
  --json "$OUTPUT_DIR/anchor_sdpa.json"
step anchor-unfused anchor_unfused.log "$PY" benchmarks/gpu_speed_anchor.py "${ANCHOR_FLAGS[@]}" \
  --unfused --json "$OUTPUT_DIR/anchor_unfused.json"

"$PY" "$REPO_ROOT/run_scripts/_gpu_check_report.py" "$OUTPUT_DIR" \
  --gpt-seq-length "$GPT_SEQ_LENGTH" --bert-seq-length "$BERT_SEQ_LENGTH" | tee "$OUTPUT_DIR/summary.txt"
exit "${PIPESTATUS[0]}"
