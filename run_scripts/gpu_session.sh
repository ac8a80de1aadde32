#!/usr/bin/env bash
# The one prepared call of a session lent a GPU machine (docs/gpu.md, "A lent machine's session"):
# set-up from carried wheels, the pipeline comparison (gpu_check.sh --pipeline) and the whole test
# suite, within --deadline seconds, its tables and logs under OUT_DIR (at most 8 files: a lent
# machine returns no more).
#
#   bash run_scripts/gpu_session.sh OUT_DIR [flags]
#
# In this order, each step's time in OUT_DIR/session.txt:
#   setup      PIP_NO_INDEX=1 PIP_FIND_LINKS=.whl setup_env.sh (CC/CXX: the system's gcc/g++),
#              then pytest-xdist from .whl
#   cpu tests  the suite's CPU tests (pytest -m "not gpu", --test-workers workers) on the
#              --suite-cores, in the background, while
#   pipeline   gpu_check.sh --pipeline --skip-tests on the --pipeline-cores (the pipeline's ranks
#              and launchers never share a core with a test), then
#   gpu tests  the GPU tests (pytest -m gpu), after the pipeline: they use the GPU
# Each is stopped at the deadline (what ran is reported). Written to OUT_DIR: session.txt,
# pipeline.txt and pipeline.json (gpu_check.sh's table), tests.txt (both pytest runs' summaries
# and failures), setup.txt (its last lines) and logs.tar.gz (every step's log, the aggregate.py
# reports; not the traces).
#
# Flags:
#   --deadline SECONDS     the whole call's limit (default 560: a lent machine's command has 600)
#   --test-workers N       pytest-xdist workers of the CPU tests (default 8)
#   --suite-cores LIST     the CPU tests' cores, as taskset takes them (default 6-15)
#   --pipeline-cores LIST  the pipeline runs' cores (default 0-5)
#   --pipeline-layers N, --pipeline-hidden-size N, --pipeline-iters N: gpu_check.sh's (its defaults)
#   -h, --help             this text
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NAME=gpu_session
DEADLINE=560
WORKERS=8
SUITE_CORES=6-15
PIPELINE_CORES=0-5
PIPELINE_FLAGS=()

fail_usage() {
  echo "$NAME: $*" >&2
  exit 2
}

require_count() {  # FLAG VALUE
  [[ "$2" =~ ^[1-9][0-9]*$ ]] || fail_usage "$1 $2: expected a positive whole number"
}

case "${1:-}" in
  -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  ""|-*) fail_usage "usage: bash run_scripts/gpu_session.sh OUT_DIR [flags] (see --help)" ;;
esac
OUT_DIR="$1"
shift
while [ $# -gt 0 ]; do
  [ $# -ge 2 ] || fail_usage "$1 needs a value (see --help)"
  case "$1" in
    --deadline) require_count "$1" "$2"; DEADLINE="$2" ;;
    --test-workers) require_count "$1" "$2"; WORKERS="$2" ;;
    --suite-cores) [[ "$2" =~ ^[0-9,-]+$ ]] || fail_usage "--suite-cores $2: expected a CPU list (e.g. 6-15)"; SUITE_CORES="$2" ;;
    --pipeline-cores) [[ "$2" =~ ^[0-9,-]+$ ]] || fail_usage "--pipeline-cores $2: expected a CPU list (e.g. 0-5)"; PIPELINE_CORES="$2" ;;
    --pipeline-layers|--pipeline-hidden-size|--pipeline-iters) require_count "$1" "$2"; PIPELINE_FLAGS+=("$1" "$2") ;;
    *) fail_usage "unknown argument $1 (see --help)" ;;
  esac
  shift 2
done
command -v taskset >/dev/null || fail_usage "taskset is not on PATH (util-linux): the pipeline and the tests need their own cores"
[ -d "$REPO_ROOT/.whl" ] || fail_usage "no $REPO_ROOT/.whl: carry the wheels (docs/gpu.md)"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
WORK="$(mktemp -d /tmp/dpp_gpu_session.XXXXXX)"
cd "$REPO_ROOT"
: >"$OUT_DIR/session.txt"

say() {
  echo "[$SECONDS s] $*" | tee -a "$OUT_DIR/session.txt"
}

left() {  # seconds to the deadline, less a margin for the copies at the end
  echo $((DEADLINE - SECONDS - 15))
}

# collect: what comes back, also when a step ran out of time.
collect() {
  tail -n 40 "$WORK/setup.log" >"$OUT_DIR/setup.txt" 2>/dev/null || true
  for name in pipeline.txt pipeline.json; do
    [ ! -f "$WORK/check/$name" ] || cp "$WORK/check/$name" "$OUT_DIR/$name"
  done
  : >"$OUT_DIR/tests.txt"
  for part in cpu gpu; do
    if [ -f "$WORK/tests_$part.log" ]; then
      { echo "== $part tests (last 150 lines)"; tail -n 150 "$WORK/tests_$part.log"; } >>"$OUT_DIR/tests.txt"
    fi
  done
  (cd "$WORK" && tar -czf "$OUT_DIR/logs.tar.gz" --exclude='check/pipeline/traces' .) || true
}
trap collect EXIT

say "setup (at most 180 s)"
status=0
PIP_NO_INDEX=1 PIP_FIND_LINKS="$REPO_ROOT/.whl" CC=/usr/bin/gcc CXX=/usr/bin/g++ \
  timeout --kill-after=10 180 bash run_scripts/setup_env.sh >"$WORK/setup.log" 2>&1 || status=$?
[ "$status" = 0 ] || { say "setup failed (exit status $status): setup.txt"; exit 1; }
"$REPO_ROOT/.venv/bin/python" -m pip install -q --no-index --find-links "$REPO_ROOT/.whl" pytest-xdist \
  >>"$WORK/setup.log" 2>&1 || { say "pytest-xdist is not in .whl: setup.txt"; exit 1; }
PY="$REPO_ROOT/.venv/bin/python"

say "cpu tests in the background on cores $SUITE_CORES, $WORKERS workers (at most $(left) s)"
taskset -c "$SUITE_CORES" timeout --kill-after=10 "$(left)" env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 \
  "$PY" -m pytest -q -p no:cacheprovider -n "$WORKERS" -m "not gpu" tests >"$WORK/tests_cpu.log" 2>&1 &
cpu_tests=$!

say "pipeline on cores $PIPELINE_CORES"
status=0
taskset -c "$PIPELINE_CORES" timeout --kill-after=10 "$(left)" bash run_scripts/gpu_check.sh --pipeline \
  --skip-tests --step-timeout 150 "${PIPELINE_FLAGS[@]}" --output-dir "$WORK/check" \
  >"$WORK/pipeline.log" 2>&1 || status=$?
say "pipeline done (exit status $status)"

if [ "$(left)" -gt 30 ]; then
  say "gpu tests (at most $(left) s)"
  status=0
  timeout --kill-after=10 "$(left)" "$PY" -m pytest -q -p no:cacheprovider -m gpu tests \
    >"$WORK/tests_gpu.log" 2>&1 || status=$?
  say "gpu tests done (exit status $status)"
else
  say "gpu tests left out: $(left) s left"
fi
# Bounded: the CPU tests run under their own timeout, to the deadline.
status=0
wait "$cpu_tests" || status=$?
say "cpu tests done (exit status $status; 124: stopped at the deadline)"
