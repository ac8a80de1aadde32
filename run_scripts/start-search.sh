#!/usr/bin/env bash
# Search the parallel layout and pipeline schedule of one model on one cluster: prints the fastest
# layouts, the winner as a Megatron command line and its strategy JSON (the run scripts' --strategy).
# Works from any directory; sets up the Python environment when missing.
#
#   run_scripts/start-search.sh --num-layers 96 --hidden-size 12288 --num-attention-heads 96 \
#       --seq-length 2048 --global-batch-size 1536 --num-nodes 128 --num-gpus-per-node 8 \
#       --hardware 8xH100-nvlink-ib400 --memory-budget-gb 80 --bf16 --output-strategy runs/175b.json
#
# Every argument goes to megatron_dpp.search.cli (--help lists and explains them). Bad flags, or no
# layout that fits the memory budget: one line on stderr, exit 2.
#
# Environment (optional):
#   DPP_VENV      the Python environment to use (default: <repo>/.venv, created by setup_env.sh)
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DPP_VENV:-$REPO_ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  bash "$REPO_ROOT/run_scripts/setup_env.sh" >&2
fi
exec "$VENV/bin/python" -m megatron_dpp.search.cli "$@"
