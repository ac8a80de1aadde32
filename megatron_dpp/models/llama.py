"""Llama on Megatron-Core: GPT with a preset of Megatron-LM's architecture flags.

Llama (Touvron et al. 2023, "Llama 2") is GPT's decoder with RMSNorm, a SwiGLU MLP, rotary
position embeddings, grouped-query attention (--num-query-groups), no biases and an output layer
of its own: `--model gpt` with --normalization RMSNorm --swiglu --position-embedding-type rope
--group-query-attention --disable-bias-linear --untie-embeddings-and-output-weights builds the
same model. --model llama fixes that preset (models/families.py: LLAMA_ARCHITECTURE), which its
checkpoints and its Hugging Face conversion assume, and adds Llama 3.1's rotary scaling. Its
configuration fields, layer spec, chunks, data, forward step and loss are GPT's (models/gpt.py).
LLAMA_SPEC is the ModelSpec the training loop, the runtime and the platform use.
"""
from __future__ import annotations

import argparse
from functools import partial
from typing import Optional

from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_dpp.data.datasets import build_train_valid_test_datasets
from megatron_dpp.models import families
from megatron_dpp.models.gpt import (
    GPT_SPEC,
    architecture_config_fields,
    build_chunks_from_args,
    gpt_global_parameter_name,
    gpt_layer_spec,
    gpt_microbatch_tokens,
    gpt_sample_layer_inputs,
    gpt_sample_model_inputs,
    make_gpt_forward_step,
    make_gpt_microbatch_work,
)
from megatron_dpp.models.memory_model import chunk_activation_bytes
from megatron_dpp.models.spec import ModelSpec

build_llama_chunks = build_chunks_from_args
"""This pipeline rank's chunks, one per virtual stage, initialized layout-free (GPT's builder
with Llama's flags: rotary embeddings, --rotary-base, --use-rope-scaling; --dpp-split-backward:
DeferredGPTModel over the local spec, whose norms become our deferrable RMSNorm)."""


def llama_config_fields(args: argparse.Namespace) -> dict:
    """Llama's TransformerConfig fields on top of the shared ones (models/transformer_config.py):
    GPT's of its architecture flags, which families.py has set to Llama's preset."""
    return architecture_config_fields(args)


def llama_layer_spec(attention: Optional[str] = None) -> ModuleSpec:
    """GPT's layer spec with RMSNorm: Transformer Engine's layers where megatron_dpp.kernels
    chose its attention (their norms read config.normalization), else Megatron-Core's local
    layers with the chosen core attention; None: this machine's default."""
    return gpt_layer_spec(attention, normalization="RMSNorm")


LLAMA_SPEC = ModelSpec(
    family=families.LLAMA,
    build_chunks=build_llama_chunks,
    make_forward_step=make_gpt_forward_step,
    microbatch_work=partial(make_gpt_microbatch_work, "llama"),
    microbatch_tokens=gpt_microbatch_tokens,
    build_datasets=build_train_valid_test_datasets,
    cpu_patched_modules=GPT_SPEC.cpu_patched_modules,  # the rotary embedding's among them
    global_parameter_name=gpt_global_parameter_name,
    activation_bytes=partial(chunk_activation_bytes, "llama"),
    layer_spec=llama_layer_spec,
    config_fields=llama_config_fields,
    transformer_layers=lambda model: model.decoder.layers,
    sample_layer_inputs=gpt_sample_layer_inputs,
    sample_model_inputs=gpt_sample_model_inputs,
)
