#!/usr/bin/env bash
# GPT-3 Small (125M), GPT-3 paper table 2.1. GPU recipe, bf16.
# The launchers source this file for its flags. Run directly, it trains with them on one node:
#   bash examples/gpt3/gpt3_125m.sh [--dry-run] [trainer flags]
# is RECIPE=gpt3_125m bash run_scripts/run_single_gpt.sh [...] (environment and flags as there).
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  RECIPE=gpt3_125m exec bash "$(dirname "$0")/../../run_scripts/run_single_gpt.sh" "$@"
fi
MODEL_ARGS=(
  --num-layers 12 --hidden-size 768 --num-attention-heads 12
  --seq-length 2048 --max-position-embeddings 2048
  --hidden-dropout 0.1 --attention-dropout 0.1
  # At this size a GPU step waits for the host, and each torch.compile'd fusion call costs the host
  # more than the device time it saves (docs/gpu.md, "Compiled fusions"); gpu_check.sh runs both.
  --no-bias-gelu-fusion --no-bias-dropout-fusion
)
TRAINING_ARGS=(
  --micro-batch-size 4 --global-batch-size 256 --train-iters 20000
  --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 200
  --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --seed 1234
  --bf16
)
LOGGING_ARGS=(
  --log-interval 10 --eval-interval 1000 --eval-iters 10
)
