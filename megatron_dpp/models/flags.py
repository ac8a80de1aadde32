"""The shared model-shape flags (--help's "model" group) and their checks: what becomes
Megatron-Core's TransformerConfig (models/transformer_config.py). Each model's own flags are its
family's (models/families.py); the parallelism group's are parallel/flags.py's;
megatron_dpp.arguments composes them. Also what one micro-batch's activations take on a model
chunk (largest_microbatch_activation_bytes), the DPP flags' memory floor.

Torch-free, as the launcher's flag check is: whether there is a CUDA GPU comes from
megatron_dpp.cuda_presence.
"""
from __future__ import annotations

import argparse
import os
from typing import Optional

from megatron_dpp.cuda_presence import cuda_available
from megatron_dpp.flag_errors import add_refused_flags, add_stated_flags, require
from megatron_dpp.kernels import (
    ATTENTION_BACKENDS,
    TRANSFORMER_ENGINE_BACKENDS,
    cuda_graph_obstacle,
    packed_attention_obstacle,
    transformer_engine_available,
)
from megatron_dpp.models.families import add_architecture_shape_args, add_rope_scaling_args
from megatron_dpp.models import megatron_lm_flags


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
    if getattr(args, "dataloader_inter_document_masking", False):
        obstacle = packed_attention_obstacle(args)
        require(obstacle is None, obstacle or "")
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
    from megatron_dpp.shared_gpu import ranks_per_gpu, shared_gpu_backend

    uses_nccl = shared_gpu_backend(args.distributed_backend, cuda_available(), ranks_per_gpu()) == "nccl"
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


def activation_config(args: argparse.Namespace) -> argparse.Namespace:
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
        sequence_parallel=args.parallel.sequence_parallel, pipeline_dtype=dtype, params_dtype=dtype,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method if full else None,
        recompute_num_layers=args.recompute_num_layers if full else None,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        pipeline_model_parallel_layout=args.parallel.pipeline_layout)


def largest_microbatch_activation_bytes(args: argparse.Namespace) -> Optional[int]:
    """What one full-length microbatch (--seq-length x --micro-batch-size) keeps on one model chunk
    until its backward, as the DPP runtime counts it (pipeline/budget.py's largest_microbatch_bytes
    over the model's chunk_activation_bytes, the same call runtime/executor.py makes): the DPP
    flags' check holds --dpp-memory-budget to it (megatron_dpp.arguments). None until
    --micro-batch-size is valid (training/flags.py refuses it otherwise)."""
    from functools import partial

    from megatron_dpp.models.memory_model import chunk_activation_bytes
    from megatron_dpp.pipeline.budget import largest_microbatch_bytes

    if not (isinstance(args.micro_batch_size, int) and args.micro_batch_size > 0):
        return None
    return largest_microbatch_bytes(
        partial(chunk_activation_bytes, args.model), activation_config(args), args.seq_length,
        args.micro_batch_size, args.parallel.chunks_per_rank, args.pipeline_model_parallel_size)
