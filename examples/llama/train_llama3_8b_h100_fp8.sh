#!/usr/bin/env bash
# Llama 3 8B as Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh trains it (GPTModel with
# Llama's options: grouped-query attention over 8 groups, head size 128, rotary positions, SwiGLU,
# no biases, an untied output layer; context 8192; its schedule counted in samples), with that
# script's arguments and variables, run by megatron-dpp's launcher (run_scripts/_launch.sh):
#   DTYPE=bf16 bash examples/llama/train_llama3_8b_h100_fp8.sh [CHECKPOINT_PATH
#       [TENSORBOARD_LOGS_PATH [TOKENIZER_ARG [DATA_ARG]]]] [trainer flags] [--num-gpus N] [--dry-run]
# Defaults as Megatron-LM's: checkpoints/llama3_8b_fp8, tensorboard_logs/llama3_8b_fp8, MOCK, MOCK.
# TOKENIZER_ARG is a Hugging Face tokenizer directory (HuggingFaceTokenizer) and DATA_ARG a data
# prefix; either MOCK: generated documents with NullTokenizer's 128256 ids.
# DTYPE (Megatron-LM's variable): fp8, the default, needs Transformer Engine's FP8 layers, which
# megatron-dpp does not build: the script says so in one line (exit 2); DTYPE=bf16 trains in bf16.
# Where it differs from Megatron-LM's text, for what runs here: RMSNorm (Llama 3's; Megatron-LM's
# script has LayerNorm with --apply-layernorm-1p), --attention-backend auto (fused is Transformer
# Engine's), no decoupled learning rate or bf16 gradient reduction (not supported here), and the
# GPU-only --empty-unused-memory-level 1 and --profile only where there is a GPU.
# Appended trainer flags replace this script's of the same choice, so it shrinks to a CPU run:
#   DTYPE=bf16 bash examples/llama/train_llama3_8b_h100_fp8.sh ckpt tb MOCK MOCK --num-layers 4 \
#       --hidden-size 128 --ffn-hidden-size 352 --num-attention-heads 8 --num-query-groups 4 \
#       --kv-channels 32 --seq-length 128 --max-position-embeddings 128 --global-batch-size 8 \
#       --vocab-size 1024 --train-samples 64 --pipeline-model-parallel-size 2 --eval-interval 4 \
#       --eval-iters 1 --save-interval 8
# Environment, as Megatron-LM's script names it (all optional): GPUS_PER_NODE (processes on this
# node; MegatronDPP's --num-gpus), NUM_NODES, NODE_RANK, MASTER_ADDR, MASTER_PORT (6000 across
# nodes; several nodes: --node-ips A,B,... or NODE_IPS). The launcher's own variables (USE_DPP, PP,
# TP, VPP, DPP_VENV) work as in run_single_gpt.sh.
set -euo pipefail
LAUNCH_NAME=train_llama3_8b_h100_fp8
# shellcheck source=run_scripts/_launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../run_scripts/_launch.sh"
DTYPE="${DTYPE:-fp8}"
case "$DTYPE" in
  fp8) launch_fail "DTYPE=fp8 needs Transformer Engine's FP8 layers, which megatron-dpp does not build; DTYPE=bf16 runs this script in bf16" ;;
  bf16) ;;
  *) launch_fail "DTYPE=$DTYPE; set DTYPE=bf16 (DTYPE=fp8 needs Transformer Engine)" ;;
esac
# Up to four positional arguments, each with Megatron-LM's default.
positionals=()
while [ $# -gt 0 ] && [ "${#positionals[@]}" -lt 4 ] && [[ "$1" != -* ]]; do
  positionals+=("$1"); shift
done
CHECKPOINT_PATH="${positionals[0]:-checkpoints/llama3_8b_fp8}"
TENSORBOARD_LOGS_PATH="${positionals[1]:-tensorboard_logs/llama3_8b_fp8}"
TOKENIZER_ARG="${positionals[2]:-MOCK}"
DATA_ARG="${positionals[3]:-MOCK}"
DATA_CACHE_PATH="$PWD/benchmark_cache_llama3_8b_fp8"

EXAMPLE_FLAGS=(
  # the model
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
  --group-query-attention --num-query-groups 8 --kv-channels 128
  --seq-length 8192 --max-position-embeddings 8192
  --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0
  --attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --normalization RMSNorm
  --init-method-std 0.0134 --attention-backend auto
  --untie-embeddings-and-output-weights --disable-bias-linear
  # training
  --micro-batch-size 1 --global-batch-size 128
  --train-samples 1953125000 --lr-decay-samples 1949218748 --lr-warmup-samples 3906252
  --lr 0.00015 --min-lr 0.00001 --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1
  --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --cross-entropy-loss-fusion
  --calculate-per-token-loss --manual-gc --exit-duration-in-mins 235
  # layout
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --context-parallel-size 1
  --sequence-parallel
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
  # evaluation, logging, checkpoints
  --log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput
  --ckpt-format torch_dist --distributed-timeout-minutes 60
  --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)
if [ "$TOKENIZER_ARG" = MOCK ] || [ "$DATA_ARG" = MOCK ] || [ -z "$TOKENIZER_ARG" ]; then
  EXAMPLE_FLAGS+=(--mock-data --tokenizer-type NullTokenizer --vocab-size 128256)
else
  EXAMPLE_FLAGS+=(--data-path "$DATA_ARG" --tokenizer-type HuggingFaceTokenizer
                  --tokenizer-model "$TOKENIZER_ARG")
fi
EXAMPLE_FLAGS+=(--data-cache-path "$DATA_CACHE_PATH" --split 99,1,0
                --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1)
if compgen -G "${DPP_NVIDIA_DEVICE_NODES:-/dev/nvidia[0-9]*}" >/dev/null; then
  EXAMPLE_FLAGS+=(--empty-unused-memory-level 1 --profile --profile-step-start 4 --profile-step-end 6)
fi
mkdir -p "$(dirname "$CHECKPOINT_PATH")" "$(dirname "$TENSORBOARD_LOGS_PATH")" "$DATA_CACHE_PATH"
launch_example auto gpt "$@"
