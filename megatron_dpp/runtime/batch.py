"""The global batch of one iteration, fetched so microbatches can run in any order.

Megatron's forward_step_func calls next(data_iterator) once per microbatch, in microbatch order. A DPP
policy may run microbatches in another order, so the runtime hands forward_step_func a one-item
iterator for the microbatch it chose; behind it, the chunk's real iterator is drained for the whole
global batch the first time any of its microbatches is needed. A chunk whose forward_step_func never
reads data (a middle stage) never touches its iterator, exactly as under Megatron's schedules.
"""
from __future__ import annotations

from typing import Any, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_dpp.comm.collectives import collective_device


class MicrobatchFeed:
    """The iterator forward_step_func gets for one microbatch: yields that microbatch's item once."""

    def __init__(self, batch: "GlobalBatch", chunk: int, microbatch: int):
        self._batch = batch
        self._chunk = chunk
        self._microbatch = microbatch
        self._used = False

    def __iter__(self):
        return self

    def __next__(self):
        if self._used:
            raise RuntimeError(
                f"forward_step_func called next(data_iterator) twice for microbatch {self._microbatch}; "
                "DPP needs exactly one call per microbatch (as Megatron's schedules do)"
            )
        self._used = True
        return self._batch.item(self._chunk, self._microbatch)


class GlobalBatch:
    """The M items of one iteration for each model chunk's data iterator (None where a chunk has none)."""

    def __init__(self, data_iterators: Sequence[Optional[Iterator]], num_microbatches: int):
        self._sources = list(data_iterators)
        self._num_microbatches = num_microbatches
        self._items: List[Optional[List[Any]]] = [None] * len(self._sources)

    def has_source(self, chunk: int) -> bool:
        return self._sources[chunk] is not None

    def items(self, chunk: int) -> List[Any]:
        if self._items[chunk] is None:
            source = self._sources[chunk]
            if source is None:
                raise RuntimeError(f"model chunk {chunk} has no data iterator but its forward step read data")
            fetched = []
            for index in range(self._num_microbatches):
                try:
                    fetched.append(next(source))
                except StopIteration:
                    raise RuntimeError(
                        f"data iterator of model chunk {chunk} ran out after {index} of "
                        f"{self._num_microbatches} microbatches of this global batch"
                    ) from None
            self._items[chunk] = fetched
        return self._items[chunk]

    def item(self, chunk: int, microbatch: int) -> Any:
        return self.items(chunk)[microbatch]

    def feed(self, chunk: int, microbatch: int) -> Optional[MicrobatchFeed]:
        if self._sources[chunk] is None:
            return None
        return MicrobatchFeed(self, chunk, microbatch)


def agree_on_sizes(local_sizes: Optional[List[int]], num_microbatches: int,
                   groups: Sequence[Optional[dist.ProcessGroup]]) -> List[int]:
    """Every rank of the model-parallel group gets the same microbatch sizes.

    Ranks that read data pass their sizes, the others None; one MAX all-reduce per group (the
    model-parallel group, or the pipeline then the tensor-parallel group) spreads them. All data-reading
    ranks of one pipeline read the same samples, so MAX is their common value.
    """
    sizes = torch.zeros(num_microbatches, dtype=torch.int64)
    if local_sizes is not None:
        sizes += torch.tensor(local_sizes, dtype=torch.int64)
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            on_device = sizes.to(collective_device(group, sizes.device))
            dist.all_reduce(on_device, op=dist.ReduceOp.MAX, group=group)
            sizes = on_device.cpu()
    agreed = [int(s) for s in sizes.tolist()]
    if min(agreed) <= 0:
        # Nobody read data (a model whose stages all take inputs from elsewhere): equal sizes.
        return [1] * num_microbatches
    return agreed
