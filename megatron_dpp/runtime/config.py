"""Configuration of the DPP runtime (--use-dpp, --dpp-policy, --dpp-memory-budget, --dpp-timeout,
--dpp-split-backward, --dpp-stage-placement, --dpp-schedule)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_dpp.exit_codes import STALLED
from megatron_dpp.pipeline import DEFAULT_POLICY, MemoryBudget, check_memory_budget
from megatron_dpp.pipeline.placement import INTERLEAVED, PLACEMENT_NAMES
from megatron_dpp.pipeline.schedule_csv import ScheduleFile


@dataclass(frozen=True)
class DPPConfig:
    """What the DPP runtime needs beyond Megatron's forward_backward_func arguments."""

    policy: str = DEFAULT_POLICY
    """A schedule name of megatron_dpp.pipeline (SCHEDULE_NAMES)."""

    memory_budget_bytes: MemoryBudget = None
    """Activation bytes a rank may hold (megatron_dpp.pipeline.budget): None: the policy's default
    (what 1F1B needs in the worst case on that rank, default_budget_bytes); 'provisioned'
    (PROVISIONED_BUDGET): what it needs on its fullest rank, on every rank
    (provisioned_budget_bytes); a RelativeBudget: a multiple (>= 1) of that, on every rank; an
    int: that many bytes."""

    timeout_s: float = 300.0
    """Seconds without progress after which the rank reports its state and the job exits."""

    split_backward: bool = False
    """--dpp-split-backward: every backward is B (input gradient) and W (weight gradients); the
    model chunks must be built with deferrable weight gradients (models.weight_grad)."""

    placement: str = INTERLEAVED
    """Which rank holds each virtual stage (pipeline/placement.py's PLACEMENT_NAMES): 'interleaved',
    Megatron-Core's (chunk c of rank r is stage c*P + r), or 'v', ZB-V's (two chunks a rank, chunk 1
    of rank r is stage 2P-1-r); the model chunks must be built for it (models/init.py)."""

    schedule: Optional[ScheduleFile] = None
    """--dpp-schedule FILE: every rank runs its row of this schedule (pipeline/schedule_csv.py)
    in place of `policy`'s order; it must fit the run's pipeline (ScheduleFile.mismatch)."""

    timeout_exit_code: int = STALLED
    """Exit status of a rank that made no progress for timeout_s, or whose transport failed
    (megatron_dpp.exit_codes)."""

    def __post_init__(self):
        if self.timeout_s <= 0:
            raise ValueError(f"DPP timeout must be positive, got {self.timeout_s}")
        check_memory_budget(self.memory_budget_bytes, what="DPP memory budget")
        if self.placement not in PLACEMENT_NAMES:
            raise ValueError(f"unknown stage placement {self.placement!r}; choose one of "
                             f"{', '.join(PLACEMENT_NAMES)}")
