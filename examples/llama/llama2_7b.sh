# Llama 2 7B: Touvron et al. 2023, "Llama 2: Open Foundation and Fine-Tuned Chat Models", table 1
# and section 2.2 (the Hugging Face config agrees): 32 layers, hidden 4096, 32 heads (multi-head:
# 32 query groups), SwiGLU 11008, context 4096, RMSNorm eps 1e-5, rotary base 10000, AdamW
# (0.9, 0.95), lr 3e-4 cosine to 10%, warmup 2000, weight decay 0.1, clip 1.0, 4M-token batches.
# GPU recipe, bf16. Flags only.
# It needs Llama 2's SentencePiece tokenizer (vocabulary 32000) and data tokenized with it, neither
# shipped here nor a --tokenizer-type of this trainer yet: as it stands, DATA_ARGS with GPT-2 BPE
# data trains this shape with GPT-2's vocabulary (50257) instead.
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
