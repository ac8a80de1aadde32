"""Property tests over random pipelines, with fused and split (W) backwards: every schedule
completes, respects every dependency and its budget; with equal microbatches dpp:adaptive is never
slower than Megatron's order.

SCHED_PROPERTY_EXAMPLES=N raises the number of random cases per property (default 60) for a deep
run, e.g. SCHED_PROPERTY_EXAMPLES=3000 (see docs/results.md for the last deep run).
"""
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _sched_util import check_timeline, peak_inflight
from megatron_dpp.pipeline import DYNAMIC_SCHEDULES, TaskGraph, default_budget_bytes
from megatron_dpp.sim import CommModel, DurationModel, simulate

EXAMPLES = int(os.environ.get("SCHED_PROPERTY_EXAMPLES", "60"))
TIMEOUT = max(240, EXAMPLES)  # a deep run gets a second per case
SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=False, suppress_health_check=[HealthCheck.too_slow]
)


@st.composite
def pipelines(draw, equal_sizes=False, megatron_valid=False):
    P = draw(st.integers(1, 8))
    V = draw(st.integers(1, 4))
    if megatron_valid and V > 1:
        M = P * draw(st.integers(1, max(1, 64 // P)))
    else:
        M = draw(st.integers(1, 64))
    if equal_sizes:
        sizes = [100.0] * M
    else:
        sizes = draw(st.lists(st.integers(1, 400), min_size=M, max_size=M))
    # Budgets provisioned above this batch's largest microbatch (max_act_bytes headroom); not for
    # equal sizes, where the claim is about the default budget of exactly that batch.
    headroom = 0 if equal_sizes else draw(st.integers(0, 400))
    split = draw(st.booleans())
    graph = TaskGraph(P, V, M, sizes, max_act_bytes=max(sizes) + headroom, split_backward=split)
    model = DurationModel(
        weight_grad_fraction=draw(st.sampled_from([0.3, 0.5, 0.7])),
        backward_ratio=draw(st.sampled_from([1.0, 2.0, 3.0])),
        quadratic=draw(st.sampled_from([0.0, 0.002])),
        jitter_sigma=draw(st.sampled_from([0.0, 0.3])),
        straggler_prob=draw(st.sampled_from([0.0, 0.1])),
        straggler_factor=3.0,
        straggler_scope=draw(st.sampled_from(["task", "rank"])),
        rank_speed=draw(st.lists(st.floats(0.5, 2.0), min_size=P, max_size=P)),
    )
    comm = CommModel(latency=draw(st.sampled_from([0.0, 5.0])), bandwidth=draw(st.sampled_from([float("inf"), 50.0])))
    return graph, model, comm, draw(st.integers(0, 2**16))


@pytest.mark.timeout(TIMEOUT)
@SETTINGS
@given(case=pipelines(), policy=st.sampled_from(DYNAMIC_SCHEDULES), data=st.data())
def test_dynamic_policies_finish_within_any_feasible_budget(case, policy, data):
    graph, model, comm, seed = case
    minimum = graph.V * graph.max_act_bytes
    budget = data.draw(
        st.one_of(st.none(), st.integers(minimum, 3 * minimum), st.just(minimum)), label="budget"
    )
    result = simulate(graph, policy, model, comm, seed=seed, budget_bytes=budget)
    check_timeline(graph, result, comm)
    for rank in range(graph.P):
        expected = default_budget_bytes(graph, rank) if budget is None else budget
        assert result.budget_bytes[rank] == expected
        assert result.peak_bytes[rank] <= expected


@pytest.mark.timeout(TIMEOUT)
@SETTINGS
@given(case=pipelines(), policy=st.sampled_from(DYNAMIC_SCHEDULES), data=st.data())
def test_dynamic_policies_respect_a_count_cap(case, policy, data):
    graph, model, comm, seed = case
    cap = data.draw(st.integers(graph.V, 4 * graph.V * graph.P), label="max_inflight")
    result = simulate(graph, policy, model, comm, seed=seed, max_inflight=cap)
    check_timeline(graph, result, comm)
    for rank in range(graph.P):
        assert peak_inflight(result, rank) <= cap


@pytest.mark.timeout(TIMEOUT)
@SETTINGS
@given(case=pipelines(megatron_valid=True), name=st.sampled_from(["megatron", "1f1b-sorted", "gpipe"]))
def test_static_orders_finish_and_megatron_fits_default_budget(case, name):
    graph, model, comm, seed = case
    if name == "megatron":
        name = "1f1b" if graph.V == 1 else "interleaved-1f1b"
    result = simulate(graph, name, model, comm, seed=seed)
    check_timeline(graph, result, comm)
    if name != "gpipe":
        assert all(p <= b for p, b in zip(result.peak_bytes, result.budget_bytes))


@pytest.mark.timeout(TIMEOUT)
@SETTINGS
@given(case=pipelines(equal_sizes=True, megatron_valid=True))
def test_adaptive_never_slower_than_megatron_with_equal_microbatches(case):
    graph, model, comm, seed = case
    megatron = "1f1b" if graph.V == 1 else "interleaved-1f1b"
    reference = simulate(graph, megatron, model, comm, seed=seed)
    adaptive = simulate(graph, "dpp:adaptive", model, comm, seed=seed)
    assert adaptive.makespan <= reference.makespan * (1 + 1e-9)
