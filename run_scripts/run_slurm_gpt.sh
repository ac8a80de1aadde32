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
# Extra arguments are passed to megatron_dpp.pretrain_gpt and override the recipe's flags.
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
  echo "$LAUNCH_NAME: cannot find run_scripts/_launch.sh; submit from the repository root (sbatch run_scripts/run_slurm_gpt.sh)" >&2
  exit 2
fi
# shellcheck source=run_scripts/_launch.sh
source "$SCRIPT_DIR/_launch.sh"

launch_set_model gpt
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
  exit 0
fi
if [ "$IN_STEP" = 0 ]; then
  # The batch script (or an salloc shell): start this script once on every node of the job.
  export NODE_IPS MASTER_ADDR MASTER_PORT
  exec srun --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \
    bash "$SCRIPT_DIR/run_slurm_gpt.sh" "$@"
fi
launch_start "$NODE_RANK"
