#!/usr/bin/env bash
# Tiny BERT for CPU (2 cores): a few minutes, the masked-LM loss visibly falling.
# Layers must divide by pipeline x virtual stages: 4 layers fit PP=1,2,4 and PP=2 with VPP=2.
# The launchers source this file for its flags. Run directly, it trains with them on one node:
#   bash examples/bert/bert_tiny.sh [--dry-run] [trainer flags]
# is RECIPE=bert_tiny bash run_scripts/run_single_bert.sh [...] (environment and flags as there).
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  RECIPE=bert_tiny exec bash "$(dirname "$0")/../../run_scripts/run_single_bert.sh" "$@"
fi
MODEL_ARGS=(
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --ffn-hidden-size 512
  --seq-length 128 --max-position-embeddings 128
  --hidden-dropout 0.0 --attention-dropout 0.0
)
TRAINING_ARGS=(
  --micro-batch-size 2 --global-batch-size 16 --train-iters 60
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 5
  --weight-decay 0.01 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.999 --seed 1234
  # The data loads in each rank's own process: on a few CPU cores, loader workers (Megatron-LM's
  # default 2) only take time from the ranks.
  --num-workers 0
)
LOGGING_ARGS=(
  --log-interval 5 --eval-interval 30 --eval-iters 2
)
