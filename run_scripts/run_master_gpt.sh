#!/usr/bin/env bash
# Train GPT on several nodes: run this on the master (node 0) and run_worker_gpt.sh on every other
# node, with the same environment apart from NODE_RANK. Environment variables choose everything;
# nothing is written to disk. Works from any directory
# (relative paths, in flags and variables, are the caller's).
#
#   NODE_IPS=10.0.0.1,10.0.0.2 bash run_scripts/run_master_gpt.sh                      # node 0
#   NODE_IPS=10.0.0.1,10.0.0.2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 \
#     bash run_scripts/run_worker_gpt.sh                                               # node 1
#
# Environment:
#   NODE_IPS      every node's address, InfiniBand or Ethernet, in node-rank order (passed as
#                 --multi-node --node-ips); required when NNODES > 1
#   NNODES        number of nodes (default 2)
#   NODE_RANK     this node's rank: 0 on the master (the default; anything else is refused)
#   MASTER_ADDR   the master's address for torchrun's rendezvous (default: the first of NODE_IPS,
#                 else the first address of `hostname -I`)
#   MASTER_PORT   rendezvous port, the same on every node (default 29500)
#   NPROC         processes per node (default: number of GPUs, else 2); DP = NNODES*NPROC / (PP*TP)
#   PP, TP, VPP, USE_DPP, RECIPE, DATA_DIR, DATA_ARGS   as in run_single_gpt.sh
# Extra arguments are passed to megatron_dpp.pretrain_gpt: Megatron-LM's flags, which replace
# the recipe's and the launcher's of the same choice (megatron_dpp/launcher_flags.py).
# --strategy FILE (among them): the model shape, batch, layout and schedule of a strategy JSON
# written by run_scripts/start-search.sh; it replaces PP, TP, VPP, USE_DPP and NPROC.
# --dry-run (anywhere among them) checks everything and prints this node's torchrun command
# instead of running it (and, under it, the flags that did not come from you). Bad variables or flags: one line on stderr, exit code 2, before torchrun.
set -euo pipefail
LAUNCH_NAME=run_master_gpt
# shellcheck source=run_scripts/_launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/_launch.sh"
launch_main master gpt "$@"
