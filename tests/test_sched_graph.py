"""Task graph, static orders and make_scheduler: structure and Megatron parity."""
import pytest

from megatron_dpp.pipeline import (
    SCHEDULE_NAMES,
    Phase,
    Task,
    TaskGraph,
    default_budget_bytes,
    make_scheduler,
    size_sorted_order,
)
from megatron_dpp.pipeline import static_orders


def test_task_is_hashable_and_tuple_like():
    t = Task(Phase.F, 3, 1)
    assert {t: 1}[Task(Phase.F, 3, 1)] == 1
    assert (t.phase, t.microbatch, t.chunk) == (Phase.F, 3, 1)
    assert str(t) == "F3.1"


def test_edges_follow_megatron_virtual_stages():
    g = TaskGraph(P=2, V=2, M=3)
    # Virtual stage order: (r0,c0) -> (r1,c0) -> (r0,c1) -> (r1,c1).
    assert g.input_source(0, Task(Phase.F, 1, 0)) is None
    assert g.output_target(0, Task(Phase.F, 1, 0)) == (1, Task(Phase.F, 1, 0))
    assert g.output_target(1, Task(Phase.F, 1, 0)) == (0, Task(Phase.F, 1, 1))
    assert g.output_target(1, Task(Phase.F, 1, 1)) is None
    assert g.input_source(1, Task(Phase.B, 1, 1)) is None
    assert g.input_source(0, Task(Phase.B, 1, 1)) == (1, Task(Phase.B, 1, 1))
    assert g.output_target(0, Task(Phase.B, 1, 1)) == (1, Task(Phase.B, 1, 0))
    assert g.output_target(0, Task(Phase.B, 1, 0)) is None
    assert len(g.tasks(0)) == 2 * 2 * 3


def test_one_f_one_b_order_rank_lists():
    order = static_orders.one_f_one_b_order(P=3, rank=0, M=4, order=range(4))
    assert " ".join(map(str, order)) == "F0.0 F1.0 F2.0 B0.0 F3.0 B1.0 B2.0 B3.0"
    last = static_orders.one_f_one_b_order(P=3, rank=2, M=4, order=range(4))
    assert " ".join(map(str, last)) == "F0.0 B0.0 F1.0 B1.0 F2.0 B2.0 F3.0 B3.0"


def test_interleaved_table_matches_megatron():
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    for M, V, group in [(8, 2, 4), (12, 3, 4), (10, 2, 5), (16, 2, 6), (9, 2, 9)]:
        assert static_orders.interleaved_table(M, V, group) == schedules.get_schedule_table(M, V, group)


def test_interleaved_order_documented_example():
    # Megatron's comment: PP2 N3M5 with VP2 -> microbatches 0 1 2 0 1 2 3 4 3 4.
    order = static_orders.interleaved_order(P=2, V=2, rank=0, M=5, order=range(5), group_size=3)
    forwards = [t for t in order if t.phase == Phase.F]
    assert [t.microbatch for t in forwards] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [t.chunk for t in forwards] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    backwards = [t for t in order if t.phase == Phase.B]
    assert [t.chunk for t in backwards] == [1, 1, 1, 0, 0, 0, 1, 1, 0, 0]


def test_interleaved_rejects_what_megatron_rejects():
    with pytest.raises(ValueError, match="group_size_per_vp_stage"):
        static_orders.interleaved_order(P=4, V=2, rank=0, M=6, order=range(6))
    with pytest.raises(ValueError, match="must lie in"):
        static_orders.interleaved_order(P=4, V=2, rank=0, M=8, order=range(8), group_size=3)


def test_default_budget_is_megatron_inflight_times_largest():
    g = TaskGraph(P=4, V=1, M=8, sizes=[1] * 8, act_bytes=[5, 1, 1, 1, 1, 1, 1, 1])
    assert [default_budget_bytes(g, r) for r in range(4)] == [20, 15, 10, 5]
    g = TaskGraph(P=4, V=1, M=8, sizes=[1] * 8, act_bytes=[1] * 8, max_act_bytes=10)
    assert default_budget_bytes(g, 0) == 40
    g2 = TaskGraph(P=4, V=2, M=8, sizes=[1] * 8, act_bytes=[1] * 8)
    # interleaved warmup 2*(P-r-1) + (V-1)*P, plus one
    assert [default_budget_bytes(g2, r) for r in range(4)] == [11, 9, 7, 5]


# (P, V, M): Megatron's in-flight chunk activations per rank ('auto'), and the most of them,
# which 'provisioned' gives every rank. Interleaved: 2(P-r-1) + (V-1)G + 1 with G = P.
BUDGET_COUNTS = [
    ((2, 1, 8), [2, 1], 2),
    ((4, 1, 8), [4, 3, 2, 1], 4),
    ((4, 1, 2), [2, 2, 2, 1], 2),  # fewer microbatches than ranks: min(P - r, M)
    ((2, 2, 4), [5, 3], 5),
    ((4, 2, 8), [11, 9, 7, 5], 11),
]


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("shape,auto,provisioned", BUDGET_COUNTS)
def test_provisioned_budget_is_the_first_ranks_count_on_every_rank(shape, auto, provisioned, split):
    """Counted at max_act_bytes, like 'auto'. With split backwards the caller adds what the W
    store keeps to each microbatch's bytes (the runtime does, runtime/executor.py), and both
    budgets count the sum: 10 bytes of activations + 4 of stored W work per microbatch here."""
    from megatron_dpp.pipeline import (
        PROVISIONED_BUDGET,
        budget_bytes_for,
        provisioned_budget_bytes,
        provisioned_inflight_forwards,
    )
    from megatron_dpp.sim import simulate

    P, V, M = shape
    unit = 10 + (4 if split else 0)
    g = TaskGraph(P, V, M, sizes=[1] * M, act_bytes=[unit // 2] * M, max_act_bytes=unit,
                  split_backward=split)
    assert [default_budget_bytes(g, r) for r in range(P)] == [c * unit for c in auto]
    assert provisioned_inflight_forwards(g) == provisioned == max(auto)
    assert provisioned_budget_bytes(g) == provisioned * unit
    for r in range(P):
        assert budget_bytes_for(None, g, r) == budget_bytes_for("auto", g, r) == auto[r] * unit
        assert budget_bytes_for(PROVISIONED_BUDGET, g, r) == provisioned * unit >= auto[r] * unit
        assert budget_bytes_for(123, g, r) == 123
        for name in SCHEDULE_NAMES:
            if (name == "1f1b" and V > 1) or (name == "interleaved-1f1b" and V == 1):
                continue
            assert make_scheduler(name, g, r, PROVISIONED_BUDGET).budget_bytes == provisioned * unit
    assert simulate(g, "dpp:adaptive", budget_bytes="provisioned").budget_bytes == [provisioned * unit] * P


def test_a_budget_value_is_checked_in_one_place():
    from megatron_dpp.pipeline import check_memory_budget

    for good in (None, "auto", "provisioned", 1, 2.5e9):
        check_memory_budget(good)
    for bad, message in ((0, "positive"), (-5, "positive"), ("lots", "expected"), ([1], "expected"),
                         (True, "expected")):
        with pytest.raises(ValueError, match=message):
            check_memory_budget(bad)
    with pytest.raises(ValueError, match="expected"):
        make_scheduler("dpp:adaptive", TaskGraph(2, 1, 4), 0, "everything")


def test_static_peak_equals_default_budget_with_equal_sizes():
    for P, V, M in [(4, 1, 16), (4, 1, 2), (4, 2, 8), (3, 3, 9)]:
        g = TaskGraph(P, V, M)
        name = "1f1b" if V == 1 else "interleaved-1f1b"
        for rank in range(P):
            s = make_scheduler(name, g, rank)
            assert static_orders.peak_inflight_forwards(s.order) * g.max_act_bytes == s.budget_bytes


def test_every_name_builds_and_orders_agree_across_ranks():
    g = TaskGraph(P=4, V=2, M=8, sizes=[5, 1, 7, 3, 2, 8, 4, 6])
    for name in SCHEDULE_NAMES:
        if name == "1f1b":
            continue
        orders = [make_scheduler(name, g, r).microbatch_order for r in range(4)]
        assert all(o == orders[0] for o in orders), name
    sorted_order = make_scheduler("1f1b-sorted", g, 0).microbatch_order
    assert sorted_order == make_scheduler("dpp:adaptive", g, 0).microbatch_order
    # V=2: largest first.
    assert [g.sizes[m] for m in sorted_order] == [8, 7, 6, 5, 4, 3, 2, 1]
    g1 = TaskGraph(P=4, V=1, M=8, sizes=[5, 1, 7, 3, 2, 8, 4, 6])
    # V=1: k = min(P, M // 4) = 2 small ones first (every other of the 4 smallest), then largest first.
    order1 = make_scheduler("dpp:adaptive", g1, 0).microbatch_order
    assert [g1.sizes[m] for m in order1] == [1, 3, 8, 7, 6, 5, 4, 2]
    assert size_sorted_order(g) == [5, 2, 7, 0, 6, 3, 4, 1]


def test_make_scheduler_rejects_bad_input():
    g = TaskGraph(P=2, V=1, M=4)
    with pytest.raises(ValueError, match="unknown schedule"):
        make_scheduler("zigzag", g, 0)
    with pytest.raises(ValueError, match="needs virtual stages"):
        make_scheduler("interleaved-1f1b", g, 0)
    with pytest.raises(ValueError, match="does not take"):
        make_scheduler("1f1b", g, 0, max_inflight=2)
    with pytest.raises(ValueError, match="below the minimum"):
        make_scheduler("dpp:adaptive", g, 0, budget_bytes=0)
    with pytest.raises(ValueError, match="below the minimum"):
        make_scheduler("dpp:greedy", g, 0, budget_bytes=0)
    with pytest.raises(ValueError, match="1f1b runs one model chunk"):
        make_scheduler("1f1b", TaskGraph(P=2, V=2, M=4), 0)


def test_static_scheduler_waits_for_its_next_task():
    g = TaskGraph(P=2, V=1, M=2)
    s = make_scheduler("1f1b", g, 1)
    assert s.next_task(set()) is None
    assert s.next_task({Task(Phase.F, 1, 0)}) is None  # F0 is next
    assert s.next_task({Task(Phase.F, 0, 0)}) == Task(Phase.F, 0, 0)
    s.on_start(Task(Phase.F, 0, 0))
    assert s.held_bytes == 1
    s.on_finish(Task(Phase.F, 0, 0))
    with pytest.raises(RuntimeError, match="order says"):
        s.on_start(Task(Phase.F, 1, 0))


def test_greedy_respects_count_cap():
    g = TaskGraph(P=2, V=1, M=6)
    s = make_scheduler("dpp:greedy", g, 0, max_inflight=2)
    ready = {Task(Phase.F, m, 0) for m in range(6)}
    for _ in range(2):
        t = s.next_task(ready)
        ready.discard(t)
        s.on_start(t)
        s.on_finish(t)
    assert s.next_task(ready) is None  # two in flight: the cap
    ready.add(Task(Phase.B, 0, 0))
    assert s.next_task(ready) == Task(Phase.B, 0, 0)
