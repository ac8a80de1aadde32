#!/usr/bin/env bash
# GPT-3 175B, GPT-3 paper table 2.1. Many GPUs (e.g. TP=8 PP=16), bf16.
# The launchers source this file for its flags (RECIPE=gpt3_175b). It does not fit one node, so
# run directly it says in one line how to launch it on several, and exits 2.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  echo "gpt3_175b: 175B parameters need many nodes (e.g. 16 of 8 GPUs, TP=8 PP=16), not one;" \
       "launch it with RECIPE=gpt3_175b TP=8 PP=16 sbatch --nodes=16 --gpus-per-node=8" \
       "run_scripts/run_slurm_gpt.sh, or RECIPE=gpt3_175b TP=8 PP=16 NNODES=16 NODE_IPS=... with" \
       "run_scripts/run_master_gpt.sh on node 0 and run_scripts/run_worker_gpt.sh on the others" >&2
  exit 2
fi
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
