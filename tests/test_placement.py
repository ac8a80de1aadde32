"""Stage placement as data (megatron_dpp/pipeline/placement.py): the interleaved and V placements,
any placement from the rank of each stage, their text form, and the task graph and ready rule on
a V placement."""
from __future__ import annotations

import os

import pytest
from _sched_util import check_timeline
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_dpp.pipeline import (DYNAMIC_SCHEDULES, SCHEDULE_NAMES, V_PLACEMENT_SCHEDULES, Phase,
                                   ReadyTracker, Task, TaskGraph, default_budget_bytes,
                                   make_scheduler, static_orders)
from megatron_dpp.pipeline.placement import (Placement, from_stage_ranks, interleaved,
                                             parse_placement, v_shape)
from megatron_dpp.sim import simulate
from megatron_dpp.sim.models import CommModel, DurationModel


def test_interleaved_is_megatrons_chunk_times_p_plus_rank():
    placement = interleaved(4, 3)
    assert (placement.P, placement.V, placement.num_stages, placement.name) == (4, 3, 12, "interleaved")
    for rank in range(4):
        for chunk in range(3):
            stage = placement.stage(rank, chunk)
            assert stage == chunk * 4 + rank
            assert placement.location(stage) == (rank, chunk)
    assert placement.first_stage == 0 and placement.last_stage == 11
    assert placement.stages_of(1) == (1, 5, 9)
    assert placement.chunks_deepest_first(1) == (2, 1, 0)
    assert placement.local_chunk(3, placement.last_stage) == 2
    assert placement.local_chunk(0, placement.last_stage) is None
    assert not placement.next_on_same_rank(3) and not placement.previous_on_same_rank(4)


def test_v_shape_goes_down_the_ranks_and_back_up():
    placement = v_shape(4)
    assert placement.stage_ranks == (0, 1, 2, 3, 3, 2, 1, 0)
    assert (placement.P, placement.V, placement.name) == (4, 2, "v")
    assert placement.stages_of(0) == (0, 7)
    assert placement.stages_of(3) == (3, 4)
    assert placement.location(4) == (3, 1)
    # The turn of the V: stage 3's output stays on rank 3.
    assert placement.next_on_same_rank(3) and placement.previous_on_same_rank(4)
    assert [s for s in range(8) if placement.next_on_same_rank(s)] == [3]
    # Rank 0 holds the first stage (data) and the last (the loss).
    assert placement.local_chunk(0, placement.first_stage) == 0
    assert placement.local_chunk(0, placement.last_stage) == 1
    assert placement.embedding_stages(tied_embeddings=False) == (0,)
    assert placement.embedding_stages(tied_embeddings=True) == (0, 7)
    assert placement.next_stage(7) is None and placement.previous_stage(0) is None


def test_from_stage_ranks_numbers_each_ranks_chunks_in_stage_order():
    placement = from_stage_ranks([1, 0, 0, 1])
    assert placement.name == "custom"
    assert placement.stages_of(1) == (0, 3) and placement.stages_of(0) == (1, 2)
    assert placement.stage(1, 1) == 3
    assert placement.next_on_same_rank(1)
    # A list that is a known placement is that placement.
    assert from_stage_ranks([0, 1, 0, 1]) == interleaved(2, 2)
    assert from_stage_ranks([0, 1, 1, 0]).name == "v"


@pytest.mark.parametrize("placement", [interleaved(4, 2), interleaved(1), v_shape(3),
                                       from_stage_ranks([2, 0, 1, 1, 0, 2])])
def test_a_placement_prints_and_parses_back(placement):
    assert parse_placement(str(placement)) == placement
    assert eval(repr(placement), {"Placement": Placement}) == placement


def test_the_text_forms():
    assert str(interleaved(4, 2)) == "interleaved:4x2"
    assert str(v_shape(4)) == "v:4"
    assert str(from_stage_ranks([1, 0])) == "ranks:1,0"


@pytest.mark.parametrize("build,message", [
    (lambda: from_stage_ranks([0, 0, 1]), "same number of stages"),
    (lambda: from_stage_ranks([0, 2]), "same number of stages"),
    (lambda: from_stage_ranks([]), "non-empty"),
    (lambda: from_stage_ranks([0, -1]), "same number of stages"),
    (lambda: interleaved(0, 1), "P, V >= 1"),
    (lambda: v_shape(0), "P >= 1"),
    (lambda: parse_placement("zigzag:4"), "not a placement"),
    (lambda: parse_placement("v:four"), "not a placement"),
    (lambda: interleaved(2, 2).stage(2, 0), "no chunk 0 on rank 2"),
    (lambda: interleaved(2, 2).location(4), "no stage 4"),
    (lambda: TaskGraph(4, 2, 4, placement=v_shape(2)), "placement v:2 has P=2"),
])
def test_bad_input_is_one_line_value_error(build, message):
    with pytest.raises(ValueError, match=message) as raised:
        build()
    assert "\n" not in str(raised.value)


# --- the task graph and the ready rule on a V placement -------------------------------------------

def test_the_default_graph_is_interleaved():
    graph = TaskGraph(4, 2, 8)
    assert graph.placement == interleaved(4, 2)
    assert graph.virtual_stage(1, 1) == 5 and graph.stage_location(5) == (1, 1)


def test_v_graph_turns_on_the_last_rank_without_leaving_it():
    P = 4
    graph = TaskGraph(P, 2, 3, placement=v_shape(P))
    F, B = Phase.F, Phase.B
    # Stage P-1 (rank P-1, chunk 0) sends its forward to stage P (rank P-1, chunk 1).
    assert graph.output_target(P - 1, Task(F, 1, 0)) == (P - 1, Task(F, 1, 1))
    assert graph.input_source(P - 1, Task(F, 1, 1)) == (P - 1, Task(F, 1, 0))
    # And stage P's input gradient goes back to stage P-1 on the same rank.
    assert graph.output_target(P - 1, Task(B, 1, 1)) == (P - 1, Task(B, 1, 0))
    assert graph.input_source(P - 1, Task(B, 1, 0)) == (P - 1, Task(B, 1, 1))
    # Chunk 1 runs back up the ranks: stage P+1 is rank P-2's chunk 1.
    assert graph.output_target(P - 1, Task(F, 0, 1)) == (P - 2, Task(F, 0, 1))
    assert graph.output_target(1, Task(B, 0, 1)) == (2, Task(B, 0, 1))
    # Rank 0's chunk 1 is the last stage: no forward output, no gradient to wait for.
    assert graph.output_target(0, Task(F, 0, 1)) is None
    assert graph.input_source(0, Task(B, 0, 1)) is None
    assert graph.input_source(0, Task(F, 0, 0)) is None
    assert graph.output_target(0, Task(B, 0, 0)) is None
    assert "placement=v:4" in repr(graph)


def test_v_ready_rule_rank_zero_starts_and_ends_the_pipeline():
    graph = TaskGraph(2, 2, 2, placement=v_shape(2))
    rank0, rank1 = ReadyTracker(graph, 0), ReadyTracker(graph, 1)
    F, B = Phase.F, Phase.B
    assert rank0.ready == {Task(F, 0, 0), Task(F, 1, 0)}  # the first stage reads data
    assert rank1.ready == set()
    assert not rank0.needs_input(Task(B, 0, 1))  # the loss stage makes its own gradient
    # The loss stage's forward, once finished, makes its backward ready with no message.
    rank0.input_arrived(Task(F, 0, 1))
    rank0.start(Task(F, 0, 1))
    rank0.finish(Task(F, 0, 1))
    assert Task(B, 0, 1) in rank0.ready
    # On rank 1 the turn of the V: chunk 0's backward waits for chunk 1's on the same rank.
    rank1.input_arrived(Task(F, 0, 0))
    rank1.start(Task(F, 0, 0))
    rank1.finish(Task(F, 0, 0))
    assert Task(B, 0, 0) not in rank1.ready
    assert rank1.needs_input(Task(B, 0, 0))


# --- the V placement in the simulator --------------------------------------------------------------

# Megatron's orders assume the interleaved placement (1f1b also one chunk per rank).
INTERLEAVED_ONLY = {"1f1b", "interleaved-1f1b", "1f1b-sorted"}


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
@pytest.mark.parametrize("M", [4, 8, 16])
@pytest.mark.parametrize("P", [2, 4])
def test_every_policy_runs_a_v_graph_to_the_end_or_refuses_it_in_one_line(P, M, split):
    sizes = [1 + (3 * m) % 5 for m in range(M)]  # variable sizes: the dynamic policies deviate
    for equal in (True, False):
        graph = TaskGraph(P, 2, M, sizes=None if equal else sizes, split_backward=split,
                          placement=v_shape(P))
        for name in SCHEDULE_NAMES + V_PLACEMENT_SCHEDULES:
            if name in INTERLEAVED_ONLY:
                with pytest.raises(ValueError) as refused:
                    make_scheduler(name, graph, 0)
                assert "\n" not in str(refused.value)
                continue
            comm = CommModel(latency=0.1)
            result = simulate(graph, name, DurationModel(jitter_sigma=0.0 if equal else 0.3), comm,
                              seed=1)
            check_timeline(graph, result, comm)  # every task once, every dependency respected
            assert result.makespan >= result.pipeline_bound - 1e-9, name
            if name.startswith("dpp:"):
                assert all(peak <= budget for peak, budget in zip(result.peak_bytes, result.budget_bytes))


def test_megatrons_orders_refuse_a_v_graph_and_zbv_an_interleaved_one():
    v_graph = TaskGraph(4, 2, 8, placement=v_shape(4))
    with pytest.raises(ValueError, match="interleaved-1f1b is Megatron's order for the interleaved placement"):
        make_scheduler("interleaved-1f1b", v_graph, 0)
    with pytest.raises(ValueError, match="zb-v is ZB-V's order for the v placement"):
        make_scheduler("zb-v", TaskGraph(4, 2, 8), 0)
    with pytest.raises(ValueError, match="zb-v runs two model chunks per rank"):
        make_scheduler("zb-v", TaskGraph(4, 1, 8), 0)


def test_a_custom_placement_runs_gpipe_and_the_rules_with_a_byte_budget():
    graph = TaskGraph(2, 2, 4, placement=from_stage_ranks([1, 0, 0, 1]))
    with pytest.raises(ValueError, match="dpp:adaptive follows Megatron's or ZB-V's order"):
        make_scheduler("dpp:adaptive", graph, 0, budget_bytes=100)
    with pytest.raises(ValueError, match="no reference order to size 'auto'"):
        make_scheduler("gpipe", graph, 0)
    for name in ("gpipe", "dpp:greedy", "dpp:breadth-first", "dpp:depth-first"):
        result = simulate(graph, name, budget_bytes=8)
        assert len(result.timeline) == 2 * 2 * 2 * 4, name


@pytest.mark.parametrize("M", [1, 2, 4, 7, 16])
@pytest.mark.parametrize("P", [2, 3, 4])
def test_zbv_order_is_torchs(P, M):
    """Our generator against torch's own ScheduleZBVZeroBubble order (its per-rank method, run on
    a stand-in for the schedule object: building the real one needs pipeline stages)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

    graph = TaskGraph(P, 2, M, split_backward=True, placement=v_shape(P))
    letter = {Phase.F: "F", Phase.B: "I", Phase.W: "W"}
    schedule = SimpleNamespace(pp_group_size=P, _n_microbatches=M, num_stages=2 * P)
    for rank in range(P):
        theirs = [repr(action) for action in
                  ScheduleZBVZeroBubble._calculate_single_rank_operations(schedule, rank)
                  if action is not None]
        ours = static_orders.zbv_order(P, rank, M, range(M), graph.task_table, weight_grads=True)
        assert [f"{graph.virtual_stage(rank, t.chunk)}{letter[t.phase]}{t.microbatch}"
                for t in ours] == theirs


def test_zbv_split_makespan_is_0_868_of_fused_1f1b_at_p4_m16_with_uniform_f_b_w():
    """The issue's figure, in the simulator's default cost model (a rank's forward takes 1, its
    backward 2, its model cut into V chunks; a split backward is half B, half W):
    1f1b: V=1, fused backward, F=1 and B=2 per rank: (M + P - 1) * 3 = 57;
    zb-v: the v placement, split backward, F = B = W = 0.5 per chunk: M * 3 + (P - 1) * 0.5 = 49.5.
    Both without message delays; 49.5 / 57 = 0.868."""
    P, M = 4, 16
    one_f_one_b = simulate(TaskGraph(P, 1, M), "1f1b")
    zbv = simulate(TaskGraph(P, 2, M, split_backward=True, placement=v_shape(P)), "zb-v")
    assert one_f_one_b.makespan == pytest.approx(57.0)
    assert zbv.makespan == pytest.approx(49.5)
    assert zbv.makespan / one_f_one_b.makespan == pytest.approx(0.868, abs=5e-4)
    assert zbv.makespan == pytest.approx(zbv.pipeline_bound)  # no bubble beyond the fill


def test_adaptive_on_a_v_graph_with_equal_sizes_runs_zbvs_order():
    graph = TaskGraph(4, 2, 16, placement=v_shape(4))
    adaptive, zbv = simulate(graph, "dpp:adaptive"), simulate(graph, "zb-v")
    assert adaptive.makespan == pytest.approx(zbv.makespan)
    for rank in range(4):
        scheduler = make_scheduler("zb-v", graph, rank)
        assert [task for r, task, _, _ in adaptive.timeline if r == rank] == scheduler.order
        # The default budget on the v placement is what ZB-V's order holds there.
        assert scheduler.budget_bytes == static_orders.peak_inflight_forwards(scheduler.order) * graph.max_act_bytes


def test_the_turn_of_the_v_costs_no_transfer():
    """P=2, one microbatch, messages take 1: stage 1 (rank 1, chunk 0) hands its forward to stage 2
    (rank 1, chunk 1) and stage 2 its gradient back to stage 1 at once; the other hops pay 1."""
    graph = TaskGraph(2, 2, 1, placement=v_shape(2))
    result = simulate(graph, "zb-v", comm_model=CommModel(latency=1.0))
    span = {(rank, str(task)): (start, end) for rank, task, start, end in result.timeline}
    assert span[(0, "F0.0")] == (0.0, 0.5)
    assert span[(1, "F0.0")] == (1.5, 2.0)  # one hop
    assert span[(1, "F0.1")] == (2.0, 2.5)  # the turn: no hop
    assert span[(0, "F0.1")] == (3.5, 4.0)  # one hop back to rank 0, the last stage
    assert span[(0, "B0.1")] == (4.0, 5.0)  # the loss makes its own gradient
    assert span[(1, "B0.1")] == (6.0, 7.0)
    assert span[(1, "B0.0")] == (7.0, 8.0)  # the turn again: no hop
    assert span[(0, "B0.0")] == (9.0, 10.0)


# --- the runtime's gradient-sync order -------------------------------------------------------------

class _ChunkSync:
    def __init__(self, chunk, log):
        self.chunk, self.log = chunk, log

    def no_sync(self):
        import contextlib
        return contextlib.nullcontext()

    def start_grad_sync(self, *_):
        self.log.append(self.chunk)

    def parameters(self):
        return iter(())


def test_grad_sync_launches_in_the_placements_deepest_first_order():
    import argparse

    from megatron_dpp.runtime.grad_sync import GradSync

    log = []
    chunks = [_ChunkSync(c, log) for c in range(2)]
    config = argparse.Namespace(no_sync_func=[c.no_sync for c in chunks],
                                grad_sync_func=[c.start_grad_sync for c in chunks])
    order = v_shape(4).chunks_deepest_first(0)
    assert order == (1, 0)
    sync = GradSync(config, chunks, forward_only=False, launch_order=order)
    sync.disable()
    sync.after_weight_grad(0, True)  # chunk 0's last W first: it waits for the deeper chunk 1
    assert log == []
    sync.after_weight_grad(1, True)
    assert log == [1, 0]
    with pytest.raises(ValueError, match="must order the 2 chunks"):
        GradSync(config, chunks, forward_only=False, launch_order=(0, 0))


# --- random pipelines on the V placement -----------------------------------------------------------

# SCHED_PROPERTY_EXAMPLES=N: N random cases per property, as in tests/test_sched_properties.py.
V_SETTINGS = settings(max_examples=int(os.environ.get("SCHED_PROPERTY_EXAMPLES", "30")), deadline=None,
                      suppress_health_check=[HealthCheck.too_slow])


@st.composite
def v_pipelines(draw, equal_sizes=False, split=None):
    P = draw(st.integers(2, 6))
    M = draw(st.integers(1, 32))
    sizes = [100] * M if equal_sizes else draw(st.lists(st.integers(1, 400), min_size=M, max_size=M))
    headroom = 0 if equal_sizes else draw(st.integers(0, 400))
    split = draw(st.booleans()) if split is None else split
    graph = TaskGraph(P, 2, M, sizes, max_act_bytes=max(sizes) + headroom, split_backward=split,
                      placement=v_shape(P))
    model = DurationModel(jitter_sigma=draw(st.sampled_from([0.0, 0.3])),
                          backward_ratio=draw(st.sampled_from([1.0, 2.0, 3.0])),
                          rank_speed=draw(st.lists(st.floats(0.5, 2.0), min_size=P, max_size=P)))
    comm = CommModel(latency=draw(st.sampled_from([0.0, 5.0])))
    return graph, model, comm, draw(st.integers(0, 2**16))


@pytest.mark.timeout(240)
@V_SETTINGS
@given(case=v_pipelines(), policy=st.sampled_from(DYNAMIC_SCHEDULES + ("gpipe", "zb-v")), data=st.data())
def test_v_graphs_finish_with_every_dependency_and_budget_kept(case, policy, data):
    graph, model, comm, seed = case
    minimum = graph.V * graph.max_act_bytes
    explicit = policy.startswith("dpp:") and policy != "dpp:adaptive"
    budget = data.draw(st.one_of(st.none(), st.integers(minimum, 3 * minimum)), label="budget") \
        if explicit else None
    result = simulate(graph, policy, model, comm, seed=seed, budget_bytes=budget)
    check_timeline(graph, result, comm)
    if policy != "gpipe":
        for rank in range(graph.P):
            expected = default_budget_bytes(graph, rank) if budget is None else budget
            assert result.budget_bytes[rank] == expected
            assert result.peak_bytes[rank] <= expected


@pytest.mark.timeout(240)
@V_SETTINGS
@given(case=v_pipelines(equal_sizes=True, split=False))
def test_adaptive_on_v_graphs_with_equal_microbatches_is_zbv(case):
    graph, model, comm, seed = case
    zbv = simulate(graph, "zb-v", model, comm, seed=seed)
    adaptive = simulate(graph, "dpp:adaptive", model, comm, seed=seed)
    assert adaptive.makespan == pytest.approx(zbv.makespan)
