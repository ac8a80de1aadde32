"""The one registry of schedule policies: every policy name, the default, what layouts each
accepts, and `make_scheduler` (name -> a rank's RankScheduler).

Names are spelled here and nowhere else in megatron_dpp: the flags, the runtime, the simulator and
the benchmarks read them from this module.

SCHEDULE_NAMES are the policies of the interleaved placement; V_PLACEMENT_SCHEDULES are orders for
the v placement (placement.v_shape); both are --dpp-policy's choices. `check_policy_placement` says
which policy runs on which placement. A schedule file (schedule_csv.py, --dpp-schedule) is a
static order of its own, with no name here.
"""
from __future__ import annotations

from megatron_dpp.pipeline import static_orders
from megatron_dpp.pipeline.adaptive import (
    AdaptiveScheduler,
    adaptive_microbatch_order,
    profile_peak,
    spine_group_size,
    spine_order,
    spine_warmup_cap,
)
from megatron_dpp.pipeline.budget import (MemoryBudget, budget_bytes_for, is_explicit_budget,
                                          minimum_budget_bytes)
from megatron_dpp.pipeline.graph import TaskGraph
from megatron_dpp.pipeline.placement import INTERLEAVED, V_SHAPE, Placement
from megatron_dpp.pipeline.rule_based import BreadthFirstScheduler, DepthFirstScheduler, GreedyScheduler
from megatron_dpp.pipeline.scheduler import RankScheduler, StaticOrderScheduler

GPIPE = "gpipe"
ONE_F_ONE_B = "1f1b"
INTERLEAVED_1F1B = "interleaved-1f1b"
ONE_F_ONE_B_SORTED = "1f1b-sorted"
ADAPTIVE = "dpp:adaptive"
BREADTH_FIRST = "dpp:breadth-first"
DEPTH_FIRST = "dpp:depth-first"
GREEDY = "dpp:greedy"
ZB_V = "zb-v"

DEFAULT_POLICY = ADAPTIVE

STATIC_SCHEDULES = (GPIPE, ONE_F_ONE_B, INTERLEAVED_1F1B, ONE_F_ONE_B_SORTED)
DYNAMIC_SCHEDULES = (ADAPTIVE, BREADTH_FIRST, DEPTH_FIRST, GREEDY)
SCHEDULE_NAMES = STATIC_SCHEDULES + DYNAMIC_SCHEDULES
V_PLACEMENT_SCHEDULES = (ZB_V,)
# Megatron's orders, which assume its interleaved placement.
_INTERLEAVED_ORDERS = (ONE_F_ONE_B, INTERLEAVED_1F1B, ONE_F_ONE_B_SORTED)

# What make_scheduler reports in `scheduler.strategy` when dpp:adaptive cannot use its spines.
ADAPTIVE_FALLBACK_STRATEGY = (
    "reservation admission with depth-first preference: the interleaved spines do not fit the "
    "explicit budget")


def check_policy_layout(name: str, V: int) -> None:
    """Raise ValueError (one line, with the fix) when policy `name` cannot run V chunks per rank."""
    if name not in SCHEDULE_NAMES + V_PLACEMENT_SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)} "
                         f"(on the v placement also {', '.join(V_PLACEMENT_SCHEDULES)})")
    if name == ZB_V and V != 2:
        raise ValueError(f"{name} runs two model chunks per rank (the v placement), got V={V}")
    if name == INTERLEAVED_1F1B and V < 2:
        raise ValueError(f"{name} interleaves model chunks and needs virtual stages (V >= 2), got "
                         f"V={V}; add virtual stages or use {ONE_F_ONE_B}")
    if name == ONE_F_ONE_B and V != 1:
        raise ValueError(f"{name} runs one model chunk per rank, got V={V}; use {INTERLEAVED_1F1B} "
                         "with virtual stages")


def check_policy_placement(name: str, placement: Placement) -> None:
    """Raise ValueError (one line, with the fix) when policy `name` has no deadlock-free order on
    `placement`. Megatron's orders assume its interleaved placement and ZB-V's the v placement;
    dpp:adaptive follows one of those as its spine; gpipe and the rule-based dpp:* policies run
    on any placement."""
    if name in _INTERLEAVED_ORDERS and placement.name != INTERLEAVED:
        raise ValueError(f"{name} is Megatron's order for the interleaved placement, got placement "
                         f"{placement}; use {GPIPE}, {ADAPTIVE} or {ZB_V} (v placement)")
    if name == ZB_V and placement.name != V_SHAPE:
        raise ValueError(f"{name} is ZB-V's order for the v placement (placement.v_shape(P)), got "
                         f"placement {placement}; use {INTERLEAVED_1F1B} or {ADAPTIVE}")
    if name == ADAPTIVE and placement.name not in (INTERLEAVED, V_SHAPE):
        raise ValueError(f"{name} follows Megatron's or ZB-V's order and placement {placement} has "
                         f"neither; use {GPIPE}, {GREEDY}, {BREADTH_FIRST} or {DEPTH_FIRST}")


def _static(name: str, graph: TaskGraph, rank: int, budget: int, order: list[int], group: int | None):
    P, V, M = graph.P, graph.V, graph.M
    if name == ZB_V:  # it places its own W tasks
        tasks = static_orders.zbv_order(P, rank, M, order, graph.task_table, graph.split_backward)
        return StaticOrderScheduler(name, graph, rank, budget, order, tasks)
    if name == GPIPE:
        tasks = static_orders.gpipe_order(M, V, order, graph.task_table)
    elif V > 1:  # interleaved-1f1b, or 1f1b-sorted over virtual stages
        tasks = static_orders.interleaved_order(P, V, rank, M, order, group, graph.task_table)
    else:
        tasks = static_orders.one_f_one_b_order(P, rank, M, order, graph.task_table)
    if graph.split_backward:
        tasks = static_orders.with_weight_grads(tasks, graph.task_table)
    return StaticOrderScheduler(name, graph, rank, budget, order, tasks)


def _adaptive(
    graph: TaskGraph, rank: int, budget_bytes: MemoryBudget, group: int | None, max_inflight: int | None
) -> RankScheduler:
    order = adaptive_microbatch_order(graph.sizes, graph.P, graph.V, graph.split_backward)
    budget = budget_bytes_for(budget_bytes, graph, rank, group)
    if max_inflight is not None:
        if max_inflight < graph.V:
            raise ValueError(f"{ADAPTIVE}: max_inflight={max_inflight} must be >= V={graph.V}")
        weight, limit = [1] * graph.M, int(max_inflight)
    else:
        minimum = minimum_budget_bytes(graph.V, graph.max_act_bytes)
        if budget < minimum:
            raise ValueError(
                f"{ADAPTIVE}: budget {budget} bytes on rank {rank} is below the minimum "
                f"V * max_act_bytes = {minimum}"
            )
        weight, limit = graph.act_bytes, budget
    if graph.V == 1:
        cap = spine_warmup_cap(graph, rank, order, limit, weight)
        spine = spine_order(graph, rank, order, None, cap)
        return AdaptiveScheduler(graph, rank, budget, order, spine, max_inflight)
    spine_group = spine_group_size(graph.P, graph.M, group)
    # 'auto' and 'provisioned' are at least the spine's own need on every rank: the spines fit.
    explicit = is_explicit_budget(budget_bytes) or max_inflight is not None
    if not explicit or _spines_fit(graph, order, spine_group, limit, weight):
        spine = spine_order(graph, rank, order, spine_group, None)
        return AdaptiveScheduler(graph, rank, budget, order, spine, max_inflight)
    fallback = DepthFirstScheduler(graph, rank, budget, order, max_inflight)
    fallback.strategy = ADAPTIVE_FALLBACK_STRATEGY
    return fallback


def _spines_fit(graph: TaskGraph, order: list[int], group: int, limit: int, weight) -> bool:
    """Do all ranks' interleaved spines fit one explicit limit (bytes, or a count cap)? Spines are a
    deadlock-free set only when every rank follows one, so this choice is global. (Default budgets
    always fit: they are the spine's own in-flight count at the largest size.) Cached on the graph:
    every rank of one batch asks the same question."""
    cache = graph.__dict__.setdefault("_adaptive_spines_fit", {})
    key = (tuple(order), group, limit, weight is graph.act_bytes)
    if key not in cache:
        cache[key] = all(
            profile_peak(spine_order(graph, r, order, group, None), weight) <= limit
            for r in range(graph.P)
        )
    return cache[key]


_RULE_BASED = {
    GREEDY: GreedyScheduler,
    BREADTH_FIRST: BreadthFirstScheduler,
    DEPTH_FIRST: DepthFirstScheduler,
}


def make_scheduler(
    name: str, graph: TaskGraph, rank: int, budget_bytes: MemoryBudget = None, **opts
) -> RankScheduler:
    """Build rank `rank`'s scheduler for schedule `name` (see SCHEDULE_NAMES; on the v placement
    also V_PLACEMENT_SCHEDULES; check_policy_placement says which runs on the graph's placement).

    budget_bytes: None or 'auto' means default_budget_bytes(graph, rank), 'provisioned'
    provisioned_budget_bytes(graph) (budget.py), an int that many bytes. Options:
      microbatch_group_size_per_vp_stage: interleaved 1F1B's group size (default P);
      max_inflight: dpp:* policies admit by this count of chunk activations (forwards held)
        instead of bytes; budget_bytes is then only reported;
      sort_microbatches: dpp:* rule-based policies process microbatches largest first
        (default False: the reference rules keep the batch order).
    1f1b-sorted is Megatron's order over dpp:adaptive's microbatch order (adaptive_microbatch_order),
    so comparing the two separates what ordering gives from what dynamic dispatch adds.

    The scheduler's `name` is `name`, whatever class runs it; `strategy` says how it runs when
    that is not the policy's usual way (dpp:adaptive's fallback).
    """
    check_policy_layout(name, graph.V)
    check_policy_placement(name, graph.placement)
    opts = dict(opts)
    group = opts.pop("microbatch_group_size_per_vp_stage", None)
    budget = budget_bytes_for(budget_bytes, graph, rank, group)
    if name in STATIC_SCHEDULES + V_PLACEMENT_SCHEDULES:
        # 1f1b-sorted uses exactly dpp:adaptive's order, so the two differ only by dynamic dispatch.
        if name == ONE_F_ONE_B_SORTED:
            order = adaptive_microbatch_order(graph.sizes, graph.P, graph.V, graph.split_backward)
        else:
            order = list(range(graph.M))
        scheduler = _static(name, graph, rank, budget, order, group)
    elif name == ADAPTIVE:
        scheduler = _adaptive(graph, rank, budget_bytes, group, opts.pop("max_inflight", None))
    else:
        order = size_sorted_order(graph) if opts.pop("sort_microbatches", False) else list(range(graph.M))
        scheduler = _RULE_BASED[name](graph, rank, budget, order, max_inflight=opts.pop("max_inflight", None))
    if opts:
        raise ValueError(f"schedule {name!r} does not take option(s) {', '.join(sorted(opts))}")
    scheduler.name = name
    return scheduler


def size_sorted_order(graph: TaskGraph) -> list[int]:
    """Microbatches largest first (ties by index): a pure function of the batch's sizes."""
    return sorted(range(graph.M), key=lambda m: (-graph.sizes[m], m))
