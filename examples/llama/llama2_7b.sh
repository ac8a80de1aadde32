#!/usr/bin/env bash
# Llama 2 7B: Touvron et al. 2023, "Llama 2: Open Foundation and Fine-Tuned Chat Models", table 1
# and section 2.2 (the Hugging Face config agrees): 32 layers, hidden 4096, 32 heads (multi-head:
# 32 query groups), SwiGLU 11008, context 4096, RMSNorm eps 1e-5, rotary base 10000, AdamW
# (0.9, 0.95), lr 3e-4 cosine to 10%, warmup 2000, weight decay 0.1, clip 1.0, 4M-token batches.
# GPU recipe, bf16.
# It trains on your data, tokenized with Llama 2's SentencePiece model (vocabulary 32000; neither is
# shipped here):
#   python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/llama \
#     --tokenizer-type Llama2Tokenizer --tokenizer-model tokenizer.model --append-eod --workers 8
# The launchers source this file for its flags. Run directly, it trains with them on one node on
# the data of DATA_ARGS:
#   DATA_ARGS="--data-path data/llama_text_document --tokenizer-type Llama2Tokenizer \
#     --tokenizer-model tokenizer.model" bash examples/llama/llama2_7b.sh
# is RECIPE=llama2_7b bash run_scripts/run_single_llama.sh [...]; without DATA_ARGS it says so in
# one line and exits 2.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  if [ -z "${DATA_ARGS:-}" ]; then
    echo "llama2_7b: trains on data you provide (no Llama 2 data here); run" \
         "DATA_ARGS=\"--data-path PREFIX --tokenizer-type Llama2Tokenizer --tokenizer-model" \
         "tokenizer.model\" bash $0 [flags]" >&2
    exit 2
  fi
  RECIPE=llama2_7b exec bash "$(dirname "$0")/../../run_scripts/run_single_llama.sh" "$@"
fi
MODEL_ARGS=(
  --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --num-query-groups 32
  --ffn-hidden-size 11008 --seq-length 4096 --max-position-embeddings 4096 --rotary-base 10000
  --hidden-dropout 0.0 --attention-dropout 0.0
)
TRAINING_ARGS=(
  --micro-batch-size 1 --global-batch-size 1024 --train-iters 500000
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000
  --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --seed 1234
  --bf16
)
LOGGING_ARGS=(
  --log-interval 10 --eval-interval 1000 --eval-iters 10
)
