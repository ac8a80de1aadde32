#!/usr/bin/env bash
# One check of this project on a GPU machine. It runs, each step logged under --output-dir:
#   tests      the GPU tests (pytest -m gpu: CUDA IPC, GPT/BERT bf16, the runtime without host syncs,
#              DPP against Megatron's schedule on 2+ GPUs)
#   transport  benchmarks/transport_bench.py --device cuda --json (CUDA IPC one-way times against a
#              device copy; NCCL on 2+ GPUs)
#   transport-mps  the same under NVIDIA's Multi-Process Service, where nvidia-cuda-mps-control is
#              on PATH: the two processes then share the GPU without switching between them. The
#              script starts a private MPS daemon (its own pipe and log directories) and stops it.
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
    --output-dir|--train-iters|--gpt-global-batch-size|--bert-global-batch-size|--anchor-steps|--step-timeout|--test-workers)
      [ $# -ge 2 ] || fail_usage "$1 needs a value (see --help)"
      case "$1" in
        --output-dir) OUTPUT_DIR="$2" ;;
        --train-iters) require_count "$1" "$2"; TRAIN_ITERS="$2" ;;
        --gpt-global-batch-size) require_count "$1" "$2"; GPT_GBS="$2" ;;
        --bert-global-batch-size) require_count "$1" "$2"; BERT_GBS="$2" ;;
        --anchor-steps) require_count "$1" "$2"; ANCHOR_STEPS="$2" ;;
        --step-timeout) require_count "$1" "$2"; STEP_TIMEOUT="$2" ;;
        --test-workers) require_count "$1" "$2"; TEST_WORKERS="$2" ;;
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
[ -x "$PY" ] || fail_usage "no Python environment at $(dirname "$(dirname "$PY")"); run run_scripts/setup_env.sh first"
if [ -n "$TEST_WORKERS" ] && ! "$PY" -c "import xdist" >/dev/null 2>&1; then
  fail_usage "--test-workers $TEST_WORKERS needs pytest-xdist in $(dirname "$(dirname "$PY")") (pip install pytest-xdist)"
fi

GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
if [ "$GPUS" -eq 0 ]; then
  echo "$NAME: no CUDA GPU here (torch.cuda.is_available() is False); nothing to check"
  exit 0
fi

OUTPUT_DIR="${OUTPUT_DIR:-$REPO_ROOT/runs/gpu_check-$(date -u +%Y%m%d-%H%M%S)}"
mkdir -p "$OUTPUT_DIR"
OUTPUT_DIR="$(cd "$OUTPUT_DIR" && pwd)"
STEPS="$OUTPUT_DIR/steps.tsv"
: >"$STEPS"
cd "$REPO_ROOT"

# step NAME LOG COMMAND...: runs COMMAND with its output in OUTPUT_DIR/LOG, at most STEP_TIMEOUT
# seconds (then TERM, KILL 10 s later: exit status 124 or 137); records its exit status. A shell
# function here (transport_under_mps) applies the limit itself, to what it starts.
step() {
  local name="$1" log="$2" started status=0
  shift 2
  echo "$NAME: $name ... (log: $OUTPUT_DIR/$log)"
  started=$SECONDS
  if declare -F "$1" >/dev/null; then
    "$@" >"$OUTPUT_DIR/$log" 2>&1 || status=$?
  else
    timeout --kill-after=10 "$STEP_TIMEOUT" "$@" >"$OUTPUT_DIR/$log" 2>&1 || status=$?
  fi
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$log" "$((SECONDS - started))" >>"$STEPS"
}

# One GPU, no pipeline, the recipe's model; the log reports every 5 iterations.
# The recipes' warm-up (200, 10000 iterations) must be shorter than the run.
SMOKE_FLAGS=(--train-iters "$TRAIN_ITERS" --log-interval 5 --eval-iters 0 --lr-warmup-iters 2)
if [ "$RUN_TESTS" = 1 ]; then
  TEST_ARGS=(-q -p no:cacheprovider)
  [ "$WHOLE_SUITE" = 1 ] || TEST_ARGS+=(-m gpu)
  [ -z "$TEST_WORKERS" ] || TEST_ARGS+=(-n "$TEST_WORKERS")
  # The whole suite's CPU ranks want one thread each, as run_tests.sh sets.
  step tests tests.log env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 "$PY" -m pytest "${TEST_ARGS[@]}" tests
fi
step transport transport.log "$PY" benchmarks/transport_bench.py --device cuda \
  --json "$OUTPUT_DIR/transport_cuda.json"
# transport_under_mps JSON: the transport benchmark with a private MPS daemon running (a short
# directory under /tmp: the daemon's socket path must stay under 108 characters), stopped after,
# also when the benchmark ran out of time.
# A subshell, so that the MPS variables stay out of the later steps.
transport_under_mps() (
  local dir status=0
  dir="$(mktemp -d /tmp/dpp_mps.XXXXXX)"
  export CUDA_MPS_PIPE_DIRECTORY="$dir/pipe" CUDA_MPS_LOG_DIRECTORY="$dir/log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || { echo "nvidia-cuda-mps-control -d failed"; return 1; }
  timeout --kill-after=10 "$STEP_TIMEOUT" "$PY" benchmarks/transport_bench.py --device cuda \
    --json "$1" || status=$?
  echo quit | nvidia-cuda-mps-control || status=1
  cat "$CUDA_MPS_LOG_DIRECTORY"/control.log 2>/dev/null | tail -5
  rm -rf "$dir"
  return "$status"
)
if [ "$RUN_MPS" = 1 ]; then
  if command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
    step transport-mps transport_mps.log transport_under_mps "$OUTPUT_DIR/transport_cuda_mps.json"
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
