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


def weight_grad_bytes_per_token(model, dtype: torch.dtype) -> int:
    """Bytes per token that a split backward's stash (models.weight_grad) adds to a microbatch of
    one model chunk, held from its B to its W, beyond the activations counted above.

    Per deferred module: its output gradient dY (a column-parallel linear's output per partition,
    a row-parallel linear's full output, a norm's or embedding's width), plus a layer norm's mean
    and rstd (fp32). Their inputs X are the activations counted by transformer_activation_bytes
    (a fused backward frees them at B, a split one at W, which the scheduler's accounting already
    follows), except outside the transformer layers: the final norm's and the output layer's
    inputs (one hidden vector each) and the embeddings' token ids (int64). On the last stage the
    output layer's dY, the logits gradient (vocab / tp values per token), dominates."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megatron_dpp.models.weight_grad import (
        DeferredEmbedding,
        DeferredLayerNorm,
        DeferredVocabParallelEmbedding,
    )

    element = torch.empty((), dtype=dtype).element_size()
    total = 0
    for name, module in model.named_modules():
        in_layers = ".layers." in f".{name}."
        if isinstance(module, ColumnParallelLinear):
            total += module.output_size_per_partition * element
            if not in_layers:
                total += module.input_size * element
        elif isinstance(module, RowParallelLinear):
            total += module.output_size * element
            if not in_layers:
                total += module.input_size_per_partition * element
        elif isinstance(module, DeferredLayerNorm):
            width = int(torch.Size(module.normalized_shape).numel())
            total += width * element + 2 * 4
            if not in_layers:
                total += width * element
        elif isinstance(module, (DeferredVocabParallelEmbedding, DeferredEmbedding)):
            total += module.embedding_dim * element + 8
    return total


def megatron_weight_grad_bytes(models, sizes: Sequence[int], dtype: torch.dtype) -> List[int]:
    """Stash bytes per microbatch (sizes are token counts) on the rank's heaviest chunk: one
    number per microbatch serves every chunk of the rank, so the rank's budget stays an upper
    bound (exact for V=1; with V>1 the first and last stage's chunk sets it)."""
    per_token = max(weight_grad_bytes_per_token(model, dtype) for model in models)
    return [int(tokens) * per_token for tokens in sizes]
