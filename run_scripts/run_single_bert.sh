#!/usr/bin/env bash
# Train BERT on one node: all GPUs, or 2 CPU ranks (pipeline size 2) when there is no GPU.
# Works from any directory, whose relative paths it takes (flags, DATA_DIR, DATA_ARGS, --strategy);
# sets up the environment and the sample data when missing.
#
# Environment (all optional):
#   PP, TP        pipeline / tensor parallel sizes (default TP=1; PP=2 on CPU and on 2 or more GPUs,
#                 PP=1 on one GPU, where USE_DPP has no pipeline to schedule and the banner says so)
#   VPP           virtual pipeline stages per pipeline rank (interleaved 1F1B; default 1)
#   NPROC         processes on this node (default: the GPUs, rounded down to a multiple of PP*TP,
#                 else 2); DP = NPROC / (PP*TP)
#   RECIPE        model recipe in examples/bert that fills the flags you leave out. Default: bert_tiny
#                 on CPU, bert_base on GPU, and only when your flags give no model shape (with
#                 --num-layers, --hidden-size, ... every flag you leave out is Megatron-LM's default)
#   DATA_DIR      sample data directory (default: <repo>/data/sample)
#   DATA_ARGS     data flags replacing the sample data (e.g. "--data-path P --vocab-file V ...")
#   MASTER_PORT   rendezvous port (default: a free one)
#   USE_DPP       1 (default): dynamic pipeline schedule (--use-dpp) whenever PP >= 2; 0: Megatron's
#                 fixed 1F1B / interleaved schedule
#   RANKS_PER_GPU N ranks on each GPU (default 1): rank r runs on GPU r // N, the launcher starts
#                 a private NVIDIA MPS daemon (stopped when the job ends) and gives each rank
#                 100 // N percent of the SMs; the collectives go over gloo. Defaults then count
#                 N ranks per GPU (e.g. one GPU, RANKS_PER_GPU=2: PP=2). Refused without a GPU,
#                 without nvidia-cuda-mps-control, with TP>1, where N does not divide NPROC, or
#                 where the ranks on one GPU exceed its memory by models/memory_model.py
# Extra arguments are passed to megatron_dpp.pretrain_bert: Megatron-LM's flags, which replace
# the recipe's and the launcher's of the same choice (megatron_dpp/launcher_flags.py).
# --strategy FILE (among them): the model shape, batch, layout and schedule of a strategy JSON
# written by run_scripts/start-search.sh; it replaces PP, TP, VPP, USE_DPP and NPROC.
# --dry-run (anywhere among them) checks everything and prints the torchrun command instead of
# running it, and under it each flag that came from the recipe or the launcher's defaults, and each
# one your flags replaced. Several nodes: run_master_bert.sh and run_worker_bert.sh.
set -euo pipefail
LAUNCH_NAME=run_single_bert
# shellcheck source=run_scripts/_launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/_launch.sh"
launch_main single bert "$@"
