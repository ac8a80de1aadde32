"""Activation bytes one forward of a microbatch holds on one model chunk until its backward.

The scheduler admits forwards against a byte budget, so it needs these numbers before the iteration
starts. For a transformer chunk without recomputation, Korthikanti et al. (2022, "Reducing Activation
Recomputation in Large Transformer Models", eq. 1) give per layer s*b*h*(34 + 5*a*s/h) bytes with 16-bit
activations; we scale by the element size of the pipeline dtype. The estimate only has to be consistent
across microbatches for "auto" budgets (the budget is derived from the same numbers); a budget given in
bytes is compared with it directly.
"""
from __future__ import annotations

from typing import List, Sequence

import torch


def transformer_activation_bytes(sizes: Sequence[int], micro_batch_size: int, hidden_size: int,
                                 num_attention_heads: int, layers_per_chunk: int,
                                 dtype: torch.dtype) -> List[int]:
    """Estimated activation bytes per microbatch (sizes are token counts b*s) for one model chunk."""
    element_scale = torch.empty((), dtype=dtype).element_size() / 2.0
    estimates = []
    for tokens in sizes:
        seq = max(1, tokens // max(1, micro_batch_size))
        per_layer = tokens * hidden_size * 34 + 5 * num_attention_heads * micro_batch_size * seq * seq
        estimates.append(max(1, int(per_layer * layers_per_chunk * element_scale)))
    return estimates


def megatron_activation_bytes(config, sizes: Sequence[int], micro_batch_size: int,
                              num_model_chunks: int, pipeline_size: int) -> List[int]:
    """transformer_activation_bytes with the shape read from a Megatron TransformerConfig."""
    num_layers = getattr(config, "num_layers", None) or pipeline_size * num_model_chunks
    layers_per_chunk = max(1, num_layers // (pipeline_size * num_model_chunks))
    hidden = getattr(config, "hidden_size", 1) or 1
    heads = getattr(config, "num_attention_heads", 1) or 1
    dtype = getattr(config, "pipeline_dtype", None) or getattr(config, "params_dtype", None) or torch.float32
    return transformer_activation_bytes(sizes, micro_batch_size, hidden, heads, layers_per_chunk, dtype)
