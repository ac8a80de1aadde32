"""Megatron-LM style command-line flags and their validation.

One `add_<group>_args(parser)` function per flag group and one `validate_<group>_args(args)` beside it.
Validation runs before any process group exists: a bad combination raises `ArgsError` with one line
that says what is wrong and how to fix it; `parse_args` prints that line and exits with code 2.

Names and semantics follow Megatron-LM (`--help` lists them). The parsed result is a plain
argparse Namespace; `megatron_dpp.training.config` turns it into config dataclasses.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Callable, Optional, Sequence

import torch

from megatron_dpp.kernels import (
    ATTENTION_BACKENDS,
    TRANSFORMER_ENGINE,
    TRANSFORMER_ENGINE_BACKENDS,
    core_attention_from_args,
    install_warning_filters,
    transformer_engine_available,
)
from megatron_dpp.data.tokenizer import GPT2_BPE
from megatron_dpp.models import families
from megatron_dpp.one_line_errors import InputError, OneLineErrorParser


class ArgsError(ValueError):
    """A bad flag or flag combination; the message is one line that says how to fix it."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ArgsError(message)


# ----------------------------------------------------------------------------------------------
# Megatron-LM flags that cannot apply here. Each is still a flag, in its group, so that --help
# explains it and using it is refused with the reason (validate_refused_args), not "unrecognized".
# ----------------------------------------------------------------------------------------------
_TP_COMM_OVERLAP = ("Transformer Engine's userbuffer overlap of tensor-parallel communication with "
                    "GEMMs, which this runtime does not set up (Megatron-LM's initialize_ub step)")
_NSYS_OPTION = ("is an option of `nsys profile` (Megatron-LM's --profile help shows it on the nsys "
                "command line), not of training; give it to nsys")
# nsys options that Megatron-LM's --profile help shows.
NSYS_OPTIONS = ("--force-overwrite", "--capture-range", "--capture-range-end")
# flag -> why it cannot apply here (the error is "FLAG REASON; remove it").
REFUSED_FLAGS: dict[str, str] = {
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
    "--tp-comm-overlap": f"needs {_TP_COMM_OVERLAP}",
    "--tp-comm-overlap-cfg": f"configures --tp-comm-overlap, {_TP_COMM_OVERLAP}",
    **{flag: f"tunes --tp-comm-overlap, {_TP_COMM_OVERLAP}"
       for flag in ("--disable-tp-comm-split-ag", "--disable-tp-comm-split-rs",
                    "--disable-tp-comm-bulk-dgrad", "--disable-tp-comm-bulk-wgrad")},
    **{flag: _NSYS_OPTION for flag in NSYS_OPTIONS},
}


def _refused_dest(flag: str) -> str:
    return "refused_" + flag.lstrip("-").replace("-", "_")


def _add_refused_flag(group, flag: str, takes_value: bool = False) -> None:
    """`flag` from REFUSED_FLAGS; `takes_value`: Megatron-LM's (or nsys's) flag takes a value,
    which is optional here so that the refusal, not argparse, explains the problem."""
    extra = {"nargs": "?", "const": "", "metavar": "VALUE"} if takes_value else \
        {"action": "store_const", "const": True}
    group.add_argument(flag, dest=_refused_dest(flag), default=None,
                       help=f"Refused here: {flag} {REFUSED_FLAGS[flag]}.", **extra)


def validate_refused_args(args: argparse.Namespace) -> None:
    """The first REFUSED_FLAGS flag given: one line with its reason."""
    for flag, reason in REFUSED_FLAGS.items():
        _require(getattr(args, _refused_dest(flag)) is None, f"{flag} {reason}; remove it")


# ----------------------------------------------------------------------------------------------
# model shape
# ----------------------------------------------------------------------------------------------
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
    group.add_argument("--no-clone-scatter-output-in-embedding", action="store_false",
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
    group.add_argument("--use-mcore-models", action="store_true",
                       help="Accepted as in Megatron-LM: the models here are always Megatron-Core's "
                            "(GPTModel, BertModel); there are no legacy models to choose instead.")


def validate_model_args(args: argparse.Namespace) -> None:
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        value = getattr(args, flag)
        _require(value is not None and value > 0,
                 f"--{flag.replace('_', '-')} is required and must be positive")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    _require(args.hidden_size % args.num_attention_heads == 0,
             f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
             f"{args.num_attention_heads}; pick a head count that divides the hidden size")
    _require(args.seq_length <= args.max_position_embeddings,
             f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
             f"{args.max_position_embeddings}; raise --max-position-embeddings")
    for flag in ("hidden_dropout", "attention_dropout"):
        value = getattr(args, flag)
        _require(0.0 <= value < 1.0, f"--{flag.replace('_', '-')} must be in [0, 1), got {value}")

    if args.recompute_activations:
        args.recompute_granularity = "selective"
    if args.recompute_granularity == "full":
        _require(args.recompute_method is not None and args.recompute_num_layers is not None,
                 "--recompute-granularity full needs --recompute-method {uniform,block} and "
                 "--recompute-num-layers N")
        _require(args.recompute_num_layers > 0, "--recompute-num-layers must be positive")
    else:
        _require(args.recompute_method is None and args.recompute_num_layers is None,
                 "--recompute-method and --recompute-num-layers need --recompute-granularity full")

    if args.use_flash_attn:
        # Without flash-attn (or Transformer Engine) it runs torch SDPA and says so at startup.
        _require(torch.cuda.is_available(),
                 "--use-flash-attn needs a CUDA GPU; remove it to use the default attention on CPU")
        _require(args.attention_backend in ("auto", "flash"),
                 f"--use-flash-attn asks for flash attention and --attention-backend "
                 f"{args.attention_backend} for another; drop one of them")
    if args.attention_backend in TRANSFORMER_ENGINE_BACKENDS:
        _require(transformer_engine_available(),
                 f"--attention-backend {args.attention_backend} is Transformer Engine's attention "
                 f"and needs Transformer Engine on a CUDA GPU; use auto, sdpa or local")


# ----------------------------------------------------------------------------------------------
# parallel layout and distributed runtime
# ----------------------------------------------------------------------------------------------
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
    group.add_argument("--sequence-parallel", action="store_true",
                       help="Enable sequence parallelism (only has an effect with tensor parallelism, "
                            "as in Megatron-LM).")
    group.add_argument("--use-distributed-optimizer", action="store_true",
                       help="Shard optimizer state across data-parallel ranks.")
    group.add_argument("--overlap-grad-reduce", action="store_true",
                       help="Overlap the data-parallel gradient reduction with backward.")
    group.add_argument("--distributed-backend", type=str, default=None, choices=["nccl", "gloo"],
                       help="torch.distributed backend (default: nccl with CUDA, gloo without).")
    group.add_argument("--distributed-timeout-minutes", type=int, default=10,
                       help="Timeout for collective operations, in minutes.")
    group.add_argument("--use-cpu-initialization", action="store_true",
                       help="Initialize parameters on the CPU (then move them to the device).")
    group.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                       help="Call torch.cuda.empty_cache() each iteration: 0 off, 1 after the "
                            "forward-backward, 2 also after the optimizer step. GPU only.")
    group.add_argument("--context-parallel-size", type=int, default=1,
                       help="Degree of context parallelism. Only 1 runs here: context parallelism "
                            "needs Transformer Engine's attention and a data path that gives each "
                            "context-parallel rank its part of every sequence, which this runtime "
                            "does not have.")
    group.add_argument("--no-delay-grad-reduce", action="store_false", dest="delay_grad_reduce",
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
                       help="Accepted as in Megatron-LM: pipeline messages are always whole tensors "
                            "here (Megatron-Core 0.16 no longer has the scatter/gather split of "
                            "pipeline tensors across tensor-parallel ranks).")
    _add_refused_flag(group, "--pipeline-model-parallel-split-rank", takes_value=True)
    _add_refused_flag(group, "--use-ring-exchange-p2p")
    _add_refused_flag(group, "--no-async-tensor-model-parallel-allreduce")
    _add_refused_flag(group, "--tp-comm-overlap")
    _add_refused_flag(group, "--tp-comm-overlap-cfg", takes_value=True)
    for flag in ("--disable-tp-comm-split-ag", "--disable-tp-comm-split-rs",
                 "--disable-tp-comm-bulk-dgrad", "--disable-tp-comm-bulk-wgrad"):
        _add_refused_flag(group, flag)


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def validate_parallel_args(args: argparse.Namespace) -> None:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    _require(tp >= 1 and pp >= 1, "--tensor-model-parallel-size and --pipeline-model-parallel-size "
                                  "must be at least 1")
    args.world_size = _world_size()
    args.rank = int(os.environ.get("RANK", "0"))
    _require(args.world_size % (tp * pp) == 0,
             f"world size {args.world_size} is not a multiple of tensor ({tp}) x pipeline ({pp}) "
             f"parallel sizes; launch a multiple of {tp * pp} processes or change the sizes")
    args.data_parallel_size = args.world_size // (tp * pp)

    _require(args.num_layers % pp == 0,
             f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size "
             f"{pp}; use a multiple of {pp} layers")
    layers_per_rank = args.num_layers // pp
    _require(args.num_layers_per_virtual_pipeline_stage is None
             or args.num_virtual_stages_per_pipeline_rank is None,
             "give either --num-layers-per-virtual-pipeline-stage or "
             "--num-virtual-stages-per-pipeline-rank, not both")
    args.virtual_pipeline_model_parallel_size = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = args.num_layers_per_virtual_pipeline_stage
        _require(per_stage > 0 and layers_per_rank % per_stage == 0,
                 f"--num-layers {args.num_layers} is not divisible by pipeline ({pp}) x layers per "
                 f"virtual stage ({per_stage}); pick a --num-layers-per-virtual-pipeline-stage that "
                 f"divides {layers_per_rank}")
        args.virtual_pipeline_model_parallel_size = layers_per_rank // per_stage
    elif args.num_virtual_stages_per_pipeline_rank is not None:
        vpp = args.num_virtual_stages_per_pipeline_rank
        _require(vpp > 0 and layers_per_rank % vpp == 0,
                 f"--num-layers {args.num_layers} is not divisible by pipeline ({pp}) x virtual "
                 f"stages ({vpp}); use a multiple of {pp * vpp} layers")
        args.virtual_pipeline_model_parallel_size = vpp
    if args.virtual_pipeline_model_parallel_size == 1:
        args.virtual_pipeline_model_parallel_size = None
    if args.virtual_pipeline_model_parallel_size is not None:
        _require(pp > 1, "virtual pipeline stages need --pipeline-model-parallel-size > 1")

    _require(args.num_attention_heads % tp == 0,
             f"--num-attention-heads {args.num_attention_heads} is not divisible by "
             f"--tensor-model-parallel-size {tp}")
    _require(args.ffn_hidden_size % tp == 0,
             f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by "
             f"--tensor-model-parallel-size {tp}")
    if tp == 1:
        # Megatron-LM semantics: sequence parallelism is meaningless without tensor parallelism.
        args.sequence_parallel = False

    cuda = torch.cuda.is_available()
    _require(cuda or not args.use_distributed_optimizer,
             "--use-distributed-optimizer needs CUDA GPUs (Megatron-Core's distributed optimizer "
             "wraps CUDA tensors only); remove it on CPU")
    te_layers = core_attention_from_args(args).module == TRANSFORMER_ENGINE  # megatron_dpp.kernels
    _require(te_layers or not args.sequence_parallel,
             "--sequence-parallel needs Transformer Engine layers on a GPU (Megatron-Core's local "
             "LayerNorm does not support it); remove it or install transformer-engine")
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if cuda else "gloo"
    _require(cuda or args.distributed_backend != "nccl",
             "--distributed-backend nccl needs CUDA GPUs; use gloo (the default on CPU)")
    _require(cuda or args.empty_unused_memory_level == 0,
             "--empty-unused-memory-level is GPU only; remove it on CPU")
    _require(args.distributed_timeout_minutes > 0, "--distributed-timeout-minutes must be positive")
    _require(args.context_parallel_size == 1,
             f"--context-parallel-size {args.context_parallel_size}: only 1 runs here (context "
             f"parallelism needs Transformer Engine's attention and data split along the sequence "
             f"per rank, which this runtime does not have)")
    _validate_distribute_saved_activations(args, cuda)
    _validate_overlap_args(args)


def _validate_distribute_saved_activations(args: argparse.Namespace, cuda: bool) -> None:
    """--distribute-saved-activations, with Megatron-LM's conditions and Megatron-Core's."""
    if not args.distribute_saved_activations:
        return
    _require(args.recompute_granularity == "full",
             "--distribute-saved-activations splits what full recomputation saves; add "
             "--recompute-granularity full --recompute-method M --recompute-num-layers N")
    _require(args.tensor_model_parallel_size > 1,
             "--distribute-saved-activations splits across tensor-parallel ranks; set "
             "--tensor-model-parallel-size 2 or more")
    _require(not args.sequence_parallel,
             "--distribute-saved-activations does not go with --sequence-parallel (Megatron-Core "
             "refuses the pair: sequence parallelism already splits those activations); drop one")
    _require(cuda, "--distribute-saved-activations needs CUDA GPUs (Megatron-Core gathers the split "
                   "activations into CUDA buffers); remove it on CPU")


def _validate_overlap_args(args: argparse.Namespace) -> None:
    """The data-parallel and pipeline overlap flags (Megatron-LM's rules; they reach the DDP
    config in training/config.py and the schedules' sync functions in training/loop.py)."""
    if args.overlap_param_gather:
        _require(args.use_distributed_optimizer,
                 "--overlap-param-gather overlaps the distributed optimizer's parameter all-gather; "
                 "add --use-distributed-optimizer")
        _require(args.overlap_grad_reduce,
                 "--overlap-param-gather needs --overlap-grad-reduce (as in Megatron-LM); add it")
    if args.delay_param_gather:
        _require(args.overlap_param_gather,
                 "--delay-param-gather aligns the all-gathers of --overlap-param-gather; add "
                 "--overlap-param-gather or drop --delay-param-gather")
        _require(args.virtual_pipeline_model_parallel_size is not None or args.use_dpp,
                 "--delay-param-gather is launched by the interleaved schedule or the DPP runtime "
                 "(Megatron's 1F1B ignores it); add virtual pipeline stages or --use-dpp")
    if args.use_dpp:
        _require(args.overlap_p2p_comm,
                 "--no-overlap-p2p-communication applies to Megatron's interleaved schedule; the "
                 "DPP runtime (--use-dpp) always overlaps its messages; drop one of them")
        _require(args.delay_grad_reduce or not (args.overlap_grad_reduce and args.dpp_split_backward),
                 "--dpp-split-backward with --overlap-grad-reduce starts each chunk's reductions "
                 "in chunk order through the schedule (grad_sync_func), which "
                 "--no-delay-grad-reduce turns off; drop --no-delay-grad-reduce")


# ----------------------------------------------------------------------------------------------
# multi-node (the node list and its checks live in megatron_dpp.comm.nodes)
# ----------------------------------------------------------------------------------------------
def add_multinode_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multi-node")
    group.add_argument("--multi-node", action="store_true",
                       help="The job spans several nodes (torchrun --nnodes N): each node checks at "
                            "startup that its --node-ips address is one of its own and points gloo "
                            "and NCCL at that interface (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, "
                            "unless already set). Needs --node-ips.")
    group.add_argument("--node-ips", type=str, default=None, metavar="IP[,IP...]",
                       help="With --multi-node: the address of each node, InfiniBand or Ethernet, "
                            "IPv4 or IPv6, comma-separated in node-rank order (torchrun's "
                            "--node-rank), exactly one per node (torchrun's --nnodes).")


def validate_multinode_args(args: argparse.Namespace) -> None:
    from megatron_dpp.comm.nodes import check_node_count, num_nodes, parse_node_ips

    if not args.multi_node:
        _require(args.node_ips is None, "--node-ips needs --multi-node; add it, or drop --node-ips "
                                        "on one node")
        return
    _require(args.node_ips is not None, "--multi-node needs --node-ips IP[,IP...], the address of "
                                        "each node in node-rank order")
    text = args.node_ips
    try:
        args.node_ips = parse_node_ips(text)
    except ValueError as error:
        raise ArgsError(f"--node-ips {text}: {error}") from None
    try:
        node_count = num_nodes()
    except ValueError as error:
        raise ArgsError(f"--multi-node: {error}") from None
    try:
        check_node_count(args.node_ips, node_count)
    except ValueError as error:
        raise ArgsError(f"--node-ips {text}: {error}") from None


# ----------------------------------------------------------------------------------------------
# optimization, batch, precision
# ----------------------------------------------------------------------------------------------
def add_training_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("training")
    group.add_argument("--micro-batch-size", type=int, default=None,
                       help="Samples per micro-batch on one data-parallel rank.")
    group.add_argument("--global-batch-size", type=int, default=None,
                       help="Samples per optimizer step across all data-parallel ranks "
                            "(default: micro-batch size x data-parallel size).")
    group.add_argument("--train-iters", type=int, default=None, help="Optimizer steps to train.")
    group.add_argument("--lr", type=float, default=None, help="Peak learning rate.")
    group.add_argument("--min-lr", type=float, default=0.0, help="Learning rate floor of the decay.")
    group.add_argument("--lr-decay-style", type=str, default="linear",
                       choices=["constant", "linear", "cosine", "inverse-square-root"],
                       help="Learning rate decay function.")
    group.add_argument("--lr-decay-iters", type=int, default=None,
                       help="Iterations to decay over (default: --train-iters).")
    group.add_argument("--lr-warmup-iters", type=int, default=0,
                       help="Iterations of linear warmup from 0 to --lr.")
    group.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay.")
    group.add_argument("--clip-grad", type=float, default=1.0,
                       help="Clip gradients to this global L2 norm (0 disables clipping).")
    group.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    group.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    group.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon.")
    group.add_argument("--seed", type=int, default=1234, help="Random seed.")
    group.add_argument("--bf16", action="store_true", help="bfloat16 mixed precision (GPU only).")
    group.add_argument("--fp16", action="store_true",
                       help="float16 mixed precision with dynamic loss scaling (GPU only).")
    group.add_argument("--manual-gc", action="store_true",
                       help="Disable Python's automatic garbage collector and collect every "
                            "--manual-gc-interval iterations, aligned across ranks.")
    group.add_argument("--manual-gc-interval", type=int, default=0,
                       help="Iterations between manual collections (0: only around evaluation).")
    group.add_argument("--no-manual-gc-eval", action="store_false", dest="manual_gc_eval",
                       help="With --manual-gc: do not collect at the start and the end of each "
                            "evaluation (without --manual-gc Python's collector runs as usual).")


def validate_training_args(args: argparse.Namespace) -> None:
    _require(args.micro_batch_size is not None and args.micro_batch_size > 0,
             "--micro-batch-size is required and must be positive")
    _require(args.train_iters is not None and args.train_iters > 0,
             "--train-iters is required and must be positive")
    _require(args.lr is not None and args.lr >= 0, "--lr is required and must be >= 0")
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    _require(args.global_batch_size > 0 and args.global_batch_size % per_step == 0,
             f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
             f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size}; use a "
             f"multiple of {per_step}")
    args.num_microbatches = args.global_batch_size // per_step
    _require(0 <= args.min_lr <= args.lr, f"--min-lr {args.min_lr} must be in [0, --lr]")
    _require(args.lr_warmup_iters >= 0, "--lr-warmup-iters must be >= 0")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    _require(args.lr_decay_iters > args.lr_warmup_iters,
             f"--lr-decay-iters {args.lr_decay_iters} must exceed --lr-warmup-iters "
             f"{args.lr_warmup_iters}")
    _require(args.clip_grad >= 0, "--clip-grad must be >= 0")
    _require(not (args.bf16 and args.fp16), "--bf16 and --fp16 are exclusive; pick one")
    cuda = torch.cuda.is_available()
    if args.bf16 or args.fp16:
        _require(cuda, f"--{'bf16' if args.bf16 else 'fp16'} needs a CUDA GPU; on CPU train in "
                       f"fp32 (remove the flag)")
    _require(args.manual_gc_interval >= 0, "--manual-gc-interval must be >= 0")
    _require(args.manual_gc or args.manual_gc_interval == 0,
             "--manual-gc-interval needs --manual-gc")
    if args.virtual_pipeline_model_parallel_size is not None:
        pp = args.pipeline_model_parallel_size
        _require(args.num_microbatches % pp == 0,
                 f"the interleaved schedule needs the number of micro-batches "
                 f"({args.num_microbatches}) to be a multiple of --pipeline-model-parallel-size "
                 f"{pp}; adjust --global-batch-size")


# ----------------------------------------------------------------------------------------------
# checkpoints
# ----------------------------------------------------------------------------------------------
def add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("checkpointing")
    group.add_argument("--save", type=str, default=None, help="Directory to save checkpoints to.")
    group.add_argument("--load", type=str, default=None,
                       help="Directory to resume from (its latest checkpoint).")
    group.add_argument("--save-interval", type=int, default=None,
                       help="Save a checkpoint every this many iterations (needs --save).")


def validate_checkpoint_args(args: argparse.Namespace) -> None:
    if args.save_interval is not None:
        _require(args.save_interval > 0, "--save-interval must be positive")
        _require(args.save is not None, "--save-interval needs --save DIR")
    if args.load is not None:
        _require(os.path.isdir(args.load),
                 f"--load {args.load}: no such directory; point it at a --save directory")


# ----------------------------------------------------------------------------------------------
# logging and evaluation
# ----------------------------------------------------------------------------------------------
def add_logging_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("logging and evaluation")
    group.add_argument("--log-interval", type=int, default=100,
                       help="Print an iteration line every this many iterations.")
    group.add_argument("--eval-interval", type=int, default=1000,
                       help="Evaluate on the validation set every this many iterations.")
    group.add_argument("--eval-iters", type=int, default=100,
                       help="Batches per evaluation (0 disables evaluation).")


def validate_logging_args(args: argparse.Namespace) -> None:
    _require(args.log_interval > 0, "--log-interval must be positive")
    _require(args.eval_interval > 0, "--eval-interval must be positive")
    _require(args.eval_iters >= 0, "--eval-iters must be >= 0")


# ----------------------------------------------------------------------------------------------
# data (flags and validation owned by the data module)
# ----------------------------------------------------------------------------------------------
# The tokenizers some model trains with; each model's own are in models/families.py.
TOKENIZER_TYPES = families.TOKENIZER_TYPES


def add_data_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data")
    group.add_argument("--data-path", nargs="*", default=None,
                       help="Indexed dataset prefix (PREFIX for PREFIX.bin/.idx), or a blend "
                            "`W1 PREFIX1 W2 PREFIX2 ...`. `python -m megatron_dpp.data.prepare_sample "
                            "--output-dir data` makes data/sample_text_document.")
    group.add_argument("--split", type=str, default="969, 30, 1",
                       help="Train, validation and test weights of the documents, e.g. 969,30,1.")
    group.add_argument("--data-cache-path", type=str, default=None,
                       help="Where dataset index caches go (default: beside the data).")
    group.add_argument("--tokenizer-type", type=str, default=None, choices=TOKENIZER_TYPES,
                       help="GPT2BPETokenizer (GPT's, and its default: byte-level BPE, needs "
                            "--vocab-file vocab.json and --merge-file) or BertWordPieceLowerCase / "
                            "BertWordPieceCase (BERT's, lower-case the default: WordPiece, needs "
                            "--vocab-file vocab.txt).")
    group.add_argument("--vocab-file", type=str, default=None,
                       help="The tokenizer's vocabulary: BPE vocab.json (GPT) or WordPiece vocab.txt "
                            "(BERT).")
    group.add_argument("--merge-file", type=str, default=None,
                       help="Path to the BPE merges.txt (GPT2BPETokenizer only).")
    group.add_argument("--variable-seq-lengths", action="store_true",
                       help="Micro-batches of different lengths. GPT: one document per sample, "
                            "truncated to --seq-length, padded to the longest within a "
                            "micro-batch. BERT: each micro-batch cut to its longest sample "
                            "(BERT's padding is masked, so the losses are unchanged).")
    group.add_argument("--reset-position-ids", action="store_true",
                       help="Restart position ids after each end-of-document token.")
    group.add_argument("--reset-attention-mask", action="store_true",
                       help="Block attention across end-of-document tokens (makes the data loader "
                            "build an explicit attention mask).")
    group.add_argument("--eod-mask-loss", action="store_true",
                       help="Exclude end-of-document tokens from the loss.")
    group.add_argument("--num-workers", type=int, default=0,
                       help="Data loader worker processes (0: load in the training process).")


def validate_data_args(args: argparse.Namespace) -> None:
    # Imported here: the data package pulls in megatron.core only when a check needs it.
    from megatron_dpp.data.datasets import (check_splits_have_data, dataset_files_missing,
                                            parse_data_path, parse_split, samples_per_split)
    from megatron_dpp.data.errors import DataInputError

    _require(args.data_path, "--data-path is required; make the sample data with `python -m "
                             "megatron_dpp.data.prepare_sample --output-dir data` and pass "
                             "--data-path data/sample_text_document")
    try:
        prefixes, weights = parse_data_path(args.data_path)
        for prefix in prefixes:
            missing = dataset_files_missing(prefix)
            _require(not missing, f"--data-path {prefix}: {' and '.join(missing)} not found; make "
                                  f"it with tools/preprocess_data.py or `python -m "
                                  f"megatron_dpp.data.prepare_sample --output-dir DIR`")
        tokenizer_files = [("--vocab-file", args.vocab_file)]
        if args.tokenizer_type == GPT2_BPE:
            tokenizer_files.append(("--merge-file", args.merge_file))
        for flag, path in tokenizer_files:
            _require(path is not None and os.path.isfile(path),
                     f"{flag} {path} not found; pass the file made with the data (`python -m "
                     f"megatron_dpp.data.prepare_sample --output-dir DIR` writes GPT's and BERT's)")
        split = parse_split(args.split)
        _require(args.num_workers >= 0, "--num-workers must be >= 0")
        if args.variable_seq_lengths:
            _require(not (args.reset_position_ids or args.reset_attention_mask),
                     "--variable-seq-lengths puts one document per sample, so --reset-position-ids "
                     "and --reset-attention-mask do not apply; remove them")
        # Each model builds its samples its own way (token windows, packed sentences).
        families.model_family(args.model).check_data(args, prefixes, weights, split,
                                                     samples_per_split(args))
    except DataInputError as error:
        raise ArgsError(str(error)) from None


# ----------------------------------------------------------------------------------------------
# point-to-point transports (owned by the transport module)
# ----------------------------------------------------------------------------------------------
def add_transport_args(parser: argparse.ArgumentParser) -> None:
    from megatron_dpp.comm.router import DEFAULT_TRANSPORT_KIND, TRANSPORT_KINDS
    from megatron_dpp.comm.settings import SHM_DEFAULTS
    from megatron_dpp.comm.transport import DEFAULT_TIMEOUT_S

    group = parser.add_argument_group("transport")
    group.add_argument("--p2p-transport", type=str, default=DEFAULT_TRANSPORT_KIND,
                       choices=TRANSPORT_KINDS,
                       help="Pipeline point-to-point transport. auto (default): shm_tensor between "
                            "ranks of one node (shared memory; CUDA IPC for GPU tensors), rdma_tensor "
                            "between nodes (UCX: InfiniBand/RoCE or TCP), torch.distributed only where "
                            "neither can run; each rank logs the route every peer got and why. shm: "
                            "shm_tensor on the node, torch.distributed across nodes. rdma: rdma_tensor "
                            "for every peer. torch: torch.distributed send/recv for every peer.")
    group.add_argument("--workload", type=int, default=SHM_DEFAULTS.bytes_per_thread,
                       help="shm: bytes each copy thread handles; a message gets one thread per this "
                            "many bytes, up to --shm-copy-threads (smaller messages are copied inline).")
    group.add_argument("--shm-copy-threads", type=int, default=SHM_DEFAULTS.copy_threads,
                       help="shm: most threads that copy one message.")
    group.add_argument("--shm-slot-mb", type=int, default=SHM_DEFAULTS.slot_bytes >> 20,
                       help="shm: payload MiB of one slot; every CPU pipeline message must fit in "
                            "one (GPU messages need only a descriptor there, unless torch's "
                            "expandable segments stop CUDA IPC from exporting their memory).")
    group.add_argument("--shm-num-slots", type=int, default=SHM_DEFAULTS.num_slots,
                       help="shm: slots per directed pair of ranks, 1..64 (messages in flight before a "
                            "send waits for the receiver; up to half of them may be lent to received "
                            "tensors, see --shm-zero-copy-min-kb).")
    group.add_argument("--shm-zero-copy-min-kb", type=int, default=SHM_DEFAULTS.zero_copy_min_bytes >> 10,
                       help="shm: a received CPU message of at least this many KiB borrows the slot it "
                            "arrived in (no copy out) while fewer than half the slots from that sender "
                            "are lent; 0 copies every message out.")
    group.add_argument("--p2p-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                       help="Seconds a pipeline send or receive may wait before failing with the peer "
                            "and tag it waited for.")


def validate_transport_args(args: argparse.Namespace) -> None:
    from megatron_dpp.comm.settings import check_shm_args, largest_message_bytes

    _require(args.p2p_timeout > 0, f"--p2p-timeout must be positive seconds, got {args.p2p_timeout}")
    if args.p2p_transport == "rdma":
        import rdma_tensor

        problem = rdma_tensor.unavailable_reason()
        _require(not problem, f"--p2p-transport rdma: {problem}")
    if args.p2p_transport not in ("shm", "auto"):
        return
    # Flag units first (MiB, KiB), then the transport's own checks of the values they set.
    _require(args.shm_slot_mb >= 1, "--shm-slot-mb must be at least 1")
    _require(args.shm_zero_copy_min_kb >= 0,
             f"--shm-zero-copy-min-kb must be >= 0 (0 turns zero-copy receive off), got {args.shm_zero_copy_min_kb}")
    try:
        check_shm_args(args)
    except ValueError as error:
        raise ArgsError(str(error)) from None
    if args.p2p_transport == "auto":
        return  # auto falls back to torch.distributed where shm_tensor cannot run, and logs why
    _require(importlib.util.find_spec("shm_tensor._C") is not None,
             "--p2p-transport shm needs the compiled shm_tensor._C; run "
             "`pip install --no-build-isolation -e .` in the repository")
    if torch.cuda.is_available():
        # GPU tensors travel by CUDA IPC, which needs libcudart loadable by shm_tensor.
        import shm_tensor

        cuda_problem = shm_tensor.cuda_runtime_error()
        _require(not cuda_problem,
                 "--p2p-transport shm on a CUDA machine needs the CUDA runtime, which did not load ("
                 + cuda_problem.replace("\n", " ") + "); use --p2p-transport torch")
    # One activation (seq x micro-batch x hidden, fp32 at most) must fit in one slot.
    needed = largest_message_bytes(args)
    if needed is not None:
        _require(needed <= args.shm_slot_mb << 20,
                 f"--shm-slot-mb {args.shm_slot_mb} is too small for one activation of {needed} B "
                 f"(seq x micro-batch x hidden x 4); raise --shm-slot-mb to "
                 f"{-(-needed // (1 << 20))}")


# ----------------------------------------------------------------------------------------------
# dynamic pipeline parallelism (owned by the DPP runtime)
# ----------------------------------------------------------------------------------------------
def add_dpp_args(parser: argparse.ArgumentParser) -> None:
    from megatron_dpp.pipeline import AUTO_BUDGET, DEFAULT_POLICY, PROVISIONED_BUDGET, SCHEDULE_NAMES
    from megatron_dpp.runtime.config import DPPConfig

    group = parser.add_argument_group("dynamic pipeline parallelism")
    group.add_argument("--use-dpp", action="store_true",
                       help="Run the pipeline with the dynamic scheduler (forward_backward_dpp) instead "
                            "of Megatron's fixed 1F1B / interleaved order.")
    group.add_argument("--dpp-policy", type=str, default=DEFAULT_POLICY, choices=SCHEDULE_NAMES,
                       help="Scheduling policy of --use-dpp (the static orders run through the same "
                            "runtime, for comparison).")
    group.add_argument("--dpp-memory-budget", type=str, default=AUTO_BUDGET,
                       help=f"Activation bytes a pipeline rank may hold, counted for full-length "
                            f"microbatches. '{AUTO_BUDGET}' (default): as many microbatches as Megatron's "
                            "1F1B (interleaved for virtual stages) holds at most on that rank. "
                            f"'{PROVISIONED_BUDGET}': as many as it holds on its fullest rank, the "
                            "first (P under 1F1B; 2(P-1)+(V-1)*G+1 chunk activations interleaved, "
                            "G the group size, default P), on every rank: the devices of a pipeline "
                            "have the same memory, so the later ranks' headroom is free and a "
                            "policy may run further ahead there; use it when the first rank's "
                            "memory is what you provision anyway. Or a byte count such as "
                            "2147483648 or 2GiB, on every rank. With --dpp-split-backward each "
                            "microbatch also counts what its W keeps from B to W.")
    group.add_argument("--dpp-timeout", type=float, default=DPPConfig.timeout_s,
                       help="Seconds without progress after which every DPP rank prints its state "
                            "(ready tasks, awaited tags, memory held) and the job exits non-zero.")
    group.add_argument("--dpp-split-backward", action="store_true",
                       help="Split every backward of --use-dpp into B (the input gradient, sent "
                            "upstream at once) and W (the weight gradients, run later by the "
                            "policy). The model is built from Megatron-Core's local layers with "
                            "deferrable weight gradients; a microbatch's W keeps its layer inputs "
                            "and output gradients until it runs, which the memory budget counts. "
                            "Not with Transformer Engine layers, --sequence-parallel or "
                            "--attention-backend flash/fused/unfused (core attention is "
                            "--attention-backend's sdpa or local, or --use-flash-attn's flash-attn).")


def validate_dpp_args(args: argparse.Namespace) -> None:
    from megatron_dpp.pipeline import check_policy_layout, parse_memory_budget

    try:
        args.dpp_memory_budget_bytes = parse_memory_budget(args.dpp_memory_budget,
                                                           what="--dpp-memory-budget")
    except ValueError as error:
        raise ArgsError(str(error)) from None
    _require(args.dpp_timeout > 0, f"--dpp-timeout must be positive seconds, got {args.dpp_timeout}")
    if not args.use_dpp:
        _require(not getattr(args, "dpp_split_backward", False),
                 "--dpp-split-backward splits the backward of the DPP runtime; add --use-dpp or "
                 "drop --dpp-split-backward")
        return
    _require(args.pipeline_model_parallel_size >= 2,
             "--use-dpp schedules a pipeline; set --pipeline-model-parallel-size 2 or more, or drop "
             "--use-dpp")
    try:
        check_policy_layout(args.dpp_policy, args.virtual_pipeline_model_parallel_size or 1)
    except ValueError as error:
        raise ArgsError(f"--dpp-policy {error}") from None
    _validate_split_backward(args)


def _validate_split_backward(args: argparse.Namespace) -> None:
    """--dpp-split-backward (with --use-dpp; checked above): what the deferred layers (megatron_dpp.models.weight_grad) cover.
    Transformer Engine needs no check: with the flag the model is built from Megatron-Core's local
    layers even where Transformer Engine is installed (with our SDPA or flash-attn core attention
    on a GPU, megatron_dpp.kernels); gradient-accumulation fusion, RMSNorm and
    multi-token prediction have no flag here (always off)."""
    if not getattr(args, "dpp_split_backward", False):
        return
    _require(not args.sequence_parallel,
             "--dpp-split-backward does not support --sequence-parallel (deferred weight gradients "
             "cover Megatron-Core's local layers without it); drop one of them")
    _require(args.attention_backend not in TRANSFORMER_ENGINE_BACKENDS,
             f"--dpp-split-backward builds Megatron-Core's local layers, not Transformer Engine's "
             f"attention; drop --attention-backend {args.attention_backend} or "
             f"--dpp-split-backward")


# ----------------------------------------------------------------------------------------------
# tracing
# ----------------------------------------------------------------------------------------------
def add_trace_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tracing")
    group.add_argument("--trace", action="store_true",
                       help="Record what every pipeline rank did (each task, each wait and its reason, "
                            "each message; with --use-dpp also the activation bytes held) as one "
                            "Chrome trace per rank, on rank 0's clock: "
                            "TRACE_DIR/<run>/benchmark-rank<R>.json, written when training ends. "
                            "Records the DPP runtime with --use-dpp, else Megatron's own 1F1B or "
                            "interleaved schedule (run over --p2p-transport, torch included).")
    group.add_argument("--trace-dir", type=str, default="benchmark",
                       help="Directory that gets one sub-directory per traced or profiled run (--trace, "
                            "--profile --use-pytorch-profiler), named by its start "
                            "time, layout and schedule (e.g. 20261124-153000-pp2-dpp, "
                            "20261124-153000-pp2-vpp2-interleaved).")


def validate_trace_args(args: argparse.Namespace) -> None:
    if not args.trace:
        return
    _require(args.pipeline_model_parallel_size >= 2,
             "--trace records a pipeline schedule; set --pipeline-model-parallel-size 2 or more, or "
             "drop --trace")
    _check_trace_dir(args.trace_dir)


def _check_trace_dir(trace_dir: str) -> None:
    """--trace-dir, where --trace and --profile write: a directory, or one that can be made."""
    _require(not os.path.exists(trace_dir) or os.path.isdir(trace_dir),
             f"--trace-dir {trace_dir} exists and is not a directory; pick another path")
    # Made with its missing parents (os.makedirs): the nearest existing ancestor must take it.
    ancestor = os.path.dirname(os.path.abspath(trace_dir))
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    _require(os.path.isdir(trace_dir) or (os.path.isdir(ancestor) and os.access(ancestor, os.W_OK)),
             f"--trace-dir {trace_dir}: cannot create it in {ancestor}; pick a writable path")


# ----------------------------------------------------------------------------------------------
# profiling (Megatron-LM's --profile flags; training/profiler_window.py)
# ----------------------------------------------------------------------------------------------
PROFILE_STEP_START, PROFILE_STEP_END, PROFILE_RANKS = 10, 12, [0]


def add_profile_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("profiling")
    group.add_argument("--profile", action="store_true",
                       help="As in Megatron-LM: on each rank of --profile-ranks, open an nsys capture "
                            "range (torch.cuda.cudart().cudaProfilerStart()) when iteration "
                            "--profile-step-start starts and close it (cudaProfilerStop()) before "
                            "iteration --profile-step-end, for `nsys profile "
                            "--capture-range=cudaProfilerApi --capture-range-end=stop ...` around "
                            "the training command; needs a CUDA GPU. With --use-pytorch-profiler: "
                            "torch.profiler over the same iterations instead.")
    group.add_argument("--use-pytorch-profiler", action="store_true",
                       help="With --profile, as in Megatron-LM: torch.profiler instead of the nsys "
                            "capture range (CPU activities; CUDA too on a GPU; with shapes), which "
                            "writes TRACE_DIR/<run>/profile-rank<R>.json (a Chrome trace) on each "
                            "rank of --profile-ranks when the window closes. Works on CPU.")
    group.add_argument("--profile-step-start", type=int, default=None,
                       help=f"With --profile: the first profiled iteration, counted as Megatron-LM "
                            f"does (iterations completed before it; default {PROFILE_STEP_START}, "
                            f"i.e. the one logged as iteration {PROFILE_STEP_START + 1}).")
    group.add_argument("--profile-step-end", type=int, default=None,
                       help=f"With --profile: profiling stops before this iteration (default "
                            f"{PROFILE_STEP_END}); at most --train-iters.")
    group.add_argument("--profile-ranks", type=int, nargs="+", default=None, metavar="RANK",
                       help=f"With --profile: the global ranks that profile (default "
                            f"{' '.join(map(str, PROFILE_RANKS))}).")
    for flag in NSYS_OPTIONS:
        _add_refused_flag(group, flag, takes_value=True)
    group.add_argument("--nvtx", action="store_true",
                       help="On a CUDA GPU: an NVTX range around each pipeline task, named like the "
                            "task (F3.0, B3.0, W3.0), for nsys or Nsight: around each task the DPP "
                            "runtime runs with --use-dpp, else around each forward and backward step "
                            "of Megatron's own 1F1B or interleaved schedule (pipeline size 2 or "
                            "more); and a range around each iteration's gradient sync and optimizer "
                            "step.")


def validate_profile_args(args: argparse.Namespace) -> None:
    window = {"--profile-step-start": args.profile_step_start,
              "--profile-step-end": args.profile_step_end, "--profile-ranks": args.profile_ranks,
              "--use-pytorch-profiler": args.use_pytorch_profiler or None}
    if not args.profile:
        given = [flag for flag, value in window.items() if value is not None]
        _require(not given, f"{' and '.join(given)} need --profile; add it or drop them")
    else:
        _require(args.use_pytorch_profiler or torch.cuda.is_available(),
                 "--profile opens an nsys capture range (cudaProfilerStart/Stop), which needs a "
                 "CUDA GPU and there is none here; add --use-pytorch-profiler for torch.profiler")
        if args.profile_step_start is None:
            args.profile_step_start = PROFILE_STEP_START
        if args.profile_step_end is None:
            args.profile_step_end = PROFILE_STEP_END
        if args.profile_ranks is None:
            args.profile_ranks = list(PROFILE_RANKS)
        start, end = args.profile_step_start, args.profile_step_end
        _require(0 <= start < end, f"--profile-step-start {start} must be >= 0 and below "
                                   f"--profile-step-end {end}")
        _require(end <= args.train_iters,
                 f"--profile-step-end {end} is past --train-iters {args.train_iters}; lower it (the "
                 f"profiled iterations are [--profile-step-start, --profile-step-end))")
        outside = [rank for rank in args.profile_ranks if not 0 <= rank < args.world_size]
        _require(not outside, f"--profile-ranks {' '.join(map(str, outside))}: not a rank of a "
                              f"world of {args.world_size} (0..{args.world_size - 1})")
        args.profile_ranks = sorted(set(args.profile_ranks))
        if args.use_pytorch_profiler:  # the nsys capture range writes nothing itself
            _check_trace_dir(args.trace_dir)
    if args.nvtx:
        _require(torch.cuda.is_available(),
                 "--nvtx annotates CUDA work for nsys and there is no CUDA GPU here; drop --nvtx "
                 "(--trace and --profile --use-pytorch-profiler work on CPU)")
        _require(args.use_dpp or args.pipeline_model_parallel_size >= 2,
                 "--nvtx names pipeline tasks; set --pipeline-model-parallel-size 2 or more (or "
                 "--use-dpp), or drop --nvtx")


# ----------------------------------------------------------------------------------------------
# entry points
# ----------------------------------------------------------------------------------------------
ARG_GROUPS: list[Callable[[argparse.ArgumentParser], None]] = [
    add_model_args,
    add_parallel_args,
    add_multinode_args,
    add_training_args,
    add_checkpoint_args,
    add_logging_args,
    add_data_args,
    add_transport_args,
    add_dpp_args,
    add_trace_args,
    add_profile_args,
]

# Order matters: later validators read values the earlier ones derive (world and data-parallel
# sizes, ffn size, number of micro-batches).
VALIDATORS: list[Callable[[argparse.Namespace], None]] = [
    validate_model_args,
    validate_parallel_args,
    validate_multinode_args,
    validate_training_args,
    validate_checkpoint_args,
    validate_logging_args,
    validate_data_args,
    validate_transport_args,
    validate_dpp_args,
    validate_trace_args,
    validate_profile_args,
]


DEFAULT_DESCRIPTION = "Megatron-Core pretraining with dynamic pipeline parallelism."


def _add_model_choice(parser: argparse.ArgumentParser, model: Optional[str]) -> None:
    """`--model` on the one entry point (megatron_dpp.pretrain); an alias (pretrain_gpt) fixes the
    model instead. model: the value already read from the command line (None: not yet)."""
    parser.add_argument(
        "--model", choices=sorted(families.MODEL_FAMILIES), required=model is None, default=model,
        help="The model to train (its own flags are listed with --model NAME --help): "
             + "; ".join(f.summary for f in families.MODEL_FAMILIES.values()) + ".")


def _model_from_argv(argv: Sequence[str], prog: str) -> Optional[str]:
    """The --model value of the one entry point's command line, read before the full parser is
    built (the model's own flag group depends on it); None when absent."""
    finder = OneLineErrorParser(prog=prog, add_help=False, allow_abbrev=False)
    finder.add_argument("--model", choices=sorted(families.MODEL_FAMILIES))
    known, _ = finder.parse_known_args(argv)
    return known.model


def build_parser(prog: str = "megatron_dpp", description: str = DEFAULT_DESCRIPTION,
                 model: Optional[str] = families.DEFAULT_MODEL, model_flag: bool = False) -> argparse.ArgumentParser:
    """Every shared flag group and the model's own; `prog`, `description` and `model` are the
    entry point's. model_flag: the parser takes --model (the one entry point, megatron_dpp.pretrain;
    model is then the value read from the command line, or None when it has none: no model's own
    flags are listed). args.model is the model's name."""
    if model is not None:
        _require(model in families.MODEL_FAMILIES,
                 f"unknown model {model!r}; one of {sorted(families.MODEL_FAMILIES)}")
    parser = OneLineErrorParser(prog=prog, allow_abbrev=False, description=description)
    if model_flag:
        _add_model_choice(parser, model)
    for add_group in ARG_GROUPS:
        add_group(parser)
    if model is not None:
        families.MODEL_FAMILIES[model].add_args(parser)
        parser.set_defaults(model=model)
    return parser


def _validate_model_args(args: argparse.Namespace) -> None:
    try:
        families.model_family(args.model).validate(args)
    except InputError as error:
        raise ArgsError(str(error)) from None


def validate_args(args: argparse.Namespace) -> None:
    """Check and complete `args` in place; raises ArgsError. Creates no process group. The model's
    checks run before the shared ones (the data checks need the model's tokenizer default)."""
    for validate in [validate_refused_args, _validate_model_args, *VALIDATORS]:
        validate(args)


def parse_args(argv: Optional[Sequence[str]] = None, prog: str = "megatron_dpp",
               description: str = DEFAULT_DESCRIPTION,
               model: Optional[str] = families.DEFAULT_MODEL) -> argparse.Namespace:
    """Parse and validate; on a bad flag print one line to stderr and exit with code 2. model None:
    the command line names it with --model (megatron_dpp.pretrain)."""
    # Megatron-Core warns on import when Transformer Engine and Apex are absent (always on CPU) and
    # falls back to torch; the `kernels:` startup lines say so instead, and the warning would also
    # break the one-line error of a flag checked after the data validator imports Megatron.
    install_warning_filters()
    argv = list(sys.argv[1:] if argv is None else argv)
    model_flag = model is None
    if model_flag:
        model = _model_from_argv(argv, prog)
    parser = build_parser(prog, description, model, model_flag=model_flag)
    args = parser.parse_args(argv)
    try:
        validate_args(args)
    except ArgsError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    return args


if __name__ == "__main__":
    # `WORLD_SIZE=N python -m megatron_dpp.arguments [MODEL] <flags>`: validate only (exit 0, or 2
    # with the one-line error), e.g. before a launcher starts N processes. The model (default
    # families.DEFAULT_MODEL) is a bare word: flags start with "--".
    argv = sys.argv[1:]
    model = argv.pop(0) if argv and argv[0] in families.MODEL_FAMILIES else families.DEFAULT_MODEL
    parse_args(argv, model=model)
