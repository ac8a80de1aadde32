"""Megatron-LM users' training command lines, as written, through the launchers' --dry-run.

The corpus follows Megatron-LM's public scripts and documentation (core_v0.16.1, and the main
branch's newer scripts): each entry is one command line's flags, its bash variables resolved, with
the data and tokenizer replaced by the sample data (or --mock-data with NullTokenizer) and its
world size (NPROC) as the script's nodes x GPUs give it. Each one either

- runs: exit 0, the trainer's command holds every flag the user gave, no recipe fills anything,
  and the launcher adds only its data-free layout and schedule (TP, PP, --use-dpp), named on its
  "from the launcher's defaults" line; or
- is refused in one line (exit 2, one line on stderr, no traceback) for a reason that is an
  honest limit here (a GPU on this CPU machine, Transformer Engine and FP8, context parallelism,
  mixture of experts, FSDP) or that Megatron-LM 0.16.1 itself gives (a flag it no longer has, a
  length in iterations with a batch ramp, layers that do not divide among the stages).

A line that does neither today is marked `known` (the reason): an xfail, strict, so that the mark
goes when the line is fixed.
"""
from __future__ import annotations

import shlex
import subprocess
from dataclasses import dataclass, field

import pytest

from _train_util import REPO_ROOT, _env, ensure_sample_data
from megatron_dpp.launcher_flags import USER, split_flags

SCRIPTS = REPO_ROOT / "run_scripts"
_LAUNCH_VARIABLES = ("NNODES", "NODE_RANK", "NODE_IPS", "MASTER_ADDR", "MASTER_PORT", "NPROC",
                     "PP", "TP", "VPP", "USE_DPP", "RECIPE", "DATA_ARGS", "DATA_DIR", "DPP_VENV",
                     "GPUS_PER_NODE", "NUM_NODES")

GPT_DATA = ["--data-path", "data/sample/sample_text_document", "--vocab-file",
            "data/sample/vocab.json", "--merge-file", "data/sample/merges.txt"]
BERT_DATA = ["--data-path", "data/sample/sample_bert_text_sentence", "--vocab-file",
             "data/sample/bert-vocab.txt"]


def mock(vocab_size: int) -> list[str]:
    return ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab_size)]


RUNS = "runs"


@dataclass
class Line:
    source: str          # the Megatron-LM script or document it follows
    model: str           # gpt | bert | llama: run_single_<model>.sh
    nproc: int           # the world size its layout asks for (one node here)
    flags: list[str]
    expect: str = RUNS   # RUNS, or a substring of the one line that refuses it
    known: str = ""      # why it does not meet `expect` today (an xfail)
    env: dict = field(default_factory=dict)


# A --load directory holding a checkpoint (a tracker file; _dry_run puts its path in): what a
# fine-tuning user's --load names.
PRETRAINED = "@pretrained"


# ------------------------------------------------------------------------------------------------
# examples/gpt3/train_gpt3_175b_distributed.sh
# ------------------------------------------------------------------------------------------------
GPT3_175B_MODEL = ["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
                   "--seq-length", "2048", "--max-position-embeddings", "2048",
                   "--attention-backend", "auto"]
GPT3_175B_TRAINING = ["--micro-batch-size", "1", "--global-batch-size", "1536",
                      "--train-iters", "500000", "--weight-decay", "0.1", "--adam-beta1", "0.9",
                      "--adam-beta2", "0.95", "--init-method-std", "0.006", "--clip-grad", "1.0",
                      "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine", "--min-lr",
                      "6.0e-6", "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000"]
GPT3_175B_REST = ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
                  *GPT_DATA, "--split", "949,50,1", "--log-interval", "100",
                  "--save-interval", "10000", "--eval-interval", "1000",
                  "--save", "checkpoints/gpt3_175b", "--load", "checkpoints/gpt3_175b",
                  "--eval-iters", "10", "--tensorboard-dir", "tensorboard/gpt3_175b"]
# The main branch replaced the ramp with --step-batch-size-schedule (not a 0.16.1 flag).
GPT3_175B_HEAD = [*GPT3_175B_MODEL, *GPT3_175B_TRAINING[:4], "--step-batch-size-schedule",
                  "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536",
                  *GPT3_175B_TRAINING[4:], *GPT3_175B_REST]

# ------------------------------------------------------------------------------------------------
# examples/bert/train_bert_340m_distributed.sh (its repeated flags kept)
# ------------------------------------------------------------------------------------------------
BERT_340M = ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16",
             "--seq-length", "512", "--max-position-embeddings", "512", "--attention-backend",
             "auto", "--micro-batch-size", "4", "--global-batch-size", "32", "--train-iters",
             "1000000", "--weight-decay", "1e-2", "--clip-grad", "1.0", "--fp16", "--lr",
             "0.0001", "--lr-decay-iters", "990000", "--lr-decay-style", "linear", "--min-lr",
             "1.0e-5", "--weight-decay", "1e-2", "--lr-warmup-fraction", ".01", "--clip-grad",
             "1.0"]
BERT_340M_REST = [*BERT_DATA, "--split", "949,50,1", "--log-interval", "100", "--save-interval",
                  "10000", "--eval-interval", "1000", "--save", "checkpoints/bert_340m", "--load",
                  "checkpoints/bert_340m", "--eval-iters", "10", "--tensorboard-dir",
                  "tensorboard/bert_340m"]

# ------------------------------------------------------------------------------------------------
# examples/llama/train_llama3_8b_h100_fp8.sh (core_v0.16.1; the main branch adds RMSNorm)
# ------------------------------------------------------------------------------------------------
LLAMA3_8B_MODEL = ["--use-mcore-models", "--num-layers", "32", "--hidden-size", "4096",
                   "--ffn-hidden-size", "14336", "--num-attention-heads", "32",
                   "--group-query-attention", "--num-query-groups", "8", "--kv-channels", "128",
                   "--seq-length", "8192", "--max-position-embeddings", "8192",
                   "--position-embedding-type", "rope", "--rotary-base", "1000000",
                   "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout",
                   "0.0", "--swiglu", "--init-method-std", "0.0134", "--attention-backend",
                   "fused", "--apply-layernorm-1p", "--untie-embeddings-and-output-weights",
                   "--disable-bias-linear"]
LLAMA3_8B_TRAINING = ["--micro-batch-size", "1", "--global-batch-size", "128", "--train-samples",
                      "1953125000", "--lr-decay-samples", "1949218748", "--lr-warmup-samples",
                      "3906252", "--lr", "0.00015", "--min-lr", "0.00001", "--decoupled-lr",
                      "5.0e-4", "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine",
                      "--clip-grad", "1.0", "--weight-decay", "0.1", "--adam-beta1", "0.9",
                      "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16",
                      "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc",
                      "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
                      "--use-distributed-optimizer", "--overlap-grad-reduce",
                      "--overlap-param-gather"]
LLAMA3_8B_FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
                 "--fp8-amax-compute-algo", "max", "--fp8-param-gather"]
LLAMA3_8B_PARALLEL = ["--tensor-model-parallel-size", "1", "--context-parallel-size", "1",
                      "--sequence-parallel"]
# Its MOCK data: `"--split '99,1,0'"` word-split unquoted hands the quotes to the trainer.
LLAMA3_8B_MOCK = [*mock(128256), "--data-cache-path", "benchmark_cache_llama3_8b_fp8",
                  "--tiktoken-pattern", "v2", "--split", "'99,1,0'",
                  "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files",
                  "--num-workers", "1"]
LLAMA3_8B_LOGGING = ["--log-interval", "1", "--eval-iters", "32", "--eval-interval", "100",
                     "--save-interval", "1000", "--log-throughput", "--profile",
                     "--profile-step-start", "4", "--profile-step-end", "6", "--ckpt-format",
                     "torch_dist", "--distributed-timeout-minutes", "60", "--save",
                     "checkpoints/llama3_8b_fp8", "--load", "checkpoints/llama3_8b_fp8",
                     "--tensorboard-dir", "tensorboard_logs/llama3_8b_fp8"]
LLAMA3_8B_BF16 = [*LLAMA3_8B_MODEL, *LLAMA3_8B_TRAINING, *LLAMA3_8B_PARALLEL, *LLAMA3_8B_MOCK,
                  *LLAMA3_8B_LOGGING]
# ... as a CPU user runs it: without what needs Transformer Engine or a GPU (zero-centred norms,
# TE's fused attention, emptying the CUDA cache, the nsys range of --profile).
_GPU_ONLY = {"--apply-layernorm-1p", "--attention-backend", "--empty-unused-memory-level",
             "--profile", "--profile-step-start", "--profile-step-end"}
LLAMA3_8B_CPU = [word for flag in split_flags(LLAMA3_8B_BF16, USER)
                 if flag.name not in _GPU_ONLY for word in flag.words]

# ------------------------------------------------------------------------------------------------
# examples/mixtral/train_mixtral_8x7b_distributed.sh
# ------------------------------------------------------------------------------------------------
MIXTRAL_8X7B = ["--use-mcore-models", "--disable-bias-linear", "--seq-length", "4096",
                "--max-position-embeddings", "32768", "--num-layers", "32", "--hidden-size",
                "4096", "--ffn-hidden-size", "14336", "--num-attention-heads", "32",
                "--init-method-std", "0.01", "--attention-dropout", "0.0", "--hidden-dropout",
                "0.0", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                "--swiglu", "--untie-embeddings-and-output-weights", "--group-query-attention",
                "--num-query-groups", "8", "--no-masked-softmax-fusion",
                "--no-position-embedding", "--rotary-base", "1000000",
                "--num-experts", "8", "--moe-router-topk", "2",
                "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2",
                "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
                "--overlap-param-gather", "--overlap-grad-reduce",
                *mock(32000), "--split", "99990,8,2",
                "--micro-batch-size", "1", "--global-batch-size", "256", "--lr", "1e-4",
                "--train-iters", "500000", "--lr-decay-iters", "320000", "--lr-decay-style",
                "cosine", "--min-lr", "1.0e-5", "--weight-decay", "0.1", "--lr-warmup-iters",
                "500", "--clip-grad", "1.0", "--bf16",
                "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4",
                "--expert-model-parallel-size", "8", "--use-distributed-optimizer",
                "--sequence-parallel", "--log-interval", "1", "--save-interval", "10000",
                "--eval-interval", "1000", "--eval-iters", "10", "--save",
                "checkpoints/mixtral", "--load", "checkpoints/mixtral", "--tensorboard-dir",
                "checkpoints/mixtral/tensorboard", "--no-load-optim", "--no-load-rng"]

# ------------------------------------------------------------------------------------------------
# docs/user-guide/training-examples.md and parallelism-guide.md
# ------------------------------------------------------------------------------------------------
DOCS_CUSTOM_LLAMA = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                     "--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
                     "--seq-length", "2048", "--max-position-embeddings", "2048",
                     "--micro-batch-size", "4", "--global-batch-size", "32", "--train-iters",
                     "100000", "--lr", "3.0e-4", "--min-lr", "3.0e-5", "--lr-decay-style",
                     "cosine", "--lr-warmup-iters", "2000", "--weight-decay", "0.1",
                     "--clip-grad", "1.0", "--bf16", *GPT_DATA, "--split", "949,50,1",
                     "--save", "checkpoints/llama", "--load", "checkpoints/llama",
                     "--log-interval", "10", "--save-interval", "1000", "--eval-interval", "1000"]
DOCS_GPT3 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
             "--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
             "--seq-length", "1024", "--max-position-embeddings", "1024", "--micro-batch-size",
             "2", "--global-batch-size", "16", "--train-iters", "100000", "--lr", "1.5e-4",
             "--min-lr", "1.0e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1000",
             "--weight-decay", "0.1", "--clip-grad", "1.0", "--fp16", *GPT_DATA, "--split",
             "949,50,1", "--save", "checkpoints/gpt3", "--load", "checkpoints/gpt3"]
# The guide's flags on a model of its own size (its snippets give no shape).
GUIDE_SHAPE = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
               "--seq-length", "4096", "--max-position-embeddings", "4096", "--micro-batch-size",
               "1", "--global-batch-size", "64", "--train-iters", "1000", "--lr", "1e-4",
               "--bf16", *GPT_DATA]
GUIDE_COMBINED = ["--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "4",
                  "--context-parallel-size", "2", "--num-layers", "80", "--hidden-size", "8192",
                  "--num-attention-heads", "64", "--seq-length", "8192", "--micro-batch-size",
                  "1", "--global-batch-size", "512", "--bf16", "--max-position-embeddings",
                  "8192", "--train-iters", "1000", "--lr", "1e-4", *GPT_DATA]

# ------------------------------------------------------------------------------------------------
# examples/academic_paper_scripts/sc21: CONFIG.sh's MEGATRON_PARAMS with each run_*.sh's sizes.
# Its --DDP-impl and --activations-checkpoint-method are gone from Megatron-LM 0.16.1; the
# "modern" lines use their replacements (the DDP is Megatron-Core's; full uniform recompute).
# ------------------------------------------------------------------------------------------------
def sc21(tp, pp, mbs, gbs, nls, hs, nah, extra=(), modern=True, ddp="local"):
    old = (["--activations-checkpoint-method", "uniform"] if not modern else  # its layers: 1
           ["--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1"])
    ddp_flag = [] if modern else ["--DDP-impl", ddp]
    return [*old, *extra, "--tensor-model-parallel-size", str(tp),
            "--pipeline-model-parallel-size", str(pp), "--micro-batch-size", str(mbs),
            "--global-batch-size", str(gbs), "--num-layers", str(nls), "--hidden-size", str(hs),
            "--num-attention-heads", str(nah), *ddp_flag, *GPT_DATA, "--log-interval", "5",
            "--seq-length", "2048", "--max-position-embeddings", "2048", "--train-iters", "500",
            "--lr-decay-iters", "320", "--lr", "0.0001", "--min-lr", "0.00001",
            "--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.01", "--split", "969,30,1",
            "--eval-iters", "100", "--eval-interval", "1000", "--clip-grad", "1.0", "--fp16",
            "--loss-scale", "8192"]


# ------------------------------------------------------------------------------------------------
# examples/post_training/modelopt/conf/*: a model's MODEL_ARGS with finetune.sh's training flags
# (its dataset and ModelOpt-only flags aside), the HuggingFace tokenizer replaced by NullTokenizer.
# ------------------------------------------------------------------------------------------------
MODELOPT_FINETUNE = ["--distributed-timeout-minutes", "30", "--auto-detect-ckpt-format",
                     "--finetune", "--train-samples", "128000", "--lr-decay-samples", "128000",
                     "--lr-warmup-samples", "0", "--split", "100,0,0",
                     "--no-gradient-accumulation-fusion", "--reset-position-ids",
                     "--reset-attention-mask", "--eod-mask-loss", "--micro-batch-size", "1",
                     "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
                     "--no-check-for-nan-in-loss-and-grad", "--lr", "5.0e-5", "--min-lr",
                     "1.0e-7", "--lr-decay-style", "cosine", "--clip-grad", "1.0",
                     "--weight-decay", "0.0", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
                     "--init-method-std", "0.010", "--use-distributed-optimizer", "--eval-iters",
                     "1", "--eval-interval", "1000", "--save-interval", "1000", "--log-interval",
                     "100", "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size",
                     "1", "--load", PRETRAINED, "--save", "checkpoints/modelopt_sft"]


def modelopt(layers, hidden, ffn, heads, groups, seq, max_pos, vocab, extra=()):
    """A Qwen / Llama conf's MODEL_ARGS (its shape; `extra`: the model's own flags)."""
    return ["--save-interval", "100000", "--micro-batch-size", "1", "--bf16",
            "--no-masked-softmax-fusion", "--disable-bias-linear", *extra, "--normalization",
            "RMSNorm", "--swiglu", "--num-layers", str(layers), "--hidden-size", str(hidden),
            "--ffn-hidden-size", str(ffn), "--num-attention-heads", str(heads),
            "--group-query-attention", "--num-query-groups", str(groups), "--seq-length",
            str(seq), "--max-position-embeddings", str(max_pos), *mock(vocab),
            "--use-mcore-models", *MODELOPT_FINETUNE]


QWEN_ROPE = ["--position-embedding-type", "rope", "--no-rope-fusion", "--rotary-percent", "1.0",
             "--rotary-base", "1000000", "--no-bias-swiglu-fusion"]
LLAMA31_ROPE = ["--use-rotary-position-embeddings", "--rotary-percent", "1.0", "--no-rope-fusion",
                "--no-position-embedding", "--rotary-base", "500000", "--use-rope-scaling"]

# examples/academic_paper_scripts/detxoify_lm/finetune_gpt_distributed-1.3b.sh, its
# finetune_gpt.py's own flag (--data-path2) and the removed ones (--DDP-impl, and
# --checkpoint-activations: --recompute-activations) aside; its $bs, $iter, $lr: 64, 1000, 2e-5
DETOX = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads",
         "32", "--micro-batch-size", "4", "--global-batch-size", "64",
         "--seq-length", "2048", "--max-position-embeddings", "2048",
         "--train-iters", "1000", "--save", "checkpoints/detox_ft", "--load",
         PRETRAINED, *GPT_DATA, "--split", "100,0,0",
         "--distributed-backend", "nccl", "--lr-decay-style", "constant",
         "--lr", "2e-5", "--clip-grad", "1.0", "--weight-decay", "0.1",
         "--adam-beta1", "0.9", "--adam-beta2", "0.95",
         "--recompute-activations", "--log-interval", "1", "--save-interval",
         "78", "--eval-interval", "78", "--eval-iters", "50", "--fp16",
         "--finetune", "--no-load-optim", "--log-validation-ppl-to-tensorboard",
         "--tensorboard-dir", "tensorboard/detox"]

QKV_BIAS = ("--add-qkv-bias is GPT's architecture here, not --model llama's preset (by design: "
            "run_single_gpt.sh takes it, as Megatron-LM's pretrain_gpt.py)")
TE_OR_FP8 = "Transformer Engine"
MOE = "mixture-of-experts"
CP = "context parallel"
FSDP = "FSDP"

CORPUS = {
    # examples/gpt3/train_gpt3_175b_distributed.sh as written (core_v0.16.1): Megatron-LM too
    # refuses its ramp with a length in iterations ("expected no batch-size rampup for
    # iteration-based training").
    "gpt3_175b": Line("examples/gpt3/train_gpt3_175b_distributed.sh", "gpt", 128,
                      [*GPT3_175B_MODEL, *GPT3_175B_TRAINING[:4], "--rampup-batch-size", "16",
                       "16", "5859375", *GPT3_175B_TRAINING[4:], *GPT3_175B_REST],
                      "--rampup-batch-size counts samples"),
    # ... without the ramp, the rest as written
    "gpt3_175b no ramp": Line("examples/gpt3/train_gpt3_175b_distributed.sh", "gpt", 128,
                              [*GPT3_175B_MODEL, *GPT3_175B_TRAINING, *GPT3_175B_REST]),
    # main branch: --step-batch-size-schedule, which 0.16.1 does not have
    "gpt3_175b main": Line("examples/gpt3/train_gpt3_175b_distributed.sh (main)", "gpt", 128,
                           GPT3_175B_HEAD, "--step-batch-size-schedule"),
    # examples/bert/train_bert_340m_distributed.sh as written: TP=8 x PP=16 on 16 nodes; its 24
    # layers do not divide among 16 stages, which Megatron-LM refuses too
    "bert_340m": Line("examples/bert/train_bert_340m_distributed.sh", "bert", 128,
                      [*BERT_340M, "--tensor-model-parallel-size", "8",
                       "--pipeline-model-parallel-size", "16", *BERT_340M_REST],
                      "--num-layers 24 is not divisible by --pipeline-model-parallel-size 16"),
    # ... on one node: TP=8, PP=1 (examples/bert/README.md: edit the parallel sizes to fit)
    "bert_340m one node": Line("examples/bert/train_bert_340m_distributed.sh", "bert", 8,
                               [*BERT_340M, "--tensor-model-parallel-size", "8",
                                "--pipeline-model-parallel-size", "1", *BERT_340M_REST]),
    # ... PP=4 on 4 nodes, no TP
    "bert_340m pp4": Line("examples/bert/train_bert_340m_distributed.sh", "bert", 32,
                          [*BERT_340M, "--tensor-model-parallel-size", "1",
                           "--pipeline-model-parallel-size", "4", *BERT_340M_REST]),
    # examples/llama/train_llama3_8b_h100_fp8.sh as written (DTYPE=fp8)
    "llama3_8b fp8": Line("examples/llama/train_llama3_8b_h100_fp8.sh", "llama", 8,
                          [*LLAMA3_8B_MODEL, *LLAMA3_8B_TRAINING, *LLAMA3_8B_FP8,
                           *LLAMA3_8B_PARALLEL, *LLAMA3_8B_MOCK, *LLAMA3_8B_LOGGING], TE_OR_FP8),
    # ... DTYPE=bf16 (its other branch: no FP8 flags), through both launchers
    "llama3_8b bf16": Line("examples/llama/train_llama3_8b_h100_fp8.sh", "llama", 8,
                           LLAMA3_8B_BF16, TE_OR_FP8),
    "llama3_8b bf16 as gpt": Line("examples/llama/train_llama3_8b_h100_fp8.sh", "gpt", 8,
                                  LLAMA3_8B_BF16, TE_OR_FP8),
    # ... without its GPU-only flags
    "llama3_8b cpu": Line("examples/llama/train_llama3_8b_h100_fp8.sh", "llama", 8,
                          LLAMA3_8B_CPU),
    "llama3_8b cpu as gpt": Line("examples/llama/train_llama3_8b_h100_fp8.sh", "gpt", 8,
                                 LLAMA3_8B_CPU),
    # ... main branch: --normalization RMSNorm; data from a file prefix (its non-MOCK branch)
    "llama3_8b main": Line("examples/llama/train_llama3_8b_h100_fp8.sh (main)", "llama", 8,
                           [*LLAMA3_8B_MODEL, "--normalization", "RMSNorm", *LLAMA3_8B_TRAINING,
                            *LLAMA3_8B_PARALLEL, *GPT_DATA, "--data-cache-path",
                            "benchmark_cache_llama3_8b", "--split", "'99,1,0'",
                            "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files",
                            "--num-workers", "1", "--vocab-size", "128256",
                            *LLAMA3_8B_LOGGING], TE_OR_FP8),
    # examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh (main), DTYPE=bf16
    "llama3_8b megatron fsdp": Line(
        "examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh (main)", "llama", 8,
        [*LLAMA3_8B_MODEL, "--normalization", "RMSNorm", "--use-megatron-fsdp",
         "--data-parallel-sharding-strategy", "optim_grads_params",
         "--no-gradient-accumulation-fusion", "--calculate-per-token-loss",
         "--init-model-with-meta-device", "--ckpt-format", "fsdp_dtensor",
         *LLAMA3_8B_PARALLEL, "--use-distributed-optimizer", "--overlap-grad-reduce",
         "--overlap-param-gather", *LLAMA3_8B_MOCK, "--micro-batch-size", "1",
         "--global-batch-size", "128", "--train-samples", "1953125000", "--lr", "0.00015",
         "--bf16"], FSDP),
    # examples/mixtral/train_mixtral_8x7b_distributed.sh on 4 nodes (PP=4 x EP=8)
    "mixtral_8x7b": Line("examples/mixtral/train_mixtral_8x7b_distributed.sh", "gpt", 32,
                         MIXTRAL_8X7B, MOE),
    # docs/user-guide/training-examples.md: "Custom LLaMA Training" and "GPT-3 Training Example"
    "docs custom llama": Line("docs/user-guide/training-examples.md", "gpt", 8,
                              DOCS_CUSTOM_LLAMA),
    "docs gpt3": Line("docs/user-guide/training-examples.md", "gpt", 8, DOCS_GPT3),
    # docs/user-guide/parallelism-guide.md
    # (sequence parallelism needs Megatron-Core's TE layers: its local torch norm asserts)
    "guide tp4 sp": Line("docs/user-guide/parallelism-guide.md (tensor parallel)", "gpt", 4,
                         [*GUIDE_SHAPE, "--tensor-model-parallel-size", "4",
                          "--sequence-parallel"], TE_OR_FP8),
    "guide tp4": Line("docs/user-guide/parallelism-guide.md (tensor parallel)", "gpt", 4,
                      [*GUIDE_SHAPE, "--tensor-model-parallel-size", "4"]),
    "guide pp8 vpp": Line("docs/user-guide/parallelism-guide.md (pipeline parallel)", "gpt", 8,
                          [*GUIDE_SHAPE[2:], "--num-layers", "64",
                           "--pipeline-model-parallel-size", "8",
                           "--num-layers-per-virtual-pipeline-stage", "4"]),
    "guide overlap": Line("docs/user-guide/parallelism-guide.md (communication overlap)", "gpt",
                          8, [*GUIDE_SHAPE, "--tensor-model-parallel-size", "2",
                              "--sequence-parallel", "--use-distributed-optimizer",
                              "--overlap-grad-reduce", "--overlap-param-gather"], TE_OR_FP8),
    "guide overlap no sp": Line("docs/user-guide/parallelism-guide.md (communication overlap)",
                                "gpt", 8, [*GUIDE_SHAPE, "--tensor-model-parallel-size", "2",
                                           "--use-distributed-optimizer", "--overlap-grad-reduce",
                                           "--overlap-param-gather"]),
    "guide tp comm overlap": Line("docs/user-guide/parallelism-guide.md (communication overlap)",
                                  "gpt", 8, [*GUIDE_SHAPE, "--tensor-model-parallel-size", "2",
                                             "--sequence-parallel", "--tp-comm-overlap"],
                                  TE_OR_FP8),
    "guide fsdp": Line("docs/user-guide/parallelism-guide.md (FSDP)", "gpt", 8,
                       [*GUIDE_SHAPE, "--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                        "optim_grads_params"], FSDP),
    "guide ddp no_shard": Line("docs/user-guide/parallelism-guide.md (DDP)", "gpt", 8,
                               [*GUIDE_SHAPE, "--data-parallel-sharding-strategy", "no_shard"]),
    "guide combined": Line("docs/user-guide/parallelism-guide.md (combining strategies)", "gpt",
                           64, GUIDE_COMBINED, CP),
    "guide expert parallel": Line("docs/user-guide/parallelism-guide.md (expert parallel)", "gpt",
                                  8, [*GUIDE_SHAPE, "--expert-model-parallel-size", "8",
                                      "--num-experts", "64", "--moe-grouped-gemm"], MOE),
    # docs/user-guide/features/pipeline_parallel_layout.md: a layout string (E, t, L)
    "pipeline layout": Line("docs/user-guide/features/pipeline_parallel_layout.md", "gpt", 4,
                            [*GUIDE_SHAPE[2:], "--num-layers", "8",
                             "--pipeline-model-parallel-size", "4",
                             "--pipeline-model-parallel-layout", "Ett|tt|tt|ttL"]),
    # sc21: run_table_1.sh 1.7B (4 nodes) as written, then modernized; 39B, 76B (interleaved);
    # run_figure_11.sh PP=2; run_figure_18.sh (interleaved, no scatter-gather)
    "sc21 table_1 1.7B": Line("examples/academic_paper_scripts/sc21/run_table_1.sh", "gpt", 32,
                              sc21(1, 1, 16, 512, 24, 2304, 24, modern=False, ddp="torch"),
                              "--activations-checkpoint-method"),
    "sc21 table_1 1.7B modern": Line("examples/academic_paper_scripts/sc21/run_table_1.sh", "gpt",
                                     32, sc21(1, 1, 16, 512, 24, 2304, 24)),
    "sc21 table_1 39B": Line("examples/academic_paper_scripts/sc21/run_table_1.sh", "gpt", 512,
                             sc21(8, 2, 4, 1536, 48, 8192, 64)),
    "sc21 table_1 76B": Line("examples/academic_paper_scripts/sc21/run_table_1.sh", "gpt", 1024,
                             sc21(8, 4, 2, 1792, 60, 10240, 80,
                                  ["--num-layers-per-virtual-pipeline-stage", "5"])),
    "sc21 figure_11": Line("examples/academic_paper_scripts/sc21/run_figure_11.sh", "gpt", 16,
                           sc21(8, 2, 1, 8, 6, 20480, 128)),
    "sc21 figure_18": Line("examples/academic_paper_scripts/sc21/run_figure_18.sh", "gpt", 96,
                           sc21(8, 12, 1, 12, 96, 12288, 96,
                                ["--num-layers-per-virtual-pipeline-stage", "2",
                                 "--no-scatter-gather-tensors-in-pipeline"])),
    # examples/academic_paper_scripts/detxoify_lm/finetune_gpt_distributed-1.3b.sh, its
    # finetune_gpt.py's own flags (--data-path2) and the removed ones (--DDP-impl, and
    # --checkpoint-activations: --recompute-activations) aside
    "detxoify 1.3b": Line("examples/academic_paper_scripts/detxoify_lm/"
                          "finetune_gpt_distributed-1.3b.sh", "gpt", 16,
                          DETOX, "needs CUDA GPUs"),
    "detxoify 1.3b gloo": Line("examples/academic_paper_scripts/detxoify_lm/"
                               "finetune_gpt_distributed-1.3b.sh", "gpt", 16,
                               [word for flag in split_flags(DETOX, USER)
                                if flag.name != "--distributed-backend" for word in flag.words]),
    # examples/post_training/modelopt/conf: Qwen2.5-0.5B / 7B, Qwen3-0.6B / 8B, Qwen3-30B-A3B
    # (MoE), Llama-3.1-8B / 3.2-1B, with finetune.sh's training flags
    "qwen2.5 0.5b": Line("examples/post_training/modelopt/conf/Qwen/Qwen2.5-0.5B-Instruct.sh",
                         "gpt", 8, modelopt(24, 896, 4864, 14, 2, 4096, 32768, 151936,
                                            ["--add-qkv-bias", *QWEN_ROPE, "--kv-channels", "64",
                                             "--padded-vocab-size", "151936",
                                             "--make-vocab-size-divisible-by", "1"])),
    "qwen2.5 7b": Line("examples/post_training/modelopt/conf/Qwen/Qwen2.5-7B-Instruct.sh",
                       "llama", 8, modelopt(28, 3584, 18944, 28, 4, 4096, 32768, 152064,
                                            ["--add-qkv-bias", *QWEN_ROPE, "--kv-channels",
                                             "128", "--padded-vocab-size", "152064",
                                             "--make-vocab-size-divisible-by", "1",
                                             "--untie-embeddings-and-output-weights"]),
                       known=QKV_BIAS),
    "qwen3 0.6b": Line("examples/post_training/modelopt/conf/Qwen/Qwen3-0.6B.sh", "gpt", 8,
                       modelopt(28, 1024, 3072, 16, 8, 4096, 40960, 151936,
                                [*QWEN_ROPE, "--kv-channels", "128", "--qk-layernorm",
                                 "--make-vocab-size-divisible-by", "1187"])),
    "qwen3 8b": Line("examples/post_training/modelopt/conf/Qwen/Qwen3-8B.sh", "llama", 8,
                     modelopt(36, 4096, 12288, 32, 8, 4096, 40960, 151936,
                              ["--untie-embeddings-and-output-weights", *QWEN_ROPE,
                               "--kv-channels", "128", "--qk-layernorm",
                               "--make-vocab-size-divisible-by", "1187"]),
                     known="--qk-layernorm is GPT's architecture here, not --model llama's preset "
                           "(by design: run_single_gpt.sh takes it)"),
    "qwen3 30b-a3b": Line("examples/post_training/modelopt/conf/Qwen/Qwen3-30B-A3B.sh", "gpt", 8,
                          modelopt(48, 2048, 6144, 32, 4, 4096, 40960, 151936,
                                   ["--untie-embeddings-and-output-weights", *QWEN_ROPE,
                                    "--kv-channels", "128", "--qk-layernorm", "--num-experts",
                                    "128", "--moe-ffn-hidden-size", "768", "--moe-router-topk",
                                    "8", "--moe-router-dtype", "fp32", "--moe-aux-loss-coeff",
                                    "1e-3", "--moe-token-dispatcher-type", "alltoall",
                                    "--moe-router-load-balancing-type", "aux_loss",
                                    "--make-vocab-size-divisible-by", "1187",
                                    "--sequence-parallel"]), MOE),
    "llama3.1 8b": Line("examples/post_training/modelopt/conf/meta-llama/"
                        "Llama-3.1-8B-Instruct.sh", "llama", 8,
                        modelopt(32, 4096, 14336, 32, 8, 4096, 8192, 128256,
                                 ["--untie-embeddings-and-output-weights", *LLAMA31_ROPE,
                                  "--make-vocab-size-divisible-by", "1"])),
    "llama3.2 1b": Line("examples/post_training/modelopt/conf/meta-llama/"
                        "Llama-3.2-1B-Instruct.sh", "gpt", 8,
                        modelopt(16, 2048, 8192, 32, 8, 4096, 8192, 128256,
                                 [*LLAMA31_ROPE, "--make-vocab-size-divisible-by", "1"])),
    # ... a --load that is not there (and is not --save): Megatron-LM warns and starts from
    # random weights (--exit-on-missing-checkpoint off)
    "llama3.2 1b no checkpoint": Line(
        "examples/post_training/modelopt/conf/meta-llama/Llama-3.2-1B-Instruct.sh", "llama", 8,
        [*modelopt(16, 2048, 8192, 32, 8, 4096, 8192, 128256,
                   [*LLAMA31_ROPE, "--make-vocab-size-divisible-by", "1"]),
         "--load", "checkpoints/Llama-3.2-1B-Instruct_mlm"]),
}


def _dry_run(line: Line, pretrained: str) -> subprocess.CompletedProcess:
    env = _env()
    for name in _LAUNCH_VARIABLES:
        env.pop(name, None)
    env.update(line.env, NPROC=str(line.nproc))
    flags = [pretrained if word == PRETRAINED else word for word in line.flags]
    return subprocess.run(["bash", str(SCRIPTS / f"run_single_{line.model}.sh"), "--dry-run",
                           *flags], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


# The flags naming paths, which the launcher makes absolute against the directory it ran from.
PATH_FLAGS = {"--data-path", "--vocab-file", "--merge-file", "--save", "--load",
              "--tensorboard-dir", "--data-cache-path"}


def _absolute(words: tuple[str, ...]) -> tuple[str, ...]:
    if words[0] not in PATH_FLAGS:
        return words
    return (words[0], *(str(REPO_ROOT / word) for word in words[1:]))


def _trainer_flags(stdout: str) -> list[str]:
    (line,) = [line for line in stdout.splitlines() if line.startswith("node 0: ")]
    argv = shlex.split(line[len("node 0: "):])
    return argv[argv.index("-m", argv.index("megatron_dpp.rank_launcher")) + 2:]


# What the launcher may add to a user's full command line: the layout of the process count it
# starts, and the dynamic schedule of a pipeline.
# BERT's lines name a WordPiece vocabulary and no --tokenizer-type (Megatron-LM has no default
# type): the launcher names the one of BERT's sample vocabulary, BertWordPieceLowerCase.
LAUNCHER_ADDS = {"--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--use-dpp",
                 "--num-virtual-stages-per-pipeline-rank"}
BERT_LAUNCHER_ADDS = {"--tokenizer-type"}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> str:
    ensure_sample_data()
    load = tmp_path_factory.mktemp("pretrained")
    (load / "latest_checkpointed_iteration.txt").write_text("1000\n")
    return str(load)


def _params():
    for name, line in CORPUS.items():
        marks = [pytest.mark.xfail(strict=True, reason=line.known)] if line.known else []
        yield pytest.param(line, id=name, marks=marks)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("line", _params())
def test_a_megatron_lm_command_line_runs_as_written_or_is_refused_in_one_line(line, pretrained):
    result = _dry_run(line, pretrained)
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    if line.expect != RUNS:
        errors = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(errors) == 1, (result.returncode, result.stderr)
        assert line.expect in errors[0], errors[0]
        return
    assert result.returncode == 0, result.stderr
    argv = _trainer_flags(result.stdout)
    if line.model == "llama":
        argv = argv[2:]  # --model llama
    theirs = {_absolute(flag.words) for flag in split_flags(
        [pretrained if word == PRETRAINED else word for word in line.flags], USER)}
    command = {flag.words for flag in split_flags(argv, USER)}
    assert theirs <= command, theirs - command
    added = {words[0] for words in command - theirs}
    allowed = LAUNCHER_ADDS | (BERT_LAUNCHER_ADDS if line.model == "bert" else set())
    assert added <= allowed, added - allowed
    assert "from recipe" not in result.stdout
