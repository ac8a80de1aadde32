"""The tied word embedding where one rank holds both of its copies (the v placement's rank 0).

With tied input and output embeddings, the first stage's embedding and the last stage's output
layer are one weight kept as two copies, whose gradients Megatron-Core's finalize_model_grads
all-reduces over the embedding group (the first and the last pipeline rank). On the v placement
both stages are chunks of pipeline rank 0, so the group is that rank alone and the sum is local:
each copy's gradient becomes the sum of both, before finalize_model_grads' data-parallel
reduction (a sum, so reducing after adding is reducing each; the distributed optimizer's
reduce-scatter then shards the summed buffers). runtime/flags.py refuses --overlap-grad-reduce
with data parallelism there, whose reductions start during the backward, before this sum.
"""
from __future__ import annotations

from typing import Callable

import torch
from megatron.core.utils import get_attr_wrapped_model

from megatron_dpp.pipeline.placement import Placement


def local_tied_copies(placement: Placement, rank: int) -> tuple[int, int] | None:
    """The chunks (first stage's, last stage's) of `rank` holding both copies; None elsewhere."""
    first = placement.local_chunk(rank, placement.first_stage)
    last = placement.local_chunk(rank, placement.last_stage)
    if first is None or last is None or first == last:
        return None
    return first, last


def _gradient(weight: torch.nn.Parameter) -> torch.Tensor | None:
    # Megatron-Core's DDP accumulates into main_grad; a bare module into grad.
    return getattr(weight, "main_grad", None) if hasattr(weight, "main_grad") else weight.grad


@torch.no_grad()
def sum_tied_copies(model: list, chunks: tuple[int, int]) -> None:
    """Both copies' gradients become their sum (the chunks of local_tied_copies)."""
    weights = []
    for chunk in chunks:
        module = get_attr_wrapped_model(model[chunk], "pre_process", return_model_obj=True)
        if not module.share_embeddings_and_output_weights:
            return
        weights.append(module.shared_embedding_or_output_weight())
    grads = [_gradient(weight) for weight in weights]
    if any(grad is None for grad in grads):
        return
    total = grads[0] + grads[1]
    for grad in grads:
        grad.copy_(total)


def finalize_with_local_tie(finalize: Callable, placement: Placement, rank: int) -> Callable:
    """`finalize` (finalize_model_grads' signature: model first), summing the local tied copies
    first where `rank` holds both; `finalize` itself elsewhere."""
    chunks = local_tied_copies(placement, rank)
    if chunks is None:
        return finalize

    def finalize_model_grads(model, *args, **kwargs):
        sum_tied_copies(model, chunks)
        return finalize(model, *args, **kwargs)
    return finalize_model_grads
