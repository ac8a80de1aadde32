#!/usr/bin/env bash
# GPT-3 XL (1.3B), GPT-3 paper table 2.1. GPU recipe, bf16.
# The launchers source this file for its flags. Run directly, it trains with them on one node:
#   bash examples/gpt3/gpt3_1.3b.sh [--dry-run] [trainer flags]
# is RECIPE=gpt3_1.3b bash run_scripts/run_single_gpt.sh [...] (environment and flags as there).
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  RECIPE=gpt3_1.3b exec bash "$(dirname "$0")/../../run_scripts/run_single_gpt.sh" "$@"
fi
MODEL_ARGS=(
  --num-layers 24 --hidden-size 2048 --num-attention-heads 16
  --seq-length 2048 --max-position-embeddings 2048
  --hidden-dropout 0.1 --attention-dropout 0.1
)
TRAINING_ARGS=(
  --micro-batch-size 2 --global-batch-size 512 --train-iters 100000
  --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine --lr-warmup-iters 1000
  --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --seed 1234
  --bf16 --use-distributed-optimizer --recompute-activations
)
LOGGING_ARGS=(
  --log-interval 10 --eval-interval 1000 --eval-iters 10
)
