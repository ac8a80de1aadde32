"""Llama on Megatron-Core: GPTModel with Llama's configuration and layer spec.

Llama (Touvron et al. 2023, "Llama 2") is GPT's decoder with RMSNorm, a SwiGLU MLP, rotary
position embeddings, grouped-query attention (--num-query-groups), no biases and an output layer
of its own. Megatron-Core builds all of it from TransformerConfig fields (`llama_config_fields`)
and GPTModel's arguments; the data, forward step, loss, micro-batch work and layout-independent
init are GPT's (models/gpt.py). LLAMA_SPEC is the ModelSpec the training loop, the runtime and
the platform use.
"""
from __future__ import annotations

import argparse
from functools import partial
from typing import Optional

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_dpp import kernels
from megatron_dpp.data.datasets import build_train_valid_test_datasets
from megatron_dpp.models import families
from megatron_dpp.models.gpt import (
    GPT_SPEC,
    gpt_global_parameter_name,
    gpt_microbatch_work,
    gpt_sample_model_inputs,
    make_gpt_forward_step,
)
from megatron_dpp.models.init import build_model_chunks
from megatron_dpp.models.memory_model import chunk_activation_bytes
from megatron_dpp.models.direct_layer import with_direct_classes
from megatron_dpp.models.sdpa_attention import with_core_attention
from megatron_dpp.models.spec import ModelSpec


def llama_config_fields(args: argparse.Namespace) -> dict:
    """Llama's TransformerConfig fields on top of the shared ones (models/transformer_config.py)."""
    return {
        "normalization": "RMSNorm",
        "gated_linear_unit": True,  # SwiGLU: fc1 is one linear of twice the width, gate and up
        "activation_func": torch.nn.functional.silu,
        "add_bias_linear": False,
        "num_query_groups": args.num_query_groups or args.num_attention_heads,
    }


def llama_layer_spec(attention: Optional[str] = None) -> ModuleSpec:
    """Transformer Engine's layers where megatron_dpp.kernels chose its attention (their norms
    read config.normalization), else Megatron-Core's local layers with RMSNorm and the chosen
    core attention; None: this machine's default (kernels.core_attention())."""
    attention = attention or kernels.core_attention().module
    if attention == kernels.TRANSFORMER_ENGINE:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec()
    return with_direct_classes(
        with_core_attention(get_gpt_layer_local_spec(normalization="RMSNorm"), attention))


def build_llama_chunks(args: argparse.Namespace, config: TransformerConfig,
                       seed: int) -> list[GPTModel]:
    """This pipeline rank's chunks, one per virtual stage, initialized layout-free (GPT's init).
    --dpp-split-backward: DeferredGPTModel over the local spec, whose norms become our
    deferrable RMSNorm (models/weight_grad)."""
    deferred = getattr(args, "dpp_split_backward", False)
    spec = llama_layer_spec(kernels.core_attention_from_args(args).module)
    model_class = GPTModel
    if deferred:
        from megatron_dpp.models.weight_grad import DeferredGPTModel

        model_class = DeferredGPTModel
    return build_model_chunks(
        model_class, spec, config, seed, gpt_global_parameter_name,
        vocab_size=args.padded_vocab_size,  # set by build_tokenizer
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=False,  # Llama's output layer is its own
        position_embedding_type="rope",
        rotary_base=args.rotary_base,
        # Llama 3.1's frequency scaling (--use-rope-scaling; families.py checks the factor).
        rope_scaling=bool(getattr(args, "use_rope_scaling", False)),
        rope_scaling_factor=(getattr(args, "rope_scaling_factor", None)
                             or families.DEFAULT_ROPE_SCALING_FACTOR))


def _llama_sample_layer_inputs(shape, batch: int) -> dict:
    """The layer spec's causal mask (as GPT's) and the rotary angles GPTModel hands its layers."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rotary = RotaryEmbedding(kv_channels=shape.hidden_size // shape.num_attention_heads,
                             rotary_percent=1.0, rotary_base=shape.rotary_base,
                             use_cpu_initialization=not torch.cuda.is_available())
    return {"attention_mask": None, "rotary_pos_emb": rotary(shape.seq_length)}


LLAMA_SPEC = ModelSpec(
    family=families.LLAMA,
    build_chunks=build_llama_chunks,
    make_forward_step=make_gpt_forward_step,
    microbatch_work=gpt_microbatch_work,
    build_datasets=build_train_valid_test_datasets,
    # GPT's, and the rotary embedding, whose buffers go to torch.cuda.current_device().
    cpu_patched_modules=GPT_SPEC.cpu_patched_modules + (
        "megatron.core.models.common.embeddings.rotary_pos_embedding",
    ),
    global_parameter_name=gpt_global_parameter_name,
    activation_bytes=partial(chunk_activation_bytes, "llama"),
    layer_spec=llama_layer_spec,
    config_fields=llama_config_fields,
    transformer_layers=lambda model: model.decoder.layers,
    sample_layer_inputs=_llama_sample_layer_inputs,
    sample_model_inputs=gpt_sample_model_inputs,
)
