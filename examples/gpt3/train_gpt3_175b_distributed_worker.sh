#!/usr/bin/env bash
# examples/gpt3/train_gpt3_175b_distributed.sh as the worker node NODE_RANK (1, 2, ...) of a multi-node job, as MegatronDPP
# names it: the same arguments, variables and flags; --multi-node --node-ips A,B,... (the nodes'
# addresses in node-rank order) or NODE_IPS, and NUM_NODES (default: one node per address),
# NODE_RANK and MASTER_ADDR (the master's address).
set -euo pipefail
LAUNCH_NAME=train_gpt3_175b_distributed_worker EXAMPLE_ROLE=worker \
  exec bash "$(dirname "${BASH_SOURCE[0]}")/train_gpt3_175b_distributed.sh" "$@"
