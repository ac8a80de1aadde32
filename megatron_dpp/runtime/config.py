"""Configuration of the DPP runtime (--use-dpp, --dpp-policy, --dpp-memory-budget, --dpp-timeout,
--dpp-split-backward)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_dpp.pipeline import DEFAULT_POLICY


@dataclass(frozen=True)
class DPPConfig:
    """What the DPP runtime needs beyond Megatron's forward_backward_func arguments."""

    policy: str = DEFAULT_POLICY
    """A schedule name of megatron_dpp.pipeline (SCHEDULE_NAMES)."""

    memory_budget_bytes: Optional[int] = None
    """Activation bytes a rank may hold; None: the policy's default (what 1F1B needs in the worst
    case on that rank, megatron_dpp.pipeline.default_budget_bytes)."""

    timeout_s: float = 300.0
    """Seconds without progress after which the rank reports its state and the job exits."""

    split_backward: bool = False
    """--dpp-split-backward: every backward is B (input gradient) and W (weight gradients); the
    model chunks must be built with deferrable weight gradients (models.weight_grad)."""

    timeout_exit_code: int = 3
    """Exit status of a rank that timed out or lost a peer."""

    def __post_init__(self):
        if self.timeout_s <= 0:
            raise ValueError(f"DPP timeout must be positive, got {self.timeout_s}")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            raise ValueError(f"DPP memory budget must be positive, got {self.memory_budget_bytes}")
