#!/usr/bin/env bash
#SBATCH --job-name=megatron-dpp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
# Train GPT on the nodes of a SLURM job: one torchrun per node, the node list and ranks from SLURM.
# The #SBATCH lines above are examples; options on the command line override them.
#
#   sbatch --nodes=4 --gpus-per-node=8 run_scripts/run_slurm_gpt.sh [trainer flags]
#   srun --nodes=2 --ntasks-per-node=1 bash run_scripts/run_slurm_gpt.sh [trainer flags]
#   bash run_scripts/run_slurm_gpt.sh --dry-run      # in a job: print each node's torchrun command
#
# Submit from the repository root: sbatch runs a copy of this script, and the repository is then
# found as SLURM_SUBMIT_DIR. Run as the batch script (outside any job step), it checks the flags
# and starts itself once per node with `srun --ntasks-per-node=1`. Relative paths, in flags and
# variables, are the job's working directory's (the submit directory unless sbatch --chdir).
#
# From SLURM (the job step's variables when inside one, else the job's):
#   NNODES        SLURM_STEP_NUM_NODES, SLURM_JOB_NUM_NODES or SLURM_NNODES
#   NODE_RANK     SLURM_NODEID
#   NODE_IPS      each host of SLURM_STEP_NODELIST / SLURM_JOB_NODELIST resolved to its address,
#                 unless NODE_IPS is set (e.g. to the nodes' InfiniBand addresses); passed as
#                 --multi-node --node-ips
#   MASTER_ADDR   the first of NODE_IPS, unless set
# Environment, as in run_master_gpt.sh: MASTER_PORT (default 29500), NPROC (processes per node),
# PP, TP, VPP, USE_DPP, RECIPE, DATA_DIR, DATA_ARGS.
# Extra arguments are passed to megatron_dpp.pretrain_gpt: Megatron-LM's flags, which replace
# the recipe's and the launcher's of the same choice (megatron_dpp/launcher_flags.py).
# --strategy FILE (among them): the model shape, batch, layout and schedule of a strategy JSON
# written by run_scripts/start-search.sh; it replaces PP, TP, VPP, USE_DPP and NPROC.
# --dry-run (anywhere among them) checks everything, prints the torchrun command of every node
# (one line per node, with its rank) and starts nothing. Bad variables or flags: one line on stderr,
# exit code 2, before anything starts.
set -euo pipefail
LAUNCH_NAME=run_slurm_gpt
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

launch_slurm gpt "$@"
