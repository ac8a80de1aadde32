# GPT-3 175B, GPT-3 paper table 2.1. Many GPUs (e.g. TP=8 PP=16), bf16. Flags only.
MODEL_ARGS=(
  --num-layers 96 --hidden-size 12288 --num-attention-heads 96
  --seq-length 2048 --max-position-embeddings 2048
  --hidden-dropout 0.1 --attention-dropout 0.1
)
TRAINING_ARGS=(
  --micro-batch-size 1 --global-batch-size 1536 --train-iters 500000
  --lr 6e-5 --min-lr 6e-6 --lr-decay-style cosine --lr-warmup-iters 2000
  --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --seed 1234
  --bf16 --use-distributed-optimizer --sequence-parallel
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
)
LOGGING_ARGS=(
  --log-interval 1 --eval-interval 2000 --eval-iters 10
)
