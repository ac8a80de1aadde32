#!/usr/bin/env bash
# Measure this cluster's communication and compute figures and write them as Galvatron's hardware
# files (allreduce_bandwidth_*, p2p_bandwidth_*, overlap_coefficient.json, sp_time_*) plus our
# megatron_dpp_compute_* file, for the strategy search (start-search.sh --hardware DIR). Runs
# megatron_dpp.search.hardware_measurement under torchrun, one process per rank (one per GPU; on a
# machine without GPUs, CPU processes over gloo). Works from any directory.
#
#   OUTPUT_DIR=runs/hardware bash run_scripts/profile_hardware.sh
#   bash run_scripts/profile_hardware.sh --output-dir runs/hardware --quick
#
# Several nodes: run it on every node at once, with the same environment apart from NODE_RANK;
# node 0's ranks write the files (on node 0):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 OUTPUT_DIR=runs/hw bash run_scripts/profile_hardware.sh
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 OUTPUT_DIR=runs/hw bash run_scripts/profile_hardware.sh
#
# Environment:
#   OUTPUT_DIR    where the files go (passed as --output-dir; or give --output-dir yourself)
#   NPROC         processes per node (default: the number of GPUs, else 2)
#   NNODES        number of nodes (default 1)
#   NODE_RANK     this node's rank, 0..NNODES-1 (default 0)
#   MASTER_ADDR   node 0's address for torchrun's rendezvous; required when NNODES > 1
#   MASTER_PORT   rendezvous port, the same on every node (default 29500 with NNODES > 1; one node:
#                 torchrun --standalone picks a free one)
#   NODE_IPS      optional, every node's address in node-rank order (passed as --node-ips: nodes
#                 told apart by node rank, rdma_tensor uses these addresses)
#   OMP_NUM_THREADS  threads per process (default 1, as the trainer runs)
# Extra arguments are passed to the profiler (--quick, --bandwidth-sizes-mb, ...; see --help).
# Bad variables or flags: one line on stderr, exit code 2, before torchrun starts.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$REPO_ROOT/.venv/bin/python"
NAME=profile_hardware

fail() {
  echo "$NAME: $*" >&2
  exit 2
}

# require_int NAME MIN: the variable NAME holds a whole number >= MIN.
require_int() {
  local value="${!1}"
  if ! [[ "$value" =~ ^[0-9]+$ ]] || [ "$((10#$value))" -lt "$2" ]; then
    fail "$1=$value is not a whole number of at least $2"
  fi
}

if [ ! -x "$PY" ]; then
  bash "$REPO_ROOT/run_scripts/setup_env.sh"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

ARGS=("$@")
if [ -n "${OUTPUT_DIR:-}" ]; then
  ARGS=(--output-dir "$OUTPUT_DIR" "${ARGS[@]}")
fi
if [ -n "${NODE_IPS:-}" ]; then
  ARGS=(--node-ips "$NODE_IPS" "${ARGS[@]}")
fi
for arg in "${ARGS[@]}"; do
  if [ "$arg" = "-h" ] || [ "$arg" = "--help" ]; then
    exec "$PY" -m megatron_dpp.search.hardware_measurement --help
  fi
done

NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
require_int NNODES 1
require_int NODE_RANK 0
if [ "$NODE_RANK" -ge "$NNODES" ]; then
  fail "NODE_RANK=$NODE_RANK; with NNODES=$NNODES it is 0..$((NNODES - 1))"
fi
GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
if [ -z "${NPROC:-}" ]; then
  if [ "$GPUS" -gt 0 ]; then NPROC="$GPUS"; else NPROC=2; fi
fi
require_int NPROC 1
if [ "$GPUS" -gt 0 ] && [ "$NPROC" -gt "$GPUS" ]; then
  fail "NPROC=$NPROC but this node has $GPUS GPUs; one process per GPU"
fi
if [ "$((NPROC * NNODES))" -lt 2 ]; then
  fail "NPROC=$NPROC with NNODES=$NNODES is one rank; the profile needs at least 2"
fi

if [ "$NNODES" -eq 1 ]; then
  if [ -n "${MASTER_PORT:-}" ]; then
    require_int MASTER_PORT 1
    RENDEZVOUS=(--nnodes 1 --node-rank 0 --master-addr 127.0.0.1 --master-port "$MASTER_PORT")
  else
    RENDEZVOUS=(--standalone)
  fi
else
  if [ -z "${MASTER_ADDR:-}" ]; then
    fail "MASTER_ADDR is not set; set it to node 0's address (the same on every node)"
  fi
  MASTER_PORT="${MASTER_PORT:-29500}"
  require_int MASTER_PORT 1
  RENDEZVOUS=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR"
              --master-port "$MASTER_PORT")
fi

# Flags are checked in one process before torchrun starts the ranks (exit 2, one line).
"$PY" -m megatron_dpp.search.hardware_measurement --check-flags-only "${ARGS[@]}"
exec "$PY" -m torch.distributed.run "${RENDEZVOUS[@]}" --nproc-per-node "$NPROC" \
  -m megatron_dpp.search.hardware_measurement "${ARGS[@]}"
