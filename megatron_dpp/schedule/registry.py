"""make_scheduler: schedule names -> RankScheduler objects, and the default memory budget."""
from __future__ import annotations

from megatron_dpp.schedule import static_orders
from megatron_dpp.schedule.adaptive import (
    AdaptiveScheduler,
    adaptive_microbatch_order,
    profile_peak,
    spine_group_size,
    spine_order,
    spine_warmup_cap,
)
from megatron_dpp.schedule.dynamic import BreadthFirstScheduler, DepthFirstScheduler, GreedyScheduler
from megatron_dpp.schedule.graph import TaskGraph
from megatron_dpp.schedule.scheduler import RankScheduler, StaticOrderScheduler


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


def size_sorted_order(graph: TaskGraph) -> list[int]:
    """Microbatches largest first (ties by index): a pure function of the batch's sizes."""
    return sorted(range(graph.M), key=lambda m: (-graph.sizes[m], m))


def _static(name: str, graph: TaskGraph, rank: int, budget: int, order: list[int], group: int | None):
    P, V, M = graph.P, graph.V, graph.M
    if name == "gpipe":
        tasks = static_orders.gpipe_order(M, V, order, graph.task_table)
    elif name == "interleaved-1f1b" or (name == "1f1b-sorted" and V > 1):
        if V < 2:
            raise ValueError(f"{name} interleaves model chunks and needs V >= 2, got V={V}; use 1f1b")
        tasks = static_orders.interleaved_order(P, V, rank, M, order, group, graph.task_table)
    else:
        if V != 1:
            raise ValueError(f"1f1b runs one model chunk per rank, got V={V}; use interleaved-1f1b")
        tasks = static_orders.one_f_one_b_order(P, rank, M, order, graph.task_table)
    if graph.split_backward:
        tasks = static_orders.with_weight_grads(tasks, graph.task_table)
    return StaticOrderScheduler(name, graph, rank, budget, order, tasks)


def _adaptive(
    graph: TaskGraph, rank: int, budget_bytes: int | None, group: int | None, max_inflight: int | None
) -> RankScheduler:
    order = adaptive_microbatch_order(graph.sizes, graph.P, graph.V, graph.split_backward)
    budget = default_budget_bytes(graph, rank, group) if budget_bytes is None else int(budget_bytes)
    if max_inflight is not None:
        if max_inflight < graph.V:
            raise ValueError(f"dpp:adaptive: max_inflight={max_inflight} must be >= V={graph.V}")
        weight, limit = [1] * graph.M, int(max_inflight)
    else:
        if budget < graph.V * graph.max_act_bytes:
            raise ValueError(
                f"dpp:adaptive: budget {budget} bytes on rank {rank} is below the minimum "
                f"V * max_act_bytes = {graph.V * graph.max_act_bytes}"
            )
        weight, limit = graph.act_bytes, budget
    if graph.V == 1:
        cap = spine_warmup_cap(graph, rank, order, limit, weight)
        spine = spine_order(graph, rank, order, None, cap)
        return AdaptiveScheduler(graph, rank, budget, order, spine, max_inflight)
    spine_group = spine_group_size(graph.P, graph.M, group)
    explicit = budget_bytes is not None or max_inflight is not None
    if not explicit or _spines_fit(graph, order, spine_group, limit, weight):
        spine = spine_order(graph, rank, order, spine_group, None)
        return AdaptiveScheduler(graph, rank, budget, order, spine, max_inflight)
    fallback = DepthFirstScheduler(graph, rank, budget, order, max_inflight)
    fallback.name = "dpp:adaptive"
    return fallback


def _spines_fit(graph: TaskGraph, order: list[int], group: int, limit: int, weight) -> bool:
    """Do all ranks' interleaved spines fit one explicit limit (bytes, or a count cap)? Spines are a deadlock-free set
    only when every rank follows one, so this choice is global. (Default budgets always fit: they
    are the spine's own in-flight count at the largest size.) Cached on the graph: every rank
    of one batch asks the same question."""
    cache = graph.__dict__.setdefault("_adaptive_spines_fit", {})
    key = (tuple(order), group, limit, weight is graph.act_bytes)
    if key not in cache:
        cache[key] = all(
            profile_peak(spine_order(graph, r, order, group, None), weight) <= limit
            for r in range(graph.P)
        )
    return cache[key]


_RULE_BASED = {
    "dpp:greedy": GreedyScheduler,
    "dpp:breadth-first": BreadthFirstScheduler,
    "dpp:depth-first": DepthFirstScheduler,
}

STATIC_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "1f1b-sorted")
DYNAMIC_SCHEDULES = ("dpp:adaptive",) + tuple(_RULE_BASED)
SCHEDULE_NAMES = STATIC_SCHEDULES + DYNAMIC_SCHEDULES


def make_scheduler(
    name: str, graph: TaskGraph, rank: int, budget_bytes: int | None = None, **opts
) -> RankScheduler:
    """Build rank `rank`'s scheduler for schedule `name` (see SCHEDULE_NAMES).

    budget_bytes=None means default_budget_bytes(graph, rank). Options:
      microbatch_group_size_per_vp_stage: interleaved 1F1B's group size (default P);
      max_inflight: dpp:* policies admit by this count of chunk activations (forwards held)
        instead of bytes; budget_bytes is then only reported;
      sort_microbatches: dpp:* rule-based policies process microbatches largest first
        (default False: the reference rules keep the batch order).
    1f1b-sorted is Megatron's order over dpp:adaptive's microbatch order (adaptive_microbatch_order),
    so comparing the two separates what ordering gives from what dynamic dispatch adds.
    """
    opts = dict(opts)
    group = opts.pop("microbatch_group_size_per_vp_stage", None)
    budget = default_budget_bytes(graph, rank, group) if budget_bytes is None else int(budget_bytes)
    if name in STATIC_SCHEDULES:
        # 1f1b-sorted uses exactly dpp:adaptive's order, so the two differ only by dynamic dispatch.
        if name == "1f1b-sorted":
            order = adaptive_microbatch_order(graph.sizes, graph.P, graph.V, graph.split_backward)
        else:
            order = list(range(graph.M))
        scheduler = _static(name, graph, rank, budget, order, group)
    elif name == "dpp:adaptive":
        scheduler = _adaptive(graph, rank, budget_bytes, group, opts.pop("max_inflight", None))
    elif name in _RULE_BASED:
        order = size_sorted_order(graph) if opts.pop("sort_microbatches", False) else list(range(graph.M))
        scheduler = _RULE_BASED[name](graph, rank, budget, order, max_inflight=opts.pop("max_inflight", None))
    else:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
    if opts:
        raise ValueError(f"schedule {name!r} does not take option(s) {', '.join(sorted(opts))}")
    return scheduler

