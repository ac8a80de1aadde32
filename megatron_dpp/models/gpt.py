"""GPT on Megatron-Core: layer spec choice, model chunks per pipeline rank, forward step and loss.

GPT_SPEC is the ModelSpec the training loop, the runtime and the platform use.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_dpp import kernels
from megatron_dpp.data.datasets import build_train_valid_test_datasets
from megatron_dpp.mcore.direct_layer import with_direct_classes
from megatron_dpp.models.init import build_model_chunks, stacked_model_global_name, stage_placement
from megatron_dpp.models.memory_model import (causal_attention_work_per_token_pair,
                                              chunk_activation_bytes, config_layer_shape)
from megatron_dpp.models.sdpa_attention import with_core_attention
from megatron_dpp.models import families
from megatron_dpp.models.spec import ModelSpec
from megatron_dpp.pipeline.placement import INTERLEAVED
from megatron_dpp.pipeline.work import segments_work


@dataclass(frozen=True)
class GPTShape:
    """What GPTModel needs beyond TransformerConfig (the layer spec's choices among them)."""

    padded_vocab_size: int  # Megatron-LM's padding: a multiple of divisible-by x tp size
    max_position_embeddings: int
    untie_embeddings_and_output_weights: bool
    position_embedding_type: str = "learned_absolute"  # or "rope"
    rotary_percent: float = 1.0
    rotary_base: int = 10000
    rope_scaling: bool = False  # Llama 3.1's rotary frequency scaling (--use-rope-scaling)
    rope_scaling_factor: float = families.DEFAULT_ROPE_SCALING_FACTOR
    normalization: str = "LayerNorm"  # the layer spec's norms (Megatron-LM's --normalization)
    qk_layernorm: bool = False


def gpt_layer_spec(attention: Optional[str] = None, normalization: str = "LayerNorm",
                   qk_layernorm: bool = False) -> ModuleSpec:
    """Transformer Engine's layers where megatron_dpp.kernels chose its attention, else
    Megatron-Core's local layers with the chosen core attention (kernels.SDPA, FLASH_ATTN, LOCAL);
    None: this machine's default (kernels.core_attention()). normalization and qk_layernorm:
    Megatron-LM's --normalization and --qk-layernorm, as its gpt_builders passes them."""
    attention = attention or kernels.core_attention().module
    if attention == kernels.TRANSFORMER_ENGINE:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    return with_direct_classes(with_core_attention(
        get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization=normalization),
        attention))


def gpt_layer_spec_options(args: argparse.Namespace) -> dict:
    """gpt_layer_spec's keyword arguments of the (validated) flags."""
    return {"normalization": args.normalization, "qk_layernorm": bool(args.qk_layernorm)}


def architecture_config_fields(args: argparse.Namespace) -> dict:
    """The TransformerConfig fields of Megatron-LM's architecture flags (validated: families.py
    has resolved each), as its core_transformer_config_from_args sets them."""
    from megatron.core.activations import squared_relu

    fields = {"normalization": args.normalization, "add_bias_linear": bool(args.add_bias_linear),
              "add_qkv_bias": bool(args.add_qkv_bias),
              "qk_layernorm": bool(args.qk_layernorm), "kv_channels": args.kv_channels,
              "apply_query_key_layer_scaling": bool(args.apply_query_key_layer_scaling),
              "num_query_groups": args.num_query_groups or args.num_attention_heads}
    if args.swiglu:  # fc1 is one linear of twice the width: gate and up
        fields.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu)
    elif args.squared_relu:
        fields["activation_func"] = squared_relu
    return fields


def build_gpt_chunks(config: TransformerConfig, shape: GPTShape, seed: int,
                     deferred_weight_grads: bool = False,
                     attention: Optional[str] = None,
                     placement: str = INTERLEAVED) -> list[GPTModel]:
    """The model chunks of this pipeline rank (one per virtual stage), initialized layout-free;
    attention: the core attention megatron_dpp.kernels chose (None: this machine's default);
    placement: which stage each chunk is (--dpp-stage-placement, models/init.py).

    deferred_weight_grads (--dpp-split-backward): DeferredGPTModel over Megatron-Core's local
    layer spec (never Transformer Engine's; kernels chooses no Transformer Engine attention with
    it), whose weight gradients a split backward defers to W; the same parameters,
    initialization and numbers as the default chunks (core attention has no weights)."""
    model_class = GPTModel
    spec = gpt_layer_spec(attention or
                          kernels.core_attention(split_backward=deferred_weight_grads).module,
                          normalization=shape.normalization, qk_layernorm=shape.qk_layernorm)
    if deferred_weight_grads:
        from megatron_dpp.models.weight_grad import DeferredGPTModel

        model_class = DeferredGPTModel
    rotary = {}
    if shape.position_embedding_type == "rope":
        rotary = {"rotary_percent": shape.rotary_percent, "rotary_base": shape.rotary_base,
                  "rope_scaling": shape.rope_scaling,
                  "rope_scaling_factor": shape.rope_scaling_factor}
    return build_model_chunks(
        model_class, spec, config, seed, gpt_global_parameter_name, placement=placement,
        vocab_size=shape.padded_vocab_size,
        max_sequence_length=shape.max_position_embeddings,
        share_embeddings_and_output_weights=not shape.untie_embeddings_and_output_weights,
        position_embedding_type=shape.position_embedding_type, **rotary)


def gpt_shape_from_args(args: argparse.Namespace) -> GPTShape:
    """GPTModel's arguments of the (validated) flags; padded_vocab_size is build_tokenizer's."""
    return GPTShape(padded_vocab_size=args.padded_vocab_size,
                    max_position_embeddings=args.max_position_embeddings,
                    untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type,
                    rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
                    rope_scaling=bool(getattr(args, "use_rope_scaling", False)),
                    rope_scaling_factor=(getattr(args, "rope_scaling_factor", None)
                                         or families.DEFAULT_ROPE_SCALING_FACTOR),
                    normalization=args.normalization, qk_layernorm=bool(args.qk_layernorm))


def build_chunks_from_args(args: argparse.Namespace, config: TransformerConfig,
                           seed: int) -> list[GPTModel]:
    """The chunks of GPT and of the models that are GPT with a preset of its flags (Llama)."""
    return build_gpt_chunks(config, gpt_shape_from_args(args), seed,
                            deferred_weight_grads=getattr(args, "dpp_split_backward", False),
                            attention=kernels.core_attention_from_args(args).module,
                            placement=stage_placement(args))


_LAYERS_PREFIX = "decoder.layers."


def gpt_global_parameter_name(model: GPTModel, local_name: str) -> str:
    """Map a chunk-local parameter name to its name in the unsplit model."""
    return stacked_model_global_name(model.decoder.layers, _LAYERS_PREFIX,
                                     model.share_embeddings_and_output_weights, local_name)


# ----------------------------------------------------------------------------------------------
# forward step and loss (called by Megatron's schedules and the DPP runtime once per micro-batch)
# ----------------------------------------------------------------------------------------------
def gpt_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron-LM's 3-tuple form: (summed loss, token count, {"lm loss": [sum, count]})."""
    losses = output_tensor.float()
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses.view(-1) * mask)
    num_tokens = mask.sum().to(torch.int)
    # The schedule divides the returned loss in place: report a detached copy.
    report = torch.cat([loss_sum.detach().clone().view(1), num_tokens.detach().float().view(1)])
    return loss_sum, num_tokens, {"lm loss": report}


def packed_seq_params_of(batch: dict, device: torch.device) -> PackedSeqParams:
    """Megatron-Core's THD parameters of a folded micro-batch (data/iterators.py's collate with
    --dataloader-inter-document-masking: one row, its documents ending at "cu_seqlens"): self-
    attention, so the query and key boundaries are the same."""
    cu_seqlens = batch["cu_seqlens"].to(device, dtype=torch.int32, non_blocking=True)
    max_seqlen = int(batch["max_seqlen"])
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)


def gpt_forward_step(data_iterator, model, device: torch.device,
                     inter_document_masking: bool = False):
    """Reads exactly one micro-batch; ranks that need no tokens or labels still consume one (and
    every stage needs the document boundaries with inter_document_masking)."""
    batch = next(data_iterator)
    tokens = batch["tokens"].to(device, non_blocking=True)
    position_ids = batch["position_ids"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True)
    loss_mask = batch["loss_mask"].to(device, non_blocking=True)
    attention_mask = batch.get("attention_mask")
    if attention_mask is not None:
        attention_mask = attention_mask.to(device, non_blocking=True)
    packed = packed_seq_params_of(batch, device) if inter_document_masking else None
    output = model(tokens, position_ids, attention_mask, labels=labels, packed_seq_params=packed)
    return output, partial(gpt_loss, loss_mask)


def make_gpt_forward_step(args: argparse.Namespace, device: torch.device):
    """forward_step_func(data_iterator, model) for Megatron's schedules, tensors moved to device."""
    return partial(gpt_forward_step, device=device, inter_document_masking=bool(
        getattr(args, "dataloader_inter_document_masking", False)))


def gpt_microbatch_tokens(item: Any) -> int:
    """Tokens of one microbatch (tokens.numel()); 1 without tokens. What its activation bytes
    count (SDPA's and flash attention's memory grows with the tokens, not their squares)."""
    if isinstance(item, dict):
        tokens = item.get("tokens")
        if isinstance(tokens, torch.Tensor):
            return int(tokens.numel())
        return 1
    if isinstance(item, torch.Tensor):
        return int(item.numel())
    return 1


def segment_lengths(item: Any) -> list[int]:
    """The lengths of the attention's segments in one microbatch: cu_seqlens.diff() where the item
    carries the document boundaries ("cu_seqlens", per sample [b, n+1] or folded into one row
    [n+1], the data contract of packed samples), else one segment per sample row of its tokens."""
    if isinstance(item, dict) and isinstance(item.get("cu_seqlens"), torch.Tensor):
        return [int(s) for s in item["cu_seqlens"].long().diff(dim=-1).flatten().tolist()]
    tokens = item.get("tokens") if isinstance(item, dict) else item
    if not isinstance(tokens, torch.Tensor) or tokens.numel() == 0:
        return []
    if tokens.dim() < 2:
        return [int(tokens.numel())]
    return [int(tokens.shape[-1])] * (tokens.numel() // tokens.shape[-1])


def gpt_microbatch_work(per_token_pair: float, item: Any) -> int:
    """Relative work of one microbatch, in tokens: W + c * sum of s_i^2 over its segments
    (segment_lengths: documents masked apart, or sample rows), W its tokens and c the causal
    attention's FLOPs per token pair over the dense part's per token
    (memory_model.causal_attention_work_per_token_pair; 1/(12h) for GPT's f = 4h). So two packs
    of equal tokens differ: one long document costs more than many short ones. 1 without
    tokens."""
    lengths = segment_lengths(item)
    return max(1, segments_work(lengths, per_token_pair)) if lengths else 1


def make_gpt_microbatch_work(model: str, config: Any) -> Callable[[Any], int]:
    """ModelSpec.microbatch_work of GPT and Llama (`model`): config (a TransformerConfig, or the
    flags' models/flags.py activation_config) -> gpt_microbatch_work with that shape's c."""
    per_token_pair = causal_attention_work_per_token_pair(config_layer_shape(model, config))
    return partial(gpt_microbatch_work, per_token_pair)


# ----------------------------------------------------------------------------------------------
# what the search's profiler feeds a layer and a chunk
# ----------------------------------------------------------------------------------------------
def gpt_sample_layer_inputs(shape: Any, batch: int) -> dict:
    """The layer spec's causal mask (None) and, with rotary embeddings, the angles GPTModel hands
    its layers (models.memory_model.ModelShape)."""
    if shape.position_embedding_type != "rope":
        return {"attention_mask": None}
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rotary = RotaryEmbedding(kv_channels=shape.kv_channels, rotary_percent=shape.rotary_percent,
                             rotary_base=shape.rotary_base,
                             use_cpu_initialization=not torch.cuda.is_available())
    return {"attention_mask": None, "rotary_pos_emb": rotary(shape.seq_length)}


def gpt_sample_model_inputs(shape: Any, batch: int) -> dict:
    """Random tokens as labels too, positions as the GPT dataset gives them, no mask (causal)."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape.padded_vocab_size, (batch, shape.seq_length),
                           generator=generator)
    positions = torch.arange(shape.seq_length).repeat(batch, 1)
    return {"input_ids": tokens, "position_ids": positions, "attention_mask": None,
            "labels": tokens}


GPT_SPEC = ModelSpec(
    family=families.GPT,
    build_chunks=build_chunks_from_args,
    make_forward_step=make_gpt_forward_step,
    microbatch_work=partial(make_gpt_microbatch_work, "gpt"),
    microbatch_tokens=gpt_microbatch_tokens,
    build_datasets=build_train_valid_test_datasets,
    # GPT's own Megatron-Core modules that call torch.cuda; the platform patches them on CPU
    # (the rotary embedding's buffers go to torch.cuda.current_device()).
    cpu_patched_modules=(
        "megatron.core.models.gpt.gpt_model",            # current_device() buffers
        "megatron.core.models.common.embeddings.language_model_embedding",  # current_device()
        "megatron.core.models.common.embeddings.rotary_pos_embedding",
    ),
    global_parameter_name=gpt_global_parameter_name,
    activation_bytes=partial(chunk_activation_bytes, "gpt"),
    layer_spec=gpt_layer_spec,
    layer_spec_options=gpt_layer_spec_options,
    config_fields=architecture_config_fields,
    transformer_layers=lambda model: model.decoder.layers,
    sample_layer_inputs=gpt_sample_layer_inputs,
    sample_model_inputs=gpt_sample_model_inputs,
)
