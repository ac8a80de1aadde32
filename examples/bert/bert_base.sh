#!/usr/bin/env bash
# BERT-Base (110M): 12 layers, hidden 768, 12 heads, 512 tokens, batch 256 for 1M steps, Adam with
# lr 1e-4, linear decay and 10k warm-up steps (Devlin et al. 2019, section A.2). GPU recipe, bf16.
# The launchers source this file for its flags. Run directly, it trains with them on one node:
#   bash examples/bert/bert_base.sh [--dry-run] [trainer flags]
# is RECIPE=bert_base bash run_scripts/run_single_bert.sh [...] (environment and flags as there).
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  RECIPE=bert_base exec bash "$(dirname "$0")/../../run_scripts/run_single_bert.sh" "$@"
fi
MODEL_ARGS=(
  --num-layers 12 --hidden-size 768 --num-attention-heads 12 --ffn-hidden-size 3072
  --seq-length 512 --max-position-embeddings 512
  --hidden-dropout 0.1 --attention-dropout 0.1
)
TRAINING_ARGS=(
  --micro-batch-size 16 --global-batch-size 256 --train-iters 1000000
  --lr 1e-4 --min-lr 1e-5 --lr-decay-style linear --lr-warmup-iters 10000
  --weight-decay 0.01 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.999 --seed 1234
  --bf16
)
LOGGING_ARGS=(
  --log-interval 100 --eval-interval 10000 --eval-iters 10
)
