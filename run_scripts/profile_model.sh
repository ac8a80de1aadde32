#!/usr/bin/env bash
# Profile one GPT or BERT transformer layer with Megatron-Core (one process) and write Galvatron's
# model profile files into --output-dir:
#   computation_profiling_{dtype}_hidden_{h}_head_{a}.json   forward ms per layer, per batch and seq
#   memory_profiling_{dtype}_hidden_{h}_head_{a}.json        parameter and activation MB per layer,
#                                                            embedding/output ("other") memory
#   megatron_dpp_profiling_{dtype}_hidden_{h}_head_{a}.json  our companion: backward ms, selective
#                                                            recompute activations, the source
# Usage (every flag: --help):
#   run_scripts/profile_model.sh --model gpt --hidden-size 1024 --num-attention-heads 16 \
#       --seq-lengths 512 1024 2048 --micro-batch-sizes 1 2 4 8 --bf16 --output-dir runs/profile
# Environment:
#   OMP_NUM_THREADS  torch's CPU threads (default 1, as the run scripts train on CPU); the
#                    timings are for this.
#   DPP_VENV         the Python environment to use (default: $REPO_ROOT/.venv, created by
#                    run_scripts/setup_env.sh when missing).
# Bad flags: one line on stderr, exit code 2, before any work.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DPP_VENV:-$REPO_ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  bash "$REPO_ROOT/run_scripts/setup_env.sh"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# The package is installed in the environment (editable): relative --output-dir paths stay the
# caller's.
exec "$VENV/bin/python" -m megatron_dpp.search.model_measurement "$@"
