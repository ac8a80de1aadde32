"""Configuration of the DPP runtime (--use-dpp, --dpp-policy, --dpp-memory-budget, --dpp-timeout)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Every scheduler name of megatron_dpp.schedule.make_scheduler; the static orders run through the same
# runtime (useful to compare a policy with the order it replaces, in one code path).
DPP_POLICIES = (
    "dpp:adaptive", "dpp:breadth-first", "dpp:depth-first", "dpp:greedy",
    "1f1b", "1f1b-sorted", "interleaved-1f1b", "gpipe",
)

# Units accepted by --dpp-memory-budget after the number, e.g. "512MiB", "2GB".
_BYTE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9,
    "kib": 2**10, "mib": 2**20, "gib": 2**30,
}


def parse_memory_budget(text: str) -> Optional[int]:
    """'auto' -> None (the scheduler's default: what 1F1B needs in the worst case); otherwise bytes.

    Raises ValueError with a message that says what is accepted.
    """
    value = text.strip().lower()
    if value == "auto":
        return None
    number = value.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = value[len(number):]
    if unit not in _BYTE_UNITS or not number:
        raise ValueError(
            f"--dpp-memory-budget {text!r}: expected 'auto' or a byte count such as 1073741824 or 1GiB"
        )
    try:
        amount = float(number)
    except ValueError:
        raise ValueError(
            f"--dpp-memory-budget {text!r}: expected 'auto' or a byte count such as 1073741824 or 1GiB"
        ) from None
    if amount <= 0:
        raise ValueError(f"--dpp-memory-budget {text!r}: the budget must be positive")
    return int(amount * _BYTE_UNITS[unit])


@dataclass(frozen=True)
class DPPConfig:
    """What the DPP runtime needs beyond Megatron's forward_backward_func arguments.

    policy: a scheduler name understood by megatron_dpp.schedule.make_scheduler.
    memory_budget_bytes: activation bytes a rank may hold; None = scheduler default (1F1B worst case).
    timeout_s: seconds without progress after which the rank reports its state and the job exits.
    timeout_exit_code: exit status of a rank that timed out.
    """

    policy: str = "dpp:adaptive"
    memory_budget_bytes: Optional[int] = None
    timeout_s: float = 300.0
    timeout_exit_code: int = 3

    def __post_init__(self):
        if self.timeout_s <= 0:
            raise ValueError(f"DPP timeout must be positive, got {self.timeout_s}")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            raise ValueError(f"DPP memory budget must be positive, got {self.memory_budget_bytes}")
