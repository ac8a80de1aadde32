#!/usr/bin/env bash
# BERT-Large (340M) as Megatron-LM's examples/bert/train_bert_340m_distributed.sh trains it (24
# layers, hidden 1024, 16 heads, sequence 512, fp16, linear decay), with that script's arguments
# and variables, run by megatron-dpp's launcher (run_scripts/_launch.sh):
#   bash examples/bert/train_bert_340m_distributed.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH \
#       VOCAB_FILE DATA_PATH [trainer flags] [--num-gpus N] [--dry-run]
# DATA_PATH is a sentence-split indexed dataset's prefix (tools/preprocess_data.py
# --split-sentences: ..._text_sentence). CHECKPOINT_PATH is both --save and --load.
# Layout: TP=2 x PP=4 on 8 GPUs. (Megatron-LM's script says TP=8 x PP=16, which its 24 layers do
# not divide into stages: Megatron-LM refuses it too.)
# Appended trainer flags replace this script's of the same choice, so it shrinks to a CPU run:
#   bash examples/bert/train_bert_340m_distributed.sh ckpt tb data/sample/bert-vocab.txt \
#       data/sample/sample_bert_text_sentence --num-layers 4 --hidden-size 128 \
#       --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 \
#       --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --train-iters 10 --bf16 \
#       --log-interval 1 --eval-interval 5 --eval-iters 1 --save-interval 10
# Environment, as Megatron-LM's script names it (all optional): GPUS_PER_NODE (processes on this
# node; MegatronDPP's --num-gpus), NUM_NODES, NODE_RANK, MASTER_ADDR, MASTER_PORT (6000 across
# nodes); several nodes also need their addresses: --node-ips A,B,... (with --multi-node) or
# NODE_IPS. The launcher's own variables (USE_DPP, PP, TP, VPP, DPP_VENV) work as in
# run_single_bert.sh. train_bert_340m_distributed_master.sh / _worker.sh are this script as node
# 0 / a worker node.
set -euo pipefail
LAUNCH_NAME="${LAUNCH_NAME:-train_bert_340m_distributed}"
EXAMPLE_ROLE="${EXAMPLE_ROLE:-auto}"
# shellcheck source=run_scripts/_launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../run_scripts/_launch.sh"
launch_example_positionals 4 "bert/$LAUNCH_NAME.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE DATA_PATH [trainer flags]" "$@"
CHECKPOINT_PATH="$1"; TENSORBOARD_LOGS_PATH="$2"; VOCAB_FILE="$3"; DATA_PATH="$4"
shift 4

EXAMPLE_FLAGS=(
  # the model
  --num-layers 24 --hidden-size 1024 --num-attention-heads 16
  --seq-length 512 --max-position-embeddings 512 --attention-backend auto
  # training
  --micro-batch-size 4 --global-batch-size 32 --train-iters 1000000
  --weight-decay 1e-2 --clip-grad 1.0 --fp16
  --lr 0.0001 --lr-decay-iters 990000 --lr-decay-style linear --min-lr 1.0e-5
  --lr-warmup-fraction .01
  # layout
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 4
  # data
  --data-path "$DATA_PATH" --vocab-file "$VOCAB_FILE" --split 949,50,1
  # evaluation, logging, checkpoints
  --log-interval 100 --save-interval 10000 --eval-interval 1000 --eval-iters 10
  --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)
launch_example "$EXAMPLE_ROLE" bert "$@"
