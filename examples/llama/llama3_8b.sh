#!/usr/bin/env bash
# Llama 3 8B: Dubey et al. 2024, "The Llama 3 Herd of Models", table 3 (the Hugging Face config
# agrees): 32 layers, hidden 4096, 32 heads over 8 key-value groups (grouped-query attention),
# SwiGLU 14336, rotary base 500000, peak lr 3e-4; context 8192, RMSNorm eps 1e-5 (Megatron's
# default). The schedule's shape is the paper's (section 3.4.1, given for 405B): AdamW, linear
# warmup of 8000 steps, cosine to 1% of the peak; betas (0.9, 0.95), weight decay 0.1, clip 1.0,
# 4M-token batches (512 x 8192). GPU recipe, bf16. Llama 3.1 8B has this shape with its rotary
# frequencies scaled: add --use-rope-scaling.
# It trains on your data, tokenized with Llama 3's tokenizer (vocabulary 128256, its eos
# <|end_of_text|> ending each document; neither is shipped here), a local Hugging Face tokenizer
# directory read by transformers (e.g. `hf download meta-llama/Meta-Llama-3-8B --include
# 'tokenizer*' --local-dir llama3-tokenizer` on a machine with network):
#   python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/llama3 \
#     --tokenizer-type HuggingFaceTokenizer --tokenizer-model llama3-tokenizer --append-eod --workers 8
# The launchers source this file for its flags. Run directly, it trains with them on one node on
# the data of DATA_ARGS:
#   DATA_ARGS="--data-path data/llama3_text_document --tokenizer-type HuggingFaceTokenizer \
#     --tokenizer-model llama3-tokenizer" bash examples/llama/llama3_8b.sh
# is RECIPE=llama3_8b bash run_scripts/run_single_llama.sh [...]; without DATA_ARGS it says so in
# one line and exits 2.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  if [ -z "${DATA_ARGS:-}" ]; then
    echo "llama3_8b: trains on data you provide (no Llama 3 data here); run" \
         "DATA_ARGS=\"--data-path PREFIX --tokenizer-type HuggingFaceTokenizer --tokenizer-model" \
         "DIR\" bash $0 [flags]" >&2
    exit 2
  fi
  RECIPE=llama3_8b exec bash "$(dirname "$0")/../../run_scripts/run_single_llama.sh" "$@"
fi
MODEL_ARGS=(
  --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --num-query-groups 8
  --ffn-hidden-size 14336 --seq-length 8192 --max-position-embeddings 8192 --rotary-base 500000
  --hidden-dropout 0.0 --attention-dropout 0.0
)
TRAINING_ARGS=(
  --micro-batch-size 1 --global-batch-size 512 --train-iters 500000
  --lr 3e-4 --min-lr 3e-6 --lr-decay-style cosine --lr-warmup-iters 8000
  --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --seed 1234
  --bf16
)
LOGGING_ARGS=(
  --log-interval 10 --eval-interval 1000 --eval-iters 10
)
