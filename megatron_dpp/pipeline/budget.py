"""Activation-memory budgets: the default one (what Megatron's schedule needs) and the parser of
the `--dpp-memory-budget` text. The one place either is defined."""
from __future__ import annotations

from typing import Optional

from megatron_dpp.pipeline import static_orders
from megatron_dpp.pipeline.adaptive import spine_group_size
from megatron_dpp.pipeline.graph import TaskGraph

AUTO_BUDGET = "auto"

# Units accepted after the number, e.g. "512MiB", "2GB".
_BYTE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9,
    "kib": 2**10, "mib": 2**20, "gib": 2**30,
}


def megatron_inflight_forwards(graph: TaskGraph, rank: int, group_size: int | None = None) -> int:
    """Forward activations Megatron's schedule (1F1B, interleaved for V>1) holds at most on `rank`."""
    P, V, M = graph.P, graph.V, graph.M
    if V == 1:
        warmup, total = static_orders.one_f_one_b_warmup(P, rank, M), M
    else:
        # The default budget must exist for any M: where Megatron rejects the group size, count
        # with the group the adaptive spine uses instead (the smallest one Megatron accepts).
        group = spine_group_size(P, M, group_size)
        warmup, total = static_orders.interleaved_warmup(P, V, rank, M, group), M * V
    return min(warmup + 1, total)


def default_budget_bytes(graph: TaskGraph, rank: int, group_size: int | None = None) -> int:
    """What 1F1B (interleaved 1F1B for V>1) needs in the worst case on `rank`: its in-flight forward
    count times the activation bytes of the largest microbatch a batch can contain. Never below
    V * max_act_bytes, the least any dynamic policy needs to guarantee progress."""
    count = max(megatron_inflight_forwards(graph, rank, group_size), graph.V)
    return count * graph.max_act_bytes


def parse_memory_budget(text: str, what: str = "memory budget") -> Optional[int]:
    """'auto' -> None (default_budget_bytes on each rank); otherwise a positive byte count, from a
    number with an optional unit (B, kB, MB, GB, KiB, MiB, GiB; case-insensitive).

    Raises ValueError with a message that starts with `what` (e.g. the flag's name) and says what
    is accepted."""
    value = text.strip().lower()
    if value == AUTO_BUDGET:
        return None
    expected = (f"{what} {text!r}: expected '{AUTO_BUDGET}' or a byte count such as "
                "1073741824 or 1GiB")
    number = value.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = value[len(number):]
    if unit not in _BYTE_UNITS or not number:
        raise ValueError(expected)
    try:
        amount = float(number)
    except ValueError:
        raise ValueError(expected) from None
    if amount <= 0:
        raise ValueError(f"{what} {text!r}: the budget must be positive")
    return int(amount * _BYTE_UNITS[unit])
