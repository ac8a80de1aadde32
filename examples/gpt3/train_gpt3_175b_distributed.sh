#!/usr/bin/env bash
# GPT-3 175B as Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh trains it (the GPT-3
# paper's shape and schedule, fp16, TP=8 x PP=16), with that script's arguments and variables, run
# by megatron-dpp's launcher (run_scripts/_launch.sh):
#   bash examples/gpt3/train_gpt3_175b_distributed.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH \
#       VOCAB_FILE MERGE_FILE DATA_PATH [trainer flags] [--num-gpus N] [--dry-run]
# CHECKPOINT_PATH is both --save and --load (a directory without a checkpoint starts from scratch).
# Appended trainer flags replace this script's of the same choice, so the same script shrinks to
# a CPU run, e.g. with the sample data of run_scripts/run_single_gpt.sh:
#   bash examples/gpt3/train_gpt3_175b_distributed.sh ckpt tb data/sample/vocab.json \
#       data/sample/merges.txt data/sample/sample_text_document --num-layers 4 --hidden-size 128 \
#       --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 \
#       --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --global-batch-size 16 \
#       --rampup-batch-size 8 8 80 --train-samples 160 --bf16 --log-interval 1 --eval-interval 5 \
#       --eval-iters 1 --save-interval 10
# Environment, as Megatron-LM's script names it (all optional): GPUS_PER_NODE (processes on this
# node; MegatronDPP's --num-gpus), NUM_NODES, NODE_RANK, MASTER_ADDR, MASTER_PORT (6000 across
# nodes); several nodes also need their addresses: --node-ips A,B,... (with --multi-node, as
# MegatronDPP's scripts pass them) or NODE_IPS. The launcher's own variables (USE_DPP, PP, TP, VPP,
# DPP_VENV) work as in run_single_gpt.sh; --use-dpp is on whenever PP >= 2 (USE_DPP=0: Megatron's
# schedule). train_gpt3_175b_distributed_master.sh / _worker.sh are this script as node 0 / a
# worker node.
set -euo pipefail
LAUNCH_NAME="${LAUNCH_NAME:-train_gpt3_175b_distributed}"
EXAMPLE_ROLE="${EXAMPLE_ROLE:-auto}"
# shellcheck source=run_scripts/_launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../run_scripts/_launch.sh"
launch_example_positionals 5 "gpt3/$LAUNCH_NAME.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE MERGE_FILE DATA_PATH [trainer flags]" "$@"
CHECKPOINT_PATH="$1"; TENSORBOARD_LOGS_PATH="$2"; VOCAB_FILE="$3"; MERGE_FILE="$4"; DATA_PATH="$5"
shift 5

EXAMPLE_FLAGS=(
  # the model
  --num-layers 96 --hidden-size 12288 --num-attention-heads 96
  --seq-length 2048 --max-position-embeddings 2048 --attention-backend auto
  # training
  # Counted in samples, as the batch-size ramp requires (Megatron-LM refuses a ramp with
  # --train-iters): the paper's 300B tokens, decay over 260B, warmup over 375M, ramp over 12B.
  --micro-batch-size 1 --global-batch-size 1536 --rampup-batch-size 16 16 5859375
  --train-samples 146484375 --lr-decay-samples 126953125 --lr-warmup-samples 183105
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
  --init-method-std 0.006 --clip-grad 1.0 --fp16
  --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6
  # layout
  --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
  # data
  --data-path "$DATA_PATH" --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" --split 949,50,1
  # evaluation, logging, checkpoints
  --log-interval 100 --save-interval 10000 --eval-interval 1000 --eval-iters 10
  --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)
launch_example "$EXAMPLE_ROLE" gpt "$@"
