"""Megatron-Core's TransformerConfig from the training flags: the one builder, used by the training
loop (through megatron_dpp.training.config) and by the search's profiler
(megatron_dpp.search.model_measurement, which parses the same flags), so that the profiled layer is
the trained one. tests/test_transformer_config.py holds the two to the same config.

Every kernel-dependent setting comes from megatron_dpp.kernels (what is installed here).
"""
from __future__ import annotations

import argparse

import torch
from megatron.core.transformer import TransformerConfig

from megatron_dpp import kernels


def params_dtype_from_args(args: argparse.Namespace) -> torch.dtype:
    if args.bf16:
        return torch.bfloat16
    if args.fp16:
        return torch.float16
    return torch.float32


def transformer_config_from_args(args: argparse.Namespace) -> TransformerConfig:
    """args: megatron_dpp.arguments' flags, validated, with args.parallel, the layout they imply
    (parallel/layout.py)."""
    layout = args.parallel
    recompute = {}
    if args.recompute_granularity is not None:
        recompute["recompute_granularity"] = args.recompute_granularity
    if args.recompute_granularity == "full":
        recompute["recompute_method"] = args.recompute_method
        recompute["recompute_num_layers"] = args.recompute_num_layers
    choices = kernels.kernel_choices(args)
    attention = {}
    if choices.attention.module == kernels.TRANSFORMER_ENGINE:
        from megatron.core.transformer.enums import AttnBackend

        attention["attention_backend"] = AttnBackend[choices.attention.te_backend]
    dtype = params_dtype_from_args(args)
    from megatron_dpp.models import MODEL_SPECS

    model_fields = MODEL_SPECS[args.model].config_fields(args)  # the model's own (Llama's RMSNorm...)
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        init_method_std=args.init_method_std,
        layernorm_epsilon=args.norm_epsilon,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline_model_parallel_size,
        # None (no virtual stages): ModelParallelConfig's default, the pipeline size.
        microbatch_group_size_per_vp_stage=layout.microbatch_group_size_per_vp_stage,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        pipeline_model_parallel_layout=args.pipeline_model_parallel_layout,  # the string: parsed
        sequence_parallel=layout.sequence_parallel,
        use_cpu_initialization=args.use_cpu_initialization,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        # Megatron-LM's default: with virtual stages, per-direction p2p ops overlapped with compute
        # instead of one batch (--no-overlap-p2p-communication: per-direction ops, each awaited).
        # A batch pairs messages by order, and with pp=2 both directions go to the same peer, so
        # activations and gradients could be swapped; the unbatched path keeps them apart.
        overlap_p2p_comm=(layout.virtual_pipeline_model_parallel_size is not None
                          and args.overlap_p2p_comm),
        batch_p2p_comm=layout.virtual_pipeline_model_parallel_size is None,
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
        cuda_graph_impl="local" if choices.cuda_graphs.on else "none",
        clone_scatter_output_in_embedding=args.clone_scatter_output_in_embedding,
        distribute_saved_activations=args.distribute_saved_activations,
        calculate_per_token_loss=args.calculate_per_token_loss,
        cross_entropy_loss_fusion=choices.cross_entropy_fusion.on,
        cross_entropy_fusion_impl=args.cross_entropy_fusion_impl,
        deterministic_mode=args.deterministic_mode,
        **recompute,
        **attention,
        **model_fields,
    )
    # GPTModel's position arguments, which no TransformerConfig field holds: the activation model
    # (models/memory_model.py's chunk_activation_bytes, the DPP runtime's budget) reads them here.
    config.position_embedding_type = getattr(args, "position_embedding_type", None)
    config.rotary_percent = getattr(args, "rotary_percent", None)
    return config
