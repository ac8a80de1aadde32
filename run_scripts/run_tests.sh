#!/usr/bin/env bash
# The project's test command: sets up the environment if needed, then runs the whole pytest suite.
# Extra arguments go to pytest, e.g. `bash run_scripts/run_tests.sh -k sched -x`.
# DPP_TEST_WORKERS: pytest-xdist workers (default 2; 0 runs the tests in this one process). Each
# test file goes to one worker (its module fixtures run once); tests marked `alone` run while no
# other test does (tests/_alone.py). On CI's two cores two workers took 1190 s, one 1931 s.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DPP_VENV:-$REPO_ROOT/.venv}"
WORKERS="${DPP_TEST_WORKERS:-2}"
case "$WORKERS" in
  ''|*[!0-9]*) echo "run_tests: DPP_TEST_WORKERS=$WORKERS is not a number of workers (0 for none)" >&2; exit 2 ;;
esac

bash "$REPO_ROOT/run_scripts/setup_env.sh"

# One thread per rank: the multi-process tests put several ranks on each core.
export OMP_NUM_THREADS=1
export MKL_NUM_THREADS=1
export PYTHONDONTWRITEBYTECODE=1
cd "$REPO_ROOT"
PARALLEL=()
[ "$WORKERS" = 0 ] || PARALLEL=(-n "$WORKERS" --dist loadfile)
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=15 "${PARALLEL[@]}" tests "$@"
