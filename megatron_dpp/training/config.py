"""Parsed flags -> config dataclasses (Megatron-Core's and our TrainingConfig).

Every flag the training path uses is read here, so "is this flag wired?" has one place to look.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer import TransformerConfig

from megatron_dpp import kernels


@dataclass(frozen=True)
class TrainingConfig:
    """What the training loop needs beyond Megatron-Core's own configs."""

    train_iters: int
    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int
    seq_length: int
    seed: int
    lr: float
    min_lr: float
    lr_decay_style: str
    lr_decay_iters: int
    lr_warmup_iters: int
    weight_decay: float
    log_interval: int
    eval_interval: int
    eval_iters: int
    save: Optional[str]
    load: Optional[str]
    save_interval: Optional[int]
    manual_gc: bool
    manual_gc_interval: int
    manual_gc_eval: bool  # with manual_gc: collect at the start and end of each evaluation
    empty_unused_memory_level: int
    distributed_timeout_minutes: int


def training_config_from_args(args: argparse.Namespace) -> TrainingConfig:
    return TrainingConfig(
        train_iters=args.train_iters,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        num_microbatches=args.num_microbatches,
        seq_length=args.seq_length,
        seed=args.seed,
        lr=args.lr,
        min_lr=args.min_lr,
        lr_decay_style=args.lr_decay_style,
        lr_decay_iters=args.lr_decay_iters,
        lr_warmup_iters=args.lr_warmup_iters,
        weight_decay=args.weight_decay,
        log_interval=args.log_interval,
        eval_interval=args.eval_interval,
        eval_iters=args.eval_iters,
        save=args.save,
        load=args.load,
        save_interval=args.save_interval,
        manual_gc=args.manual_gc,
        manual_gc_interval=args.manual_gc_interval,
        manual_gc_eval=args.manual_gc_eval,
        empty_unused_memory_level=args.empty_unused_memory_level,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
    )


def params_dtype_from_args(args: argparse.Namespace) -> torch.dtype:
    if args.bf16:
        return torch.bfloat16
    if args.fp16:
        return torch.float16
    return torch.float32


def transformer_config_from_args(args: argparse.Namespace) -> TransformerConfig:
    recompute = {}
    if args.recompute_granularity is not None:
        recompute["recompute_granularity"] = args.recompute_granularity
    if args.recompute_granularity == "full":
        recompute["recompute_method"] = args.recompute_method
        recompute["recompute_num_layers"] = args.recompute_num_layers
    # Every kernel-dependent setting comes from megatron_dpp.kernels (what is installed here).
    choices = kernels.kernel_choices(args)
    attention = {}
    if choices.attention.module == kernels.TRANSFORMER_ENGINE:
        from megatron.core.transformer.enums import AttnBackend

        attention["attention_backend"] = AttnBackend[choices.attention.te_backend]
    dtype = params_dtype_from_args(args)
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        init_method_std=args.init_method_std,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        use_cpu_initialization=args.use_cpu_initialization,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        # Megatron-LM's default: with virtual stages, per-direction p2p ops overlapped with compute
        # instead of one batch (--no-overlap-p2p-communication: per-direction ops, each awaited).
        # A batch pairs messages by order, and with pp=2 both directions go to the same peer, so
        # activations and gradients could be swapped; the unbatched path keeps them apart.
        overlap_p2p_comm=(args.virtual_pipeline_model_parallel_size is not None
                          and args.overlap_p2p_comm),
        batch_p2p_comm=args.virtual_pipeline_model_parallel_size is None,
        variable_seq_lengths=bool(getattr(args, "variable_seq_lengths", False)),
        # TransformerConfig rejects variable_seq_lengths with the default MoE dispatcher
        # ("allgather"); the dispatcher is unused by dense models, so pick one that allows it.
        moe_token_dispatcher_type="alltoall",
        bias_activation_fusion=choices.bias_activation_fusion.on,
        bias_dropout_fusion=choices.bias_dropout_fusion.on,
        masked_softmax_fusion=choices.masked_softmax_fusion.on,
        apply_rope_fusion=choices.rope_fusion.on,
        gradient_accumulation_fusion=choices.gradient_accumulation_fusion.on,
        persist_layer_norm=choices.persist_layer_norm.on,
        clone_scatter_output_in_embedding=args.clone_scatter_output_in_embedding,
        distribute_saved_activations=args.distribute_saved_activations,
        **recompute,
        **attention,
    )


def optimizer_config_from_args(args: argparse.Namespace) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=params_dtype_from_args(args),
        use_distributed_optimizer=args.use_distributed_optimizer,
    )


def ddp_config_from_args(args: argparse.Namespace) -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.bf16 or args.fp16,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        align_param_gather=args.delay_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
