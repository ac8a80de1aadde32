#!/usr/bin/env bash
#SBATCH --job-name=megatron-dpp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
# Train Llama on the nodes of a SLURM job: one torchrun per node, the node list and ranks from SLURM.
# The same environment, flags and behaviour as run_slurm_gpt.sh (see there), with Llama's recipes
# (RECIPE, examples/llama/) and sample data; extra arguments go to megatron_dpp.pretrain --model llama.
#
#   sbatch --nodes=4 --gpus-per-node=8 run_scripts/run_slurm_llama.sh [trainer flags]
#   srun --nodes=2 --ntasks-per-node=1 bash run_scripts/run_slurm_llama.sh [trainer flags]
#   bash run_scripts/run_slurm_llama.sh --dry-run    # in a job: print each node's torchrun command
set -euo pipefail
LAUNCH_NAME=run_slurm_llama
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ ! -f "$SCRIPT_DIR/_launch.sh" ]; then
  SCRIPT_DIR="${SLURM_SUBMIT_DIR:-$PWD}/run_scripts"  # sbatch's copy of this script
fi
if [ ! -f "$SCRIPT_DIR/_launch.sh" ]; then
  echo "$LAUNCH_NAME: cannot find run_scripts/_launch.sh; submit from the repository root (sbatch run_scripts/$LAUNCH_NAME.sh)" >&2
  exit 2
fi
# shellcheck source=run_scripts/_launch.sh
source "$SCRIPT_DIR/_launch.sh"

launch_slurm llama "$@"
