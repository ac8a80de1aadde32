#!/usr/bin/env bash
# BERT-Large (340M): 24 layers, hidden 1024, 16 heads, 512 tokens (Devlin et al. 2019), with the
# batch and schedule of Megatron-LM's BERT-340M example (global batch 32, lr 1e-4 decaying
# linearly to 1e-5). GPU recipe, bf16; pipeline sizes 2, 4, 8 divide its 24 layers.
# The launchers source this file for its flags. Run directly, it trains with them on one node:
#   bash examples/bert/bert_large.sh [--dry-run] [trainer flags]
# is RECIPE=bert_large bash run_scripts/run_single_bert.sh [...] (environment and flags as there).
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  RECIPE=bert_large exec bash "$(dirname "$0")/../../run_scripts/run_single_bert.sh" "$@"
fi
MODEL_ARGS=(
  --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --ffn-hidden-size 4096
  --seq-length 512 --max-position-embeddings 512
  --hidden-dropout 0.1 --attention-dropout 0.1
)
TRAINING_ARGS=(
  --micro-batch-size 4 --global-batch-size 32 --train-iters 1000000
  --lr 1e-4 --min-lr 1e-5 --lr-decay-style linear --lr-warmup-iters 10000
  --weight-decay 0.01 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.999 --seed 1234
  --bf16
)
LOGGING_ARGS=(
  --log-interval 100 --eval-interval 1000 --eval-iters 10
)
