#!/usr/bin/env bash
# examples/bert/train_bert_340m_distributed.sh as the master (node 0) of a multi-node job, as MegatronDPP
# names it: the same arguments, variables and flags; --multi-node --node-ips A,B,... (the nodes'
# addresses in node-rank order) or NODE_IPS, and NUM_NODES (default: one node per address).
set -euo pipefail
LAUNCH_NAME=train_bert_340m_distributed_master EXAMPLE_ROLE=master \
  exec bash "$(dirname "${BASH_SOURCE[0]}")/train_bert_340m_distributed.sh" "$@"
