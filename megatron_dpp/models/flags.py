"""The shared model-shape and parallel-layout flags (--help's "model" and "parallelism" groups) and
their checks: what becomes Megatron-Core's TransformerConfig and ModelParallelConfig
(models/transformer_config.py) and the data-parallel config (training/config.py). Each model's own
flags are its family's (models/families.py); megatron_dpp.arguments composes both.

Torch-free, as the launcher's flag check is: whether there is a CUDA GPU comes from
megatron_dpp.cuda_presence.
"""
from __future__ import annotations

import argparse
import os
from typing import Optional

from megatron_dpp.cuda_presence import cuda_available
from megatron_dpp.flag_errors import (ArgsError, add_refused_flags, add_stated_flags, first_given,
                                      require)
from megatron_dpp.kernels import (
    ATTENTION_BACKENDS,
    TRANSFORMER_ENGINE,
    TRANSFORMER_ENGINE_BACKENDS,
    core_attention_from_args,
    cuda_graph_obstacle,
    transformer_engine_available,
)
from megatron_dpp.models.families import add_architecture_shape_args, add_rope_scaling_args
from megatron_dpp.models import megatron_lm_flags
from megatron_dpp.models.pipeline_split import (EMBEDDING_FLAG, FIRST_FLAG, LAST_FLAG, LAYOUT_FLAG,
                                                 LOSS_FLAG, PipelineSplit, layout_layers)


_TP_COMM_OVERLAP = ("Transformer Engine's userbuffer overlap of tensor-parallel communication with "
                    "GEMMs, which this runtime does not set up (Megatron-LM's initialize_ub step)")
# Megatron-LM's parallelism flags that cannot apply here: flag -> why (flag_errors.py).
REFUSED_PARALLEL_FLAGS: dict[str, str] = {
    "--pipeline-model-parallel-split-rank":
        "splits an encoder-decoder model's pipeline between encoder and decoder ranks; GPT and "
        "BERT are one stack of layers with no such split",
    "--use-ring-exchange-p2p":
        "needs torch.distributed.ring_exchange, which only custom PyTorch builds have (stock "
        "PyTorch, this one included, has none)",
    "--no-async-tensor-model-parallel-allreduce":
        "is ignored by Megatron-Core 0.16 (ModelParallelConfig.async_tensor_model_parallel_allreduce "
        "is deprecated): the tensor-parallel all-reduce always runs asynchronously beside the "
        "weight-gradient GEMM",
    "--use-torch-fsdp2": "(FSDP) is not a layout here: data parallelism is Megatron-Core's DDP, "
                         "with --use-distributed-optimizer to shard the optimizer's state",
    "--num-experts": "(mixture-of-experts layers) is in none of the models here (gpt, bert, llama)",
    "--tp-comm-overlap": f"needs {_TP_COMM_OVERLAP}",
    "--tp-comm-overlap-cfg": f"configures --tp-comm-overlap, {_TP_COMM_OVERLAP}",
    **{flag: f"tunes --tp-comm-overlap, {_TP_COMM_OVERLAP}"
       for flag in ("--disable-tp-comm-split-ag", "--disable-tp-comm-split-rs",
                    "--disable-tp-comm-bulk-dgrad", "--disable-tp-comm-bulk-wgrad")},
    **megatron_lm_flags.REFUSED_PARALLEL,
}


_FP8 = ("needs Transformer Engine's FP8 layers, which this runtime does not build (train with "
        "--bf16 or --fp16)")
# Megatron-LM's model flags (its example scripts carry them) that cannot apply here: flag -> why.
REFUSED_MODEL_FLAGS: dict[str, str] = {
    "--apply-layernorm-1p": "(zero-centred norm weights, stored as weight - 1) needs Transformer "
                            "Engine's norms (Megatron-Core's local torch norm has no zero-centred "
                            "weights), which this runtime does not build: the norms keep Megatron-"
                            "Core's usual weights and checkpoints",
    "--fp8-format": _FP8,
    "--fp8-amax-history-len": _FP8,
    "--fp8-amax-compute-algo": _FP8,
    "--fp8-param-gather": _FP8,
    **megatron_lm_flags.REFUSED_MODEL,
}
MODEL_FLAGS_TAKING_A_VALUE = ("--fp8-format", "--fp8-amax-history-len", "--fp8-amax-compute-algo")
CROSS_ENTROPY_FUSION_IMPLS = ("native", "te")  # Megatron-LM's --cross-entropy-fusion-impl


# ----------------------------------------------------------------------------------------------
# model shape
# ----------------------------------------------------------------------------------------------
def _add_architecture_flags(group) -> None:
    """Megatron-LM's flags that describe the architecture (models/families.py, ARCHITECTURE_FLAGS):
    GPT takes each on its own, in Megatron-LM's names and defaults; BERT and Llama have one
    architecture each (Llama's a preset of these), which a command line may state, and one naming
    another value is refused in one line."""
    add_architecture_shape_args(group)
    add_rope_scaling_args(group)
    group.add_argument("--apply-query-key-layer-scaling", action="store_const", const=True,
                       default=None,
                       help="Divide each layer's attention scores by its layer number before the "
                            "softmax, which runs in fp32 and multiplies them back (Megatron-"
                            "Core's guard against fp16 overflow; the same attention otherwise).")
    group.add_argument("--no-rope-fusion", action="store_false", dest="apply_rope_fusion",
                       help="Apply rotary embeddings with Megatron-Core's unfused torch ops "
                            "(Megatron-LM's flag against Transformer Engine's fused kernel, which "
                            "this runtime never sets up: always so here; the `kernels:` line "
                            "says).")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--num-layers", type=int, default=None, help="Number of transformer layers.")
    group.add_argument("--hidden-size", type=int, default=None, help="Transformer hidden size.")
    group.add_argument("--ffn-hidden-size", type=int, default=None,
                       help="MLP hidden size (default: 4 * hidden size).")
    group.add_argument("--num-attention-heads", type=int, default=None,
                       help="Number of attention heads.")
    group.add_argument("--seq-length", type=int, default=None,
                       help="Maximum sequence length of a training sample.")
    group.add_argument("--max-position-embeddings", type=int, default=None,
                       help="Number of position embeddings (default: --seq-length).")
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                       help="Pad the vocabulary to a multiple of this times the tensor parallel size.")
    group.add_argument("--init-method-std", type=float, default=0.02,
                       help="Standard deviation of the normal weight initialization.")
    group.add_argument("--hidden-dropout", type=float, default=0.1,
                       help="Dropout probability on the hidden state (0 disables).")
    group.add_argument("--attention-dropout", type=float, default=0.1,
                       help="Dropout probability on attention scores (0 disables).")
    group.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                       help="Give the output layer its own weights instead of sharing the embedding.")
    group.add_argument("--no-masked-softmax-fusion", action="store_false",
                       dest="masked_softmax_fusion",
                       help="Do not use Megatron's fused scaled masked softmax kernels "
                            "(Megatron-Core's masked_softmax_fusion). Without the flag they run "
                            "where the local DotProductAttention runs on a GPU and the kernels "
                            "are installed (the `kernels:` line says).")
    group.add_argument("--attention-softmax-in-fp32", action="store_true",
                       help="Accepted for Megatron-LM command lines and always so here: "
                            "Megatron-Core's local DotProductAttention computes its softmax in "
                            "fp32 under --bf16/--fp16 (Megatron-Core's default, which the "
                            "activation-memory model counts; torch SDPA, the GPU default, "
                            "accumulates in fp32 anyway).")
    group.add_argument("--transformer-impl", choices=["local", "transformer_engine"],
                       default=None,
                       help="Megatron-LM's choice of layers. local: Megatron-Core's local layers, "
                            "never Transformer Engine's; transformer_engine: Transformer Engine's "
                            "(refused where it is not installed). Without it: Transformer "
                            "Engine's where installed on a GPU, else the local ones.")
    group.add_argument("--norm-epsilon", type=float, default=1e-5,
                       help="Epsilon of the LayerNorm/RMSNorm layers (default %(default)s).")
    _add_architecture_flags(group)
    group.add_argument("--cross-entropy-loss-fusion", action="store_true",
                       help="Compute the loss with Megatron-Core's fused vocab-parallel cross "
                            "entropy instead of the unfused one, as Megatron-LM: the same loss; "
                            "its functions are torch.compile'd on a GPU, and its backward rounds "
                            "the logits' gradient to bf16 (it is meant for --bf16).")
    group.add_argument("--cross-entropy-fusion-impl", choices=CROSS_ENTROPY_FUSION_IMPLS,
                       default="native",
                       help="With --cross-entropy-loss-fusion: Megatron-Core's native fused "
                            "cross entropy (default) or Transformer Engine's (where installed).")
    group.add_argument("--deterministic-mode", action="store_true",
                       help="Bitwise repeatable runs, as Megatron-LM: torch's deterministic "
                            "algorithms on every rank and Megatron-Core's deterministic_mode "
                            "(an embedding whose backward does not scatter-add with atomics); "
                            "not with --use-flash-attn or --cross-entropy-loss-fusion, and, on "
                            "NCCL, with NCCL_ALGO set to a fixed all-reduce algorithm (Tree, "
                            "Ring, CollnetDirect, CollnetChain or ^NVLS). A GPU also needs "
                            "CUBLAS_WORKSPACE_CONFIG=:4096:8 (torch's requirement).")
    add_refused_flags(group, REFUSED_MODEL_FLAGS, taking_a_value=MODEL_FLAGS_TAKING_A_VALUE,
                      taking_values=megatron_lm_flags.REFUSED_MODEL)
    add_stated_flags(group, megatron_lm_flags.STATED_MODEL)
    group.add_argument("--use-flash-attn", action="store_true",
                       help="Use FlashAttention for core attention; GPU only: Transformer Engine's "
                            "flash backend where it is installed, else the flash-attn package's "
                            "flash_attn_func, else (one log line says so) torch SDPA, whose flash "
                            "kernel is the same algorithm.")
    group.add_argument("--attention-backend", type=str, default="auto",
                       choices=ATTENTION_BACKENDS,
                       help="Core attention (Megatron-LM's flag). auto: Transformer Engine's where "
                            "installed on a GPU, else torch scaled_dot_product_attention on a GPU "
                            "and Megatron-Core's local DotProductAttention on CPU; sdpa: torch "
                            "scaled_dot_product_attention (any device); local: Megatron-Core's "
                            "DotProductAttention (unfused softmax); flash, fused, unfused: "
                            "Transformer Engine's kernels (need Transformer Engine). The startup "
                            "line `kernels: core attention: ...` says which runs and why.")
    group.add_argument("--recompute-activations", action="store_true",
                       help="Recompute activations (selective granularity) to save memory.")
    group.add_argument("--recompute-granularity", type=str, default=None,
                       choices=["full", "selective"],
                       help="full: recompute whole transformer layers; selective: core attention only.")
    group.add_argument("--recompute-method", type=str, default=None, choices=["uniform", "block"],
                       help="With full granularity: uniform divides the layers into recompute units "
                            "of --recompute-num-layers; block recomputes the first "
                            "--recompute-num-layers layers of each pipeline stage.")
    group.add_argument("--recompute-num-layers", type=int, default=None,
                       help="Layers per recompute unit (uniform) or layers recomputed per stage (block).")
    group.add_argument("--distribute-saved-activations", action="store_true",
                       help="With --recompute-granularity full and tensor parallelism: split the "
                            "input each recomputed unit saves across the tensor-parallel ranks "
                            "(Megatron-Core's distribute_saved_activations). GPU only; not with "
                            "--sequence-parallel.")
    group.add_argument("--no-clone-scatter-output-in-embedding",
                       "--disable-clone-scatter-output-in-embedding", action="store_false",
                       dest="clone_scatter_output_in_embedding",
                       help="Do not clone the embedding output after scattering it to the "
                            "sequence-parallel ranks (Megatron-Core's "
                            "clone_scatter_output_in_embedding; the clone lets the unscattered "
                            "tensor be freed). Has an effect with --sequence-parallel only.")
    group.add_argument("--no-persist-layer-norm", action="store_true",
                       help="Do not use Apex's persistent fused LayerNorm kernel (Megatron-Core's "
                            "persist_layer_norm). Without the flag it is used where Megatron-Core's "
                            "local layers find it (Apex installed), as in Megatron-LM; without Apex, "
                            "with Transformer Engine layers or with --dpp-split-backward it is never "
                            "used.")
    group.add_argument("--no-gradient-accumulation-fusion", action="store_false",
                       dest="gradient_accumulation_fusion",
                       help="Do not fuse the weight-gradient accumulation into the weight-gradient "
                            "GEMM (Megatron-Core's gradient_accumulation_fusion). Without the flag "
                            "it is fused where it can run (a CUDA GPU with Apex's "
                            "fused_weight_gradient_mlp_cuda extension), as in Megatron-LM; on CPU, "
                            "without Apex or with --dpp-split-backward it is always off.")
    # Megatron-LM's --no-bias-*-fusion flags; the positive forms undo a recipe's --no-... (last wins).
    for activation in ("gelu", "swiglu"):
        group.add_argument(f"--bias-{activation}-fusion", action=argparse.BooleanOptionalAction,
                           default=True,
                           help=f"Fuse the MLP's bias add and {activation} into one "
                                f"torch.compile'd kernel (Megatron-Core's bias_activation_fusion, "
                                f"for models whose MLP is {activation}; default on where "
                                f"torch.compile has a GPU backend). Each fused call costs the host "
                                f"more than the separate torch ops do, so a small model whose step "
                                f"is bound by the host can be faster without it (docs/gpu.md).")
    group.add_argument("--bias-dropout-fusion", action=argparse.BooleanOptionalAction, default=True,
                       help="Fuse the bias add, dropout and residual add after attention and "
                            "after the MLP into one torch.compile'd kernel (Megatron-Core's "
                            "bias_dropout_fusion; default on where torch.compile has a GPU "
                            "backend). As --bias-gelu-fusion, it trades host time for device time.")
    group.add_argument("--cuda-graph-impl", type=str, default="none", choices=("none", "local"),
                       help="none (default): launch every kernel from Python. local: Megatron-Core's "
                            "CUDA graphs (its CudaGraphManager): each transformer layer's forward "
                            "and backward is captured at the end of the first training iteration "
                            "and replayed from then on, so the host launches one graph per layer "
                            "instead of its kernels; for a step bound by the host (docs/gpu.md). "
                            "Needs a CUDA GPU, Megatron's schedules (not --use-dpp), fixed "
                            "sequence lengths and no activation recomputation; the graphs hold "
                            "their own activation memory. Megatron-LM's transformer_engine value "
                            "(Transformer Engine's graphs) is not supported here.")
    group.add_argument("--use-mcore-models", action="store_true",
                       help="Accepted for Megatron-LM command lines; always so here: the models "
                            "are Megatron-Core's "
                            "(GPTModel, BertModel); there are no legacy models to choose instead.")


def validate_model_args(args: argparse.Namespace) -> None:
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        value = getattr(args, flag)
        require(value is not None and value > 0,
                f"--{flag.replace('_', '-')} is required and must be positive")
    for flag in ("ffn_hidden_size", "max_position_embeddings"):
        value = getattr(args, flag)
        require(value is None or value > 0,
                f"--{flag.replace('_', '-')} must be positive, got {value}")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    require(args.make_vocab_size_divisible_by > 0,
            f"--make-vocab-size-divisible-by must be positive, got "
            f"{args.make_vocab_size_divisible_by}")
    require(args.init_method_std > 0,
            f"--init-method-std must be positive, got {args.init_method_std}")
    require(args.norm_epsilon > 0, f"--norm-epsilon must be positive, got {args.norm_epsilon}")
    if args.cross_entropy_fusion_impl != "native":
        require(args.cross_entropy_loss_fusion, f"--cross-entropy-fusion-impl "
                f"{args.cross_entropy_fusion_impl} needs --cross-entropy-loss-fusion")
        require(transformer_engine_available(),
                "--cross-entropy-fusion-impl te needs Transformer Engine on a GPU"
                + ("" if cuda_available() else " (this machine has no CUDA GPU)")
                + "; use --cross-entropy-fusion-impl native")
    if args.transformer_impl == "transformer_engine":
        require(transformer_engine_available(),
                "--transformer-impl transformer_engine needs Transformer Engine on a GPU"
                + ("" if cuda_available() else " (this machine has no CUDA GPU)")
                + "; use --transformer-impl local")
        require(not getattr(args, "dpp_split_backward", False),
                "--dpp-split-backward defers weight gradients in Megatron-Core's local layers; "
                "drop --transformer-impl transformer_engine")
        require(args.attention_backend not in ("sdpa", "local"),
                f"--attention-backend {args.attention_backend} is not Transformer Engine's "
                f"attention; drop it or --transformer-impl transformer_engine")
    if args.transformer_impl == "local":
        require(args.attention_backend not in TRANSFORMER_ENGINE_BACKENDS,
                f"--attention-backend {args.attention_backend} is Transformer Engine's; drop it "
                f"or --transformer-impl local")
    # Megatron-LM's rule: the head size defaults to hidden / heads, which must then divide.
    require(getattr(args, "kv_channels", None) is not None
            or args.hidden_size % args.num_attention_heads == 0,
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
            f"{args.num_attention_heads}; pick a head count that divides the hidden size "
            f"(or give the head size, --kv-channels)")
    require(args.seq_length <= args.max_position_embeddings,
            f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
            f"{args.max_position_embeddings}; raise --max-position-embeddings")
    for flag in ("hidden_dropout", "attention_dropout"):
        value = getattr(args, flag)
        require(0.0 <= value < 1.0, f"--{flag.replace('_', '-')} must be in [0, 1), got {value}")

    if args.recompute_activations:
        args.recompute_granularity = "selective"
    if args.recompute_granularity == "full":
        require(args.recompute_method is not None and args.recompute_num_layers is not None,
                "--recompute-granularity full needs --recompute-method {uniform,block} and "
                "--recompute-num-layers N")
        require(args.recompute_num_layers > 0, "--recompute-num-layers must be positive")
    else:
        require(args.recompute_method is None and args.recompute_num_layers is None,
                "--recompute-method and --recompute-num-layers need --recompute-granularity full")

    if args.use_flash_attn:
        # Without flash-attn (or Transformer Engine) it runs torch SDPA and says so at startup.
        require(cuda_available(),
                "--use-flash-attn needs a CUDA GPU; remove it to use the default attention on CPU")
        require(args.attention_backend in ("auto", "flash"),
                f"--use-flash-attn asks for flash attention and --attention-backend "
                f"{args.attention_backend} for another; drop one of them")
    obstacle = deterministic_mode_obstacle(args) if args.deterministic_mode else None
    require(obstacle is None, obstacle or "")
    if args.attention_backend in TRANSFORMER_ENGINE_BACKENDS:
        require(transformer_engine_available(),
                f"--attention-backend {args.attention_backend} is Transformer Engine's attention "
                f"and needs Transformer Engine on a CUDA GPU; use auto, sdpa or local")


# NCCL's all-reduce algorithms whose reduction order is fixed (Megatron-LM's list).
DETERMINISTIC_NCCL_ALGOS = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")


def deterministic_mode_obstacle(args: argparse.Namespace) -> Optional[str]:
    """Why --deterministic-mode cannot hold with these flags (Megatron-LM's checks), or None."""
    if args.use_flash_attn:
        return "--deterministic-mode: flash attention is not deterministic; remove --use-flash-attn"
    if args.cross_entropy_loss_fusion:
        return ("--deterministic-mode: the fused cross entropy is not deterministic; remove "
                "--cross-entropy-loss-fusion")
    uses_nccl = (args.distributed_backend == "nccl" if args.distributed_backend is not None
                 else cuda_available())
    if uses_nccl and os.environ.get("NCCL_ALGO") not in DETERMINISTIC_NCCL_ALGOS:
        return (f"--deterministic-mode needs NCCL_ALGO set to one of "
                f"{', '.join(DETERMINISTIC_NCCL_ALGOS)} (NCCL's all-reduce otherwise picks its "
                f"algorithm per call); it is {os.environ.get('NCCL_ALGO', 'unset')}")
    return None


def validate_cuda_graph_args(args: argparse.Namespace) -> None:
    """--cuda-graph-impl local, against the other groups' flags (run after all of them)."""
    if args.cuda_graph_impl == "none":
        return
    obstacle = cuda_graph_obstacle(args)
    require(obstacle is None, obstacle)


# ----------------------------------------------------------------------------------------------
# parallel layout and distributed runtime
# ----------------------------------------------------------------------------------------------
GROUP_SIZE_FLAG = "--microbatch-group-size-per-virtual-pipeline-stage"


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("parallelism")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1,
                       help="Degree of tensor model parallelism.")
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                       help="Degree of pipeline model parallelism.")
    group.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                       help="Layers per virtual pipeline stage (enables the interleaved schedule).")
    group.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                       help="Virtual pipeline stages (model chunks) per pipeline rank; an alternative "
                            "to --num-layers-per-virtual-pipeline-stage.")
    group.add_argument(GROUP_SIZE_FLAG, type=int, default=None, metavar="N",
                       dest="microbatch_group_size_per_vp_stage",
                       help="Interleaved schedule (virtual pipeline stages): each model chunk "
                            "runs N consecutive micro-batches before the rank moves to its next "
                            "chunk, forwards and backwards alike (Megatron-Core's "
                            "microbatch_group_size_per_vp_stage). Default: "
                            "--pipeline-model-parallel-size, the depth-first order. N must be at "
                            "least the pipeline size and at most the micro-batches per step, and "
                            "the last group (micro-batches mod N) empty or at least the pipeline "
                            "size, so a group larger than the pipeline trains micro-batch counts "
                            "that are not a multiple of it. Also sets --use-dpp's interleaved "
                            "order and its default memory budget.")
    group.add_argument(FIRST_FLAG, type=int, default=None, metavar="N",
                       help="Transformer layers on the first pipeline stage (which also runs the "
                            "embedding); the stages without a count given share the other layers "
                            "evenly. Default: an even split. With virtual stages, a multiple of "
                            "--num-virtual-stages-per-pipeline-rank.")
    group.add_argument(LAST_FLAG, type=int, default=None, metavar="N",
                       help="Transformer layers on the last pipeline stage (which also runs the "
                            "output layer and the loss); as " + FIRST_FLAG + ".")
    group.add_argument(EMBEDDING_FLAG, action="store_true",
                       help="Split evenly with the embedding counted as one layer: the first "
                            "stage builds one transformer layer less (--num-layers + 1 must divide "
                            "by the pipeline stages). Not with " + FIRST_FLAG + " / " + LAST_FLAG
                            + ".")
    group.add_argument(LOSS_FLAG, action="store_true",
                       help="Split evenly with the output layer and loss counted as one layer: "
                            "the last stage builds one transformer layer less; as "
                            + EMBEDDING_FLAG + ".")
    group.add_argument(LAYOUT_FLAG, type=str, default=None, metavar="LAYOUT",
                       help="Every pipeline stage's layers spelled out, as Megatron-LM: E the "
                            "embedding, t a transformer layer, L the loss, stages split by |, "
                            "(...)*n and x*n repeat, commas are cosmetic. More stages than "
                            "--pipeline-model-parallel-size make virtual stages, in order: stage "
                            "k goes to pipeline rank k mod PP. E.g. Et|tt|t|tL: 4 layers on 2 "
                            "ranks, 2 virtual stages each. Not with the other split flags or the "
                            "virtual-stage flags.")
    group.add_argument("--sequence-parallel", action="store_true",
                       help="Enable sequence parallelism (only has an effect with tensor parallelism, "
                            "as in Megatron-LM).")
    group.add_argument("--use-distributed-optimizer", action="store_true",
                       help="Shard optimizer state across data-parallel ranks.")
    group.add_argument("--overlap-grad-reduce", action="store_true",
                       help="Overlap the data-parallel gradient reduction with backward.")
    group.add_argument("--ddp-bucket-size", type=int, default=None, metavar="N",
                       help="With --overlap-grad-reduce: gradient elements per bucket, each "
                            "reduced as soon as backward has filled it (default Megatron-Core's: "
                            "max(40M, 1M x data-parallel size)). Without --overlap-grad-reduce "
                            "all gradients are one bucket, so it needs that flag.")
    group.add_argument("--ddp-num-buckets", type=int, default=None, metavar="N",
                       help="--ddp-bucket-size as a number of buckets: this rank's parameters / N "
                            "elements each (Megatron-LM's); not with --ddp-bucket-size.")
    group.add_argument("--ddp-pad-buckets-for-high-nccl-busbw", action="store_true",
                       help="With --use-distributed-optimizer: pad each gradient bucket to a "
                            "multiple of 2**16 elements (and of the data-parallel size) instead "
                            "of 128, so that NCCL's ring collectives keep a high bus bandwidth at "
                            "large data-parallel sizes (Megatron-Core's "
                            "pad_buckets_for_high_nccl_busbw).")
    group.add_argument("--local-rank", type=int, default=None, metavar="N",
                       help="Accepted for Megatron-LM command lines (torch.distributed.launch "
                            "passes it); always so here: each rank's device is the one of its "
                            "LOCAL_RANK (torchrun's), which N must equal.")
    group.add_argument("--distributed-backend", type=str, default=None, choices=["nccl", "gloo"],
                       help="torch.distributed backend (default: nccl with CUDA, gloo without).")
    group.add_argument("--distributed-timeout-minutes", type=int, default=10,
                       help="Timeout for collective operations, in minutes.")
    group.add_argument("--use-cpu-initialization", action="store_true", default=None,
                       help="Initialize parameters on the CPU (then move them to the device).")
    group.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                       help="Call torch.cuda.empty_cache() each iteration: 0 off, 1 after the "
                            "forward-backward, 2 also after the optimizer step. GPU only.")
    group.add_argument("--context-parallel-size", type=int, default=1,
                       help="Degree of context parallelism. Only 1 runs here: context parallelism "
                            "needs Transformer Engine's attention and a data path that gives each "
                            "context-parallel rank its part of every sequence, which this runtime "
                            "does not have.")
    group.add_argument("--no-delay-grad-reduce", "--no-align-grad-reduce", action="store_false",
                       dest="delay_grad_reduce",
                       help="With --overlap-grad-reduce: every pipeline stage's DDP hooks start its "
                            "gradient reductions during its last backward, instead of the schedule "
                            "delaying them in all but the first stage and launching them at aligned "
                            "points (Megatron-Core's grad_sync_func; Megatron-LM's later name is "
                            "--no-align-grad-reduce). Without --overlap-grad-reduce nothing is "
                            "overlapped, so nothing is delayed.")
    group.add_argument("--overlap-param-gather", action="store_true",
                       help="With --use-distributed-optimizer and --overlap-grad-reduce: gather the "
                            "updated parameters during the next forward (DDP forward pre-hooks wait "
                            "for each bucket's all-gather) instead of at the end of the optimizer "
                            "step (Megatron-Core's overlap_param_gather).")
    group.add_argument("--delay-param-gather", action="store_true",
                       help="With --overlap-param-gather and virtual pipeline stages or --use-dpp: "
                            "the schedule launches each model chunk's parameter all-gathers at "
                            "aligned points across pipeline stages instead of the forward pre-hooks "
                            "launching them on demand (Megatron-Core's align_param_gather and "
                            "param_sync_func; Megatron-LM's later name is --align-param-gather).")
    group.add_argument("--no-overlap-p2p-communication", action="store_false",
                       dest="overlap_p2p_comm",
                       help="Interleaved schedule (virtual pipeline stages): wait for each pipeline "
                            "send and receive before computing on, instead of overlapping them with "
                            "the next forward or backward (Megatron-Core's overlap_p2p_comm). "
                            "Megatron's 1F1B schedule never overlaps, as in Megatron-LM; not with "
                            "--use-dpp, whose runtime always overlaps its messages.")
    group.add_argument("--no-scatter-gather-tensors-in-pipeline", action="store_false",
                       dest="scatter_gather_tensors_in_pipeline",
                       help="Accepted for Megatron-LM command lines; always so here: pipeline "
                            "messages are whole tensors (Megatron-Core 0.16 no longer has the scatter/gather split of "
                            "pipeline tensors across tensor-parallel ranks).")
    add_refused_flags(group, REFUSED_PARALLEL_FLAGS,
                      taking_a_value=("--pipeline-model-parallel-split-rank", "--tp-comm-overlap-cfg",
                                      "--num-experts"),
                      taking_values=megatron_lm_flags.REFUSED_PARALLEL)
    add_stated_flags(group, megatron_lm_flags.STATED_PARALLEL)


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def pipeline_split_from_args(args: argparse.Namespace) -> PipelineSplit:
    """The layer split of the validated flags (models/pipeline_split.py)."""
    return PipelineSplit(num_layers=args.num_layers,
                         pipeline_size=args.pipeline_model_parallel_size,
                         virtual_size=args.virtual_pipeline_model_parallel_size,
                         first=args.decoder_first_pipeline_num_layers,
                         last=args.decoder_last_pipeline_num_layers,
                         embedding_is_a_layer=args.account_for_embedding_in_pipeline_split,
                         loss_is_a_layer=args.account_for_loss_in_pipeline_split,
                         layout=layout_layers(getattr(args, "pipeline_layout", None)))


def parse_pipeline_layout(text: str, pipeline_size: int, num_layers: int):
    """Megatron-Core's PipelineParallelLayerLayout of --pipeline-model-parallel-layout, validated
    as its TransformerConfig validates it; ArgsError with one line otherwise. MTP layers ('m')
    are refused: no model here has them."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout)

    flag = f"{LAYOUT_FLAG} {text!r}"

    def megatron_refuses(error: Exception) -> ArgsError:
        reason = " ".join(str(error).split()) or type(error).__name__
        return ArgsError(f"{flag}: {reason} (E the embedding first, t a transformer layer, L the "
                         f"loss last, stages split by |)")

    try:
        stages = PipelineParallelLayerLayout.parse_str_to_list(text)
    except AssertionError as error:
        raise megatron_refuses(error) from None
    require(not any(getattr(layer, "name", "") == "mtp" for stage in stages for layer in stage),
            f"{flag}: 'm' (multi-token prediction layers) is not built here")
    placed = sum(getattr(layer, "name", "") == "decoder" for stage in stages for layer in stage)
    require(placed == num_layers,
            f"{flag} places {placed} transformer layers ('t'), --num-layers is {num_layers}")
    require(len(stages) % pipeline_size == 0,
            f"{flag} has {len(stages)} stages, not a multiple of --pipeline-model-parallel-size "
            f"{pipeline_size}")
    try:
        layout = PipelineParallelLayerLayout(text, pipeline_size)
        layout.validate_layer_layout(num_layers=num_layers, mtp_num_layers=None)
    except AssertionError as error:  # (its encoder-layer refusal cannot come from a string)
        raise megatron_refuses(error) from None
    return layout


def _derive_pipeline_split(args: argparse.Namespace) -> None:
    """args.virtual_pipeline_model_parallel_size from the virtual-stage flags (Megatron-LM's
    rules), then the whole split checked (PipelineSplit.check)."""
    pp = args.pipeline_model_parallel_size
    require(args.num_layers_per_virtual_pipeline_stage is None
            or args.num_virtual_stages_per_pipeline_rank is None,
            "give either --num-layers-per-virtual-pipeline-stage or "
            "--num-virtual-stages-per-pipeline-rank, not both")
    args.virtual_pipeline_model_parallel_size = None
    args.pipeline_layout = None
    if args.pipeline_model_parallel_layout is not None:
        virtual = first_given((
            ("--num-layers-per-virtual-pipeline-stage",
             args.num_layers_per_virtual_pipeline_stage is not None),
            ("--num-virtual-stages-per-pipeline-rank",
             args.num_virtual_stages_per_pipeline_rank is not None)))
        require(virtual is None, f"{LAYOUT_FLAG} gives the virtual stages itself (its stages / "
                                 f"--pipeline-model-parallel-size); remove {virtual}")
        args.pipeline_layout = parse_pipeline_layout(args.pipeline_model_parallel_layout, pp,
                                                     args.num_layers)
        args.virtual_pipeline_model_parallel_size = \
            args.pipeline_layout.virtual_pipeline_model_parallel_size
    elif args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = args.num_layers_per_virtual_pipeline_stage
        uneven = first_given(((FIRST_FLAG, args.decoder_first_pipeline_num_layers is not None),
                              (LAST_FLAG, args.decoder_last_pipeline_num_layers is not None)))
        require(uneven is None,
                f"{uneven} makes the stages uneven; give the virtual stages with "
                f"--num-virtual-stages-per-pipeline-rank instead of "
                f"--num-layers-per-virtual-pipeline-stage (as Megatron-LM asks)")
        slots = (args.num_layers + args.account_for_embedding_in_pipeline_split
                 + args.account_for_loss_in_pipeline_split)
        pipeline_split_from_args(args).check()  # the layers (and counted slots) divide by pp
        layers_per_rank = slots // pp
        require(per_stage > 0 and layers_per_rank % per_stage == 0,
                f"--num-layers {args.num_layers} is not divisible by pipeline ({pp}) x layers per "
                f"virtual stage ({per_stage}); pick a --num-layers-per-virtual-pipeline-stage that "
                f"divides {layers_per_rank}")
        args.virtual_pipeline_model_parallel_size = layers_per_rank // per_stage
    elif args.num_virtual_stages_per_pipeline_rank is not None:
        require(args.num_virtual_stages_per_pipeline_rank > 0,
                "--num-virtual-stages-per-pipeline-rank must be positive")
        args.virtual_pipeline_model_parallel_size = args.num_virtual_stages_per_pipeline_rank
    if args.virtual_pipeline_model_parallel_size == 1:
        args.virtual_pipeline_model_parallel_size = None
    pipeline_split_from_args(args).check()


def _validate_microbatch_group_size(args: argparse.Namespace) -> None:
    """--microbatch-group-size-per-virtual-pipeline-stage: only with virtual stages (the 1F1B
    schedule has no groups), at least the pipeline size (Megatron-Core's interleaved schedule
    refuses smaller groups); default the pipeline size, as ModelParallelConfig's. The checks
    against the micro-batch count are the training flags' (training/flags.py)."""
    group, pp = args.microbatch_group_size_per_vp_stage, args.pipeline_model_parallel_size
    if args.virtual_pipeline_model_parallel_size is None:
        require(group is None,
                f"{GROUP_SIZE_FLAG} groups the micro-batches of the interleaved schedule, and "
                f"this run has no virtual pipeline stages; add "
                f"--num-virtual-stages-per-pipeline-rank or remove {GROUP_SIZE_FLAG}")
        return
    if group is None:
        args.microbatch_group_size_per_vp_stage = pp
        return
    require(group >= pp,
            f"{GROUP_SIZE_FLAG} {group} is below --pipeline-model-parallel-size {pp}: the "
            f"interleaved schedule runs groups of at least the pipeline size; give {pp} or more")


def validate_parallel_args(args: argparse.Namespace) -> None:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    require(tp >= 1 and pp >= 1, "--tensor-model-parallel-size and --pipeline-model-parallel-size "
                                 "must be at least 1")
    args.world_size = _world_size()
    args.rank = int(os.environ.get("RANK", "0"))
    require(args.world_size % (tp * pp) == 0,
            f"world size {args.world_size} is not a multiple of tensor ({tp}) x pipeline ({pp}) "
            f"parallel sizes; launch a multiple of {tp * pp} processes or change the sizes")
    args.data_parallel_size = args.world_size // (tp * pp)

    _derive_pipeline_split(args)
    if args.virtual_pipeline_model_parallel_size is not None:
        require(pp > 1, "virtual pipeline stages need --pipeline-model-parallel-size > 1")
    _validate_microbatch_group_size(args)

    require(args.num_attention_heads % tp == 0,
            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}")
    require(args.ffn_hidden_size % tp == 0,
            f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by "
            f"--tensor-model-parallel-size {tp}")
    if tp == 1:
        # Megatron-LM semantics: sequence parallelism is meaningless without tensor parallelism.
        args.sequence_parallel = False

    cuda = cuda_available()
    te_layers = core_attention_from_args(args).module == TRANSFORMER_ENGINE  # megatron_dpp.kernels
    require(te_layers or not args.sequence_parallel,
            "--sequence-parallel needs Transformer Engine layers on a GPU (Megatron-Core's local "
            "LayerNorm does not support it); remove it or install transformer-engine")
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if cuda else "gloo"
    require(cuda or args.distributed_backend != "nccl",
            "--distributed-backend nccl needs CUDA GPUs; use gloo (the default on CPU)")
    require(cuda or args.empty_unused_memory_level == 0,
            "--empty-unused-memory-level is GPU only; remove it on CPU")
    require(args.distributed_timeout_minutes > 0, "--distributed-timeout-minutes must be positive")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    require(args.local_rank is None or args.local_rank == local_rank,
            f"--local-rank {args.local_rank} is not this rank's LOCAL_RANK {local_rank} (its "
            f"device's); remove --local-rank and let the launcher set LOCAL_RANK")
    require(args.use_distributed_optimizer or not args.ddp_pad_buckets_for_high_nccl_busbw,
            "--ddp-pad-buckets-for-high-nccl-busbw pads the distributed optimizer's buckets; add "
            "--use-distributed-optimizer or remove it")
    require(args.context_parallel_size == 1,
            f"--context-parallel-size {args.context_parallel_size}: only 1 runs here (context "
            f"parallelism needs Transformer Engine's attention and data split along the sequence "
            f"per rank, which this runtime does not have)")
    _validate_distribute_saved_activations(args, cuda)
    _validate_overlap_args(args)
    _derive_activation_bytes(args)


def _activation_config(args: argparse.Namespace) -> argparse.Namespace:
    """The TransformerConfig fields models/memory_model.py's chunk_activation_bytes reads, from the
    validated flags: the runtime passes it the TransformerConfig models/transformer_config.py
    builds from the same flags (tests/test_args_validation.py holds the two to the same bytes)."""
    dtype = "torch.bfloat16" if args.bf16 else "torch.float16" if args.fp16 else "torch.float32"
    full = args.recompute_granularity == "full"
    return argparse.Namespace(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        num_query_groups=getattr(args, "num_query_groups", None),
        kv_channels=getattr(args, "kv_channels", None),
        normalization=getattr(args, "normalization", None) or "LayerNorm",
        gated_linear_unit=bool(getattr(args, "swiglu", False)),
        squared_relu=bool(getattr(args, "squared_relu", False)),
        add_bias_linear=getattr(args, "add_bias_linear", None) is not False,
        add_qkv_bias=getattr(args, "add_qkv_bias", None),
        qk_layernorm=bool(getattr(args, "qk_layernorm", False)),
        position_embedding_type=getattr(args, "position_embedding_type", None),
        rotary_percent=getattr(args, "rotary_percent", None),
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        sequence_parallel=args.sequence_parallel, pipeline_dtype=dtype, params_dtype=dtype,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method if full else None,
        recompute_num_layers=args.recompute_num_layers if full else None,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        pipeline_model_parallel_layout=args.pipeline_layout)


def _derive_activation_bytes(args: argparse.Namespace) -> None:
    """args.largest_microbatch_activation_bytes: what one full-length microbatch (--seq-length x
    --micro-batch-size) keeps on one model chunk until its backward, as the DPP runtime counts it
    (pipeline/budget.py's largest_microbatch_bytes over the model's chunk_activation_bytes, the
    same call runtime/executor.py makes): runtime/flags.py checks --dpp-memory-budget against it.
    None until --micro-batch-size is valid (training/flags.py refuses it otherwise)."""
    from functools import partial

    from megatron_dpp.models.memory_model import chunk_activation_bytes
    from megatron_dpp.pipeline.budget import largest_microbatch_bytes

    args.largest_microbatch_activation_bytes = None
    if not (isinstance(args.micro_batch_size, int) and args.micro_batch_size > 0):
        return
    args.largest_microbatch_activation_bytes = largest_microbatch_bytes(
        partial(chunk_activation_bytes, args.model), _activation_config(args), args.seq_length,
        args.micro_batch_size, args.virtual_pipeline_model_parallel_size or 1,
        args.pipeline_model_parallel_size)


def _validate_distribute_saved_activations(args: argparse.Namespace, cuda: bool) -> None:
    """--distribute-saved-activations, with Megatron-LM's conditions and Megatron-Core's."""
    if not args.distribute_saved_activations:
        return
    require(args.recompute_granularity == "full",
            "--distribute-saved-activations splits what full recomputation saves; add "
            "--recompute-granularity full --recompute-method M --recompute-num-layers N")
    require(args.tensor_model_parallel_size > 1,
            "--distribute-saved-activations splits across tensor-parallel ranks; set "
            "--tensor-model-parallel-size 2 or more")
    require(not args.sequence_parallel,
            "--distribute-saved-activations does not go with --sequence-parallel (Megatron-Core "
            "refuses the pair: sequence parallelism already splits those activations); drop one")
    require(cuda, "--distribute-saved-activations needs CUDA GPUs (Megatron-Core gathers the split "
                  "activations into CUDA buffers); remove it on CPU")


def _validate_overlap_args(args: argparse.Namespace) -> None:
    """The data-parallel and pipeline overlap flags (Megatron-LM's rules; they reach the DDP
    config in training/config.py and the schedules' sync functions in training/setup.py)."""
    if args.overlap_param_gather:
        require(args.use_distributed_optimizer,
                "--overlap-param-gather overlaps the distributed optimizer's parameter all-gather; "
                "add --use-distributed-optimizer")
        require(args.overlap_grad_reduce,
                "--overlap-param-gather needs --overlap-grad-reduce (as in Megatron-LM); add it")
    given = first_given((("--ddp-bucket-size", args.ddp_bucket_size is not None),
                         ("--ddp-num-buckets", args.ddp_num_buckets is not None)))
    if given is not None:
        require(args.ddp_bucket_size is None or args.ddp_num_buckets is None,
                "give --ddp-bucket-size or --ddp-num-buckets, not both (as in Megatron-LM)")
        require(args.overlap_grad_reduce,
                f"{given} sizes the buckets --overlap-grad-reduce reduces one by one; without it "
                f"the gradients are reduced as one bucket: add --overlap-grad-reduce or remove "
                f"{given}")
        require((args.ddp_bucket_size or args.ddp_num_buckets) > 0, f"{given} must be positive")
    if args.delay_param_gather:
        require(args.overlap_param_gather,
                "--delay-param-gather aligns the all-gathers of --overlap-param-gather; add "
                "--overlap-param-gather or drop --delay-param-gather")
        require(args.virtual_pipeline_model_parallel_size is not None or args.use_dpp,
                "--delay-param-gather is launched by the interleaved schedule or the DPP runtime "
                "(Megatron's 1F1B ignores it); add virtual pipeline stages or --use-dpp")
    if args.use_dpp:
        require(args.overlap_p2p_comm,
                "--no-overlap-p2p-communication applies to Megatron's interleaved schedule; the "
                "DPP runtime (--use-dpp) always overlaps its messages; drop one of them")
        require(args.delay_grad_reduce or not (args.overlap_grad_reduce and args.dpp_split_backward),
                "--dpp-split-backward with --overlap-grad-reduce starts each chunk's reductions "
                "in chunk order through the schedule (grad_sync_func), which "
                "--no-delay-grad-reduce turns off; drop --no-delay-grad-reduce")
