"""Activation-memory budgets: the default one (what Megatron's schedule needs on the rank), the
provisioned one (what it needs on its fullest rank, given to every rank), the relative one (a
multiple of the provisioned one), the parser of the `--dpp-memory-budget` text and the check of a
budget value. The one place any of them is defined.

A budget value (`MemoryBudget`) is what the flag's text parses to and what `make_scheduler`,
`simulate` and the runtime's `DPPConfig.memory_budget_bytes` take:
  None (or 'auto')      default_budget_bytes on each rank;
  'provisioned'         provisioned_budget_bytes on each rank;
  RelativeBudget(k)     ('1.25x') k times provisioned_budget_bytes on every rank, k >= 1: the
                        fullest rank's 1F1B activation memory (with split backwards, what W keeps
                        counted in each microbatch's bytes) times k;
  a positive int        that many bytes on every rank.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Union

from megatron_dpp.pipeline import static_orders
from megatron_dpp.pipeline.adaptive import spine_group_size
from megatron_dpp.pipeline.graph import TaskGraph
from megatron_dpp.pipeline.placement import INTERLEAVED, V_SHAPE

AUTO_BUDGET = "auto"
PROVISIONED_BUDGET = "provisioned"
BUDGET_MODES = (AUTO_BUDGET, PROVISIONED_BUDGET)

RELATIVE_SUFFIX = "x"  # '1.25x': a multiple of the provisioned budget
MINIMUM_MULTIPLIER = 1.0


@dataclass(frozen=True)
class RelativeBudget:
    """`multiplier` times the provisioned budget (Megatron's 1F1B on its fullest rank) on every
    rank. At least 1: the provisioned budget is never below the least a dynamic policy needs
    (V largest microbatches), so no multiple of 1 or more is; for less memory than 1F1B's, give
    a byte count."""

    multiplier: float

    def __post_init__(self):
        if not (isinstance(self.multiplier, numbers.Real) and math.isfinite(self.multiplier)
                and self.multiplier >= MINIMUM_MULTIPLIER):
            raise ValueError(f"a relative memory budget must be at least {MINIMUM_MULTIPLIER:g}"
                             f"{RELATIVE_SUFFIX} (the fullest rank's 1F1B memory), got "
                             f"{self.multiplier!r}")

    def __str__(self) -> str:
        return f"{self.multiplier:g}{RELATIVE_SUFFIX}"


# None ('auto'), 'auto', 'provisioned', a RelativeBudget, or a byte count.
MemoryBudget = Union[int, str, RelativeBudget, None]

# Units accepted after the number, e.g. "512MiB", "2GB".
_BYTE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9,
    "kib": 2**10, "mib": 2**20, "gib": 2**30,
}


def largest_microbatch_bytes(activation_bytes_fn, config, seq_length: int, micro_batch_size: int,
                             num_model_chunks: int, pipeline_size: int) -> int:
    """Activation bytes of the largest microbatch any batch can hold (a full sequence of
    `micro_batch_size` samples) on one model chunk: what budgets are provisioned for, as Megatron's
    fixed schedules must be. activation_bytes_fn: a ModelSpec.activation_bytes, (config, sizes,
    micro-batch size, chunks per rank, pipeline size) -> bytes per microbatch. The runtime calls
    it with the model's TransformerConfig, the flag check with the flags (runtime/flags.py)."""
    largest_size = seq_length * micro_batch_size
    return int(activation_bytes_fn(config, [largest_size], micro_batch_size, num_model_chunks,
                                   pipeline_size)[0])


def minimum_budget_bytes(num_model_chunks: int, max_act_bytes: int) -> int:
    """The least byte budget a dynamic policy (dpp:*) runs with: one largest microbatch on each of
    the rank's chunks (V * max_act_bytes), which guarantees progress. The schedulers refuse less
    (registry.py, rule_based.py: "below the minimum"), and so does the flag check before launch."""
    return num_model_chunks * max_act_bytes


def megatron_inflight_forwards(graph: TaskGraph, rank: int, group_size: int | None = None) -> int:
    """Forward activations the reference order of the graph's placement holds at most on `rank`:
    Megatron's schedule (1F1B, interleaved for V>1) on the interleaved placement, ZB-V's on the v
    placement (its W tasks holding activations with split backwards). Other placements have no
    reference order: their budgets are byte counts."""
    P, V, M = graph.P, graph.V, graph.M
    placement = graph.placement
    if placement.name == V_SHAPE:
        order = static_orders.zbv_order(P, rank, M, range(M), graph.task_table, graph.split_backward)
        return static_orders.peak_inflight_forwards(order)
    if placement.name != INTERLEAVED:
        raise ValueError(f"memory budget: placement {placement} has no reference order to size "
                         "'auto' or 'provisioned' by; give a byte count")
    if V == 1:
        warmup, total = static_orders.one_f_one_b_warmup(P, rank, M), M
    else:
        # The default budget must exist for any M: where Megatron rejects the group size, count
        # with the group the adaptive spine uses instead (the smallest one Megatron accepts).
        group = spine_group_size(P, M, group_size)
        warmup, total = static_orders.interleaved_warmup(P, V, rank, M, group), M * V
    return min(warmup + 1, total)


def default_budget_bytes(graph: TaskGraph, rank: int, group_size: int | None = None) -> int:
    """What 1F1B (interleaved 1F1B for V>1, ZB-V on the v placement) needs in the worst case on
    `rank`: its in-flight forward count times the activation bytes of the largest microbatch a
    batch can contain. Never below V * max_act_bytes, the least any dynamic policy needs to
    guarantee progress."""
    count = max(megatron_inflight_forwards(graph, rank, group_size), graph.V)
    return count * graph.max_act_bytes


def provisioned_inflight_forwards(graph: TaskGraph, group_size: int | None = None) -> int:
    """The chunk activations Megatron's schedule (ZB-V's on the v placement) holds at most on its
    fullest rank (1F1B: rank 0 with min(P, M); interleaved: rank 0 with 2(P-1) + (V-1)G + 1),
    never below V: what `provisioned` lets every rank hold."""
    return max(max(megatron_inflight_forwards(graph, rank, group_size), graph.V)
               for rank in range(graph.P))


def provisioned_budget_bytes(graph: TaskGraph, group_size: int | None = None) -> int:
    """The `provisioned` budget, the same count on every rank: provisioned_inflight_forwards times
    the largest microbatch's bytes (graph.max_act_bytes, which with split backwards includes what
    the W store keeps, as for default_budget_bytes). Every device of a pipeline has the same
    memory, and Megatron's schedule needs this on its first rank, so the headroom it leaves on the
    later ranks is free. At least default_budget_bytes on every rank, equal to it on the fullest
    (rank 0 for Megatron's schedule)."""
    return provisioned_inflight_forwards(graph, group_size) * graph.max_act_bytes


def _check_kind(budget: MemoryBudget, what: str) -> None:
    if budget is None or isinstance(budget, RelativeBudget) or (
            budget in BUDGET_MODES if isinstance(budget, str) else
            isinstance(budget, numbers.Real) and not isinstance(budget, bool)):
        return
    raise ValueError(f"{what} {budget!r}: expected None, {', '.join(map(repr, BUDGET_MODES))}, "
                     "a RelativeBudget or a byte count")


def check_memory_budget(budget: MemoryBudget, what: str = "memory budget") -> None:
    """Raise ValueError unless `budget` is a MemoryBudget: None, 'auto', 'provisioned', a
    RelativeBudget (at least 1x, which its constructor checks) or a positive byte count.
    (make_scheduler accepts any byte count and reports one below what the policy needs with that
    minimum.)"""
    _check_kind(budget, what)
    if is_explicit_budget(budget) and budget <= 0:
        raise ValueError(f"{what} must be positive, got {budget}")


def is_explicit_budget(budget: MemoryBudget) -> bool:
    """A byte count given by the user (not derived from Megatron's schedule, as 'auto',
    'provisioned' and a RelativeBudget are)."""
    return budget is not None and not isinstance(budget, (str, RelativeBudget))


def budget_bytes_for(budget: MemoryBudget, graph: TaskGraph, rank: int,
                     group_size: int | None = None) -> int:
    """The bytes `rank` may hold under `budget` (see MemoryBudget)."""
    _check_kind(budget, "memory budget")
    if budget is None or budget == AUTO_BUDGET:
        return default_budget_bytes(graph, rank, group_size)
    if budget == PROVISIONED_BUDGET:
        return provisioned_budget_bytes(graph, group_size)
    if isinstance(budget, RelativeBudget):
        return int(budget.multiplier * provisioned_budget_bytes(graph, group_size))
    return int(budget)


def parse_memory_budget(text: str, what: str = "memory budget") -> MemoryBudget:
    """'auto' -> None (default_budget_bytes on each rank); 'provisioned' -> PROVISIONED_BUDGET
    (provisioned_budget_bytes on each rank); a number followed by 'x' such as '1.25x' ->
    RelativeBudget (that multiple of provisioned_budget_bytes on every rank, at least 1x);
    otherwise a positive byte count, from a number with an optional unit (B, kB, MB, GB, KiB,
    MiB, GiB; case-insensitive).

    Raises ValueError with a message that starts with `what` (e.g. the flag's name) and says what
    is accepted."""
    value = text.strip().lower()
    if value == AUTO_BUDGET:
        return None
    if value == PROVISIONED_BUDGET:
        return PROVISIONED_BUDGET
    expected = (f"{what} {text!r}: expected '{AUTO_BUDGET}', '{PROVISIONED_BUDGET}', a multiple "
                "of 1F1B's fullest rank such as 1.25x, or a byte count such as 1073741824 or 1GiB")
    if value.endswith(RELATIVE_SUFFIX):
        try:
            multiplier = float(value[:-len(RELATIVE_SUFFIX)])
        except ValueError:
            raise ValueError(expected) from None
        if not (math.isfinite(multiplier) and multiplier >= MINIMUM_MULTIPLIER):
            raise ValueError(f"{what} {text!r}: a multiple of 1F1B's fullest-rank memory must be "
                             f"at least {MINIMUM_MULTIPLIER:g}{RELATIVE_SUFFIX}; for less, give a "
                             "byte count")
        return RelativeBudget(multiplier)
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
