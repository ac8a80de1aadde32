#!/usr/bin/env bash
# The project's test command: sets up the environment if needed, then runs the whole pytest suite.
# Extra arguments go to pytest, e.g. `bash run_scripts/run_tests.sh -k sched -x`.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DPP_VENV:-$REPO_ROOT/.venv}"

bash "$REPO_ROOT/run_scripts/setup_env.sh"

# One thread per rank: the multi-process tests put several ranks on each core.
export OMP_NUM_THREADS=1
export MKL_NUM_THREADS=1
export PYTHONDONTWRITEBYTECODE=1
cd "$REPO_ROOT"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=15 tests "$@"
