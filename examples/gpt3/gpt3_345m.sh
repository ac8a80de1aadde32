#!/usr/bin/env bash
# GPT-2 Medium size (345M, Megatron-LM's classic example). GPU recipe, bf16.
# The launchers source this file for its flags. Run directly, it trains with them on one node:
#   bash examples/gpt3/gpt3_345m.sh [--dry-run] [trainer flags]
# is RECIPE=gpt3_345m bash run_scripts/run_single_gpt.sh [...] (environment and flags as there).
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  RECIPE=gpt3_345m exec bash "$(dirname "$0")/../../run_scripts/run_single_gpt.sh" "$@"
fi
MODEL_ARGS=(
  --num-layers 24 --hidden-size 1024 --num-attention-heads 16
  --seq-length 1024 --max-position-embeddings 1024
  --hidden-dropout 0.1 --attention-dropout 0.1
)
TRAINING_ARGS=(
  --micro-batch-size 4 --global-batch-size 256 --train-iters 50000
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 500
  --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --seed 1234
  --bf16
)
LOGGING_ARGS=(
  --log-interval 10 --eval-interval 1000 --eval-iters 10
)
