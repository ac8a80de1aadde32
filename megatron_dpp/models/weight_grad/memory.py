"""What the stash of a split backward holds per microbatch, estimated before the iteration runs:
the DPP runtime counts it against the activation budget (DPPSession.weight_grad_bytes_fn)."""
from __future__ import annotations

from typing import List, Sequence

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megatron_dpp.models.weight_grad.layers import (
    DeferredEmbedding,
    DeferredLayerNorm,
    DeferredTorchLinear,
    DeferredVocabParallelEmbedding,
)


def weight_grad_bytes_per_token(model, dtype: torch.dtype) -> int:
    """Bytes per token that a split backward's stash adds to a microbatch of
    one model chunk, held from its B to its W, beyond the activations counted above.

    Per deferred module: its output gradient dY (a column-parallel linear's output per partition,
    a row-parallel linear's full output, a norm's or embedding's width), plus a layer norm's mean
    and rstd (fp32). Their inputs X are the activations counted by ModelSpec.activation_bytes
    (a fused backward frees them at B, a split one at W, which the runtime's scheduler already
    follows), except outside the transformer layers: the final norm's and the output layer's
    inputs (one hidden vector each) and the embeddings' token ids (int64). On the last stage the
    output layer's dY, the logits gradient (vocab / tp values per token), dominates."""
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
        elif isinstance(module, DeferredTorchLinear):
            # BERT's heads; the pooler and sentence-order head see one token per sample, counted
            # per token here (an upper bound).
            total += (module.out_features + module.in_features) * element
        elif isinstance(module, (DeferredVocabParallelEmbedding, DeferredEmbedding)):
            total += module.embedding_dim * element + 8
    return total


def megatron_weight_grad_bytes(models, sizes: Sequence[int], dtype: torch.dtype) -> List[int]:
    """Stash bytes per microbatch (sizes are token counts) on the rank's heaviest chunk: one
    number per microbatch serves every chunk of the rank, so the rank's budget stays an upper
    bound (exact for V=1; with V>1 the first and last stage's chunk sets it)."""
    per_token = max(weight_grad_bytes_per_token(model, dtype) for model in models)
    return [int(tokens) * per_token for tokens in sizes]
