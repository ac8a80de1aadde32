#!/usr/bin/env bash
# Train GPT on one node: all GPUs, or 2 CPU ranks (pipeline size 2) when there is no GPU.
# Works from any directory; sets up the environment and the sample data when missing.
#
# Environment (all optional):
#   PP, TP        pipeline / tensor parallel sizes (CPU default PP=2, TP=1; GPU default PP=1, TP=1)
#   VPP           virtual pipeline stages per pipeline rank (interleaved 1F1B; default 1)
#   NPROC         processes on this node (default: number of GPUs, else 2); DP = NPROC / (PP*TP)
#   RECIPE        model recipe in examples/gpt3 (default: gpt3_tiny on CPU, gpt3_125m on GPU)
#   DATA_DIR      sample data directory (default: <repo>/data/sample)
#   DATA_ARGS     data flags replacing the sample data (e.g. "--data-path P --vocab-file V ...")
#   MASTER_PORT   rendezvous port (default: a free one)
#   USE_DPP       1 (default): dynamic pipeline schedule (--use-dpp) whenever PP >= 2; 0: Megatron's
#                 fixed 1F1B / interleaved schedule
# Extra arguments are passed to megatron_dpp.pretrain_gpt and override the recipe's flags.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DPP_VENV:-$REPO_ROOT/.venv}"

if [ ! -x "$VENV/bin/python" ]; then
  bash "$REPO_ROOT/run_scripts/setup_env.sh"
fi
PY="$VENV/bin/python"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
if [ "$GPUS" -gt 0 ]; then
  NPROC="${NPROC:-$GPUS}"; PP="${PP:-1}"; RECIPE="${RECIPE:-gpt3_125m}"
else
  NPROC="${NPROC:-2}"; PP="${PP:-2}"; RECIPE="${RECIPE:-gpt3_tiny}"
fi
TP="${TP:-1}"
VPP="${VPP:-1}"

RECIPE_FILE="$REPO_ROOT/examples/gpt3/$RECIPE.sh"
if [ ! -f "$RECIPE_FILE" ]; then
  echo "run_single_gpt: no recipe $RECIPE_FILE; set RECIPE to one of: $(cd "$REPO_ROOT/examples/gpt3" && ls *.sh | sed 's/\.sh$//' | tr '\n' ' ')" >&2
  exit 2
fi
# shellcheck source=/dev/null
source "$RECIPE_FILE"

if [ -n "${DATA_ARGS:-}" ]; then
  read -r -a DATA_FLAGS <<<"$DATA_ARGS"
else
  DATA_DIR="${DATA_DIR:-$REPO_ROOT/data/sample}"
  if [ ! -f "$DATA_DIR/sample_text_document.idx" ]; then
    (cd "$REPO_ROOT" && "$PY" -m megatron_dpp.data.prepare_sample --output-dir "$DATA_DIR")
  fi
  DATA_FLAGS=(--data-path "$DATA_DIR/sample_text_document" --vocab-file "$DATA_DIR/vocab.json"
              --merge-file "$DATA_DIR/merges.txt" --split 98,2,0)
fi

PARALLEL_FLAGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP")
if [ "$VPP" -gt 1 ]; then
  PARALLEL_FLAGS+=(--num-virtual-stages-per-pipeline-rank "$VPP")
fi

USE_DPP="${USE_DPP:-1}"
if [ "$USE_DPP" != "0" ] && [ "$USE_DPP" != "1" ]; then
  echo "run_single_gpt: USE_DPP=$USE_DPP; set it to 1 (dynamic pipeline schedule) or 0 (Megatron's)" >&2
  exit 2
fi
if [ "$USE_DPP" = "1" ] && [ "$PP" -ge 2 ]; then
  PARALLEL_FLAGS+=(--use-dpp)
fi

if [ -n "${MASTER_PORT:-}" ]; then
  RDZV=(--master-addr 127.0.0.1 --master-port "$MASTER_PORT")
else
  RDZV=(--standalone)
fi

ALL_FLAGS=("${GPT_MODEL_ARGS[@]}" "${GPT_TRAINING_ARGS[@]}" "${GPT_LOGGING_ARGS[@]}"
           "${DATA_FLAGS[@]}" "${PARALLEL_FLAGS[@]}" "$@")
# Bad flags: one line and exit code 2 here, before torchrun starts any process.
(cd "$REPO_ROOT" && WORLD_SIZE="$NPROC" RANK=0 "$PY" -m megatron_dpp.arguments "${ALL_FLAGS[@]}")

echo "run_single_gpt: $NPROC processes, TP=$TP PP=$PP VPP=$VPP, USE_DPP=$USE_DPP, recipe $RECIPE"
cd "$REPO_ROOT"
exec "$PY" -m torch.distributed.run "${RDZV[@]}" --nnodes 1 --nproc-per-node "$NPROC" \
  -m megatron_dpp.pretrain_gpt "${ALL_FLAGS[@]}"
