"""Where this rank sits: its pipeline stage, the global ranks it exchanges messages with, and how
the ranks of one model-parallel group agree on microbatch sizes.

The executor reads nothing else about process groups, so it runs the same against Megatron's
process groups (`RankLayout.from_process_groups`) and in one process against an in-memory transport
(tests/_runtime_harness.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch.distributed as dist

from megatron_dpp.runtime.batch import agree_on_sizes

# (this rank's sizes, or None where it reads no data; number of microbatches) -> the sizes every
# rank of the model-parallel group uses.
SizeAgreement = Callable[[Optional[List[int]], int], List[int]]


@dataclass(frozen=True)
class RankLayout:
    pp_rank: int
    """This rank's pipeline stage (0..pp_size-1)."""

    pp_ranks: List[int]
    """Global rank of every stage of this rank's pipeline, by stage."""

    tp_ranks: List[int]
    """Global ranks of this rank's tensor-parallel group; the first one decides for the others."""

    global_rank: int
    """This process's global rank."""

    agree_sizes: SizeAgreement
    """Collective over the model-parallel group: every rank gets the same microbatch sizes."""

    cp_size: int = 1
    """Context-parallel size (Megatron's forward_step scales the loss by it)."""

    @property
    def pp_size(self) -> int:
        return len(self.pp_ranks)

    @classmethod
    def from_process_groups(cls, pp: dist.ProcessGroup, tp: dist.ProcessGroup,
                            mp: Optional[dist.ProcessGroup], cp_size: int) -> "RankLayout":
        groups = [mp] if mp is not None else [pp, tp]
        return cls(
            pp_rank=pp.rank(),
            pp_ranks=dist.get_process_group_ranks(pp),
            tp_ranks=dist.get_process_group_ranks(tp),
            global_rank=dist.get_rank(),
            agree_sizes=lambda local, count: agree_on_sizes(local, count, groups),
            cp_size=cp_size,
        )
