"""The DPP executor in one process (tests/_runtime_harness.py): P ranks on threads over the
in-memory transport, a toy model, Megatron-Core's own forward_step and backward_step. Each test
takes well under a second; the multi-process parity tests (test_dpp_parity.py) cover the real GPT."""
import gc
import time

import pytest
import torch

from _runtime_harness import BYTES_PER_TOKEN, reference_grads, run_pipeline
from megatron_dpp.pipeline import Phase, TaskGraph, make_scheduler
from megatron_dpp.pipeline.registry import ADAPTIVE_FALLBACK_STRATEGY
from megatron_dpp.runtime.executor import DPPFailure

SIZES = [3, 1, 4, 1, 5, 9, 2, 6]
POLICIES_V1 = ["dpp:adaptive", "dpp:breadth-first", "dpp:depth-first", "dpp:greedy", "1f1b",
               "1f1b-sorted", "gpipe"]
POLICIES_V2 = ["dpp:adaptive", "dpp:breadth-first", "dpp:depth-first", "dpp:greedy",
               "interleaved-1f1b", "1f1b-sorted", "gpipe"]


def _assert_matches_reference(result, P, V, sizes):
    assert not result.errors, result.errors
    grads, losses = reference_grads(P, V, sizes)
    assert sorted(result.grads) == sorted(grads)
    for stage, grad in grads.items():
        torch.testing.assert_close(result.grads[stage], grad, rtol=1e-5, atol=1e-6)
    assert result.losses == pytest.approx(losses, rel=1e-6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("P,V,policies", [(2, 1, POLICIES_V1), (4, 1, POLICIES_V1),
                                          (2, 2, POLICIES_V2), (3, 2, POLICIES_V2)])
def test_every_policy_computes_the_unpipelined_gradients(P, V, policies):
    sizes = SIZES if P != 3 else SIZES[:6]  # interleaving needs M to be a multiple of P
    for policy in policies:
        _assert_matches_reference(run_pipeline(P, V, sizes, policy), P, V, sizes)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("split_backward", [False, True], ids=["fused", "split"])
def test_the_v_placement_computes_the_unpipelined_gradients_handing_the_turn_over(P, split_backward):
    # Per microbatch the forward crosses 2P-1 stage boundaries and so does the backward; the one
    # at the V's turn (stages P-1 and P, both on rank P-1) is handed over on the rank, not sent.
    for policy in ("dpp:adaptive", "zb-v", "gpipe", "dpp:greedy"):
        result = run_pipeline(P, 2, SIZES, policy, split_backward=split_backward, placement="v")
        _assert_matches_reference(result, P, 2, SIZES)
        assert result.hub.delivered == 2 * (2 * P - 2) * len(SIZES), policy
    interleaved = run_pipeline(P, 2, SIZES[:6] if P == 3 else SIZES, "dpp:adaptive",
                               split_backward=split_backward)
    assert interleaved.hub.delivered == 2 * (2 * P - 1) * len(SIZES[:6] if P == 3 else SIZES)


@pytest.mark.timeout(30)
def test_tensor_parallel_followers_run_the_leaders_decisions():
    result = run_pipeline(2, 2, SIZES, "dpp:adaptive", tp=2)
    _assert_matches_reference(result, 2, 2, SIZES)
    for stage in range(2):
        leader, follower = result.records[2 * stage], result.records[2 * stage + 1]
        assert follower.tasks == leader.tasks


@pytest.mark.timeout(30)
def test_a_static_order_runs_exactly_as_listed():
    result = run_pipeline(4, 1, SIZES, "1f1b")
    graph = TaskGraph(4, 1, len(SIZES), SIZES, [s * BYTES_PER_TOKEN for s in SIZES],
                      max_act_bytes=max(SIZES) * BYTES_PER_TOKEN)
    for rank in range(4):
        assert result.records[rank].tasks == make_scheduler("1f1b", graph, rank).order


@pytest.mark.timeout(30)
@pytest.mark.parametrize("policy", ["dpp:adaptive", "dpp:greedy"])
def test_every_task_runs_once_and_only_when_ready(policy):
    result = run_pipeline(4, 2, SIZES, policy)
    assert not result.errors, result.errors
    for rank, record in result.records.items():
        tasks = record.tasks
        assert len(tasks) == len(set(tasks)) == 2 * 2 * len(SIZES)
        position = {task: i for i, task in enumerate(tasks)}
        for task in tasks:
            if task.phase is Phase.B:  # the ready rule: a backward after its own forward
                assert position[task._replace(phase=Phase.F)] < position[task]
        # Same clock for every thread: a forward that reads a message starts after the forward
        # that sends it started (it posts the message before its end is recorded).
        if rank > 0:
            upstream = result.records[rank - 1]
            for task in tasks:
                if task.phase is Phase.F:
                    sender_started = upstream.task_started[upstream.tasks.index(task)]
                    assert record.task_started[position[task]] >= sender_started


@pytest.mark.timeout(30)
def test_the_budget_bounds_what_a_rank_holds():
    largest = max(SIZES) * BYTES_PER_TOKEN
    budget = 2 * largest  # V * largest: the least a dynamic policy accepts for V=2
    result = run_pipeline(2, 2, SIZES, "dpp:greedy", budget_bytes=budget)
    _assert_matches_reference(result, 2, 2, SIZES)
    for record in result.records.values():
        assert record.budget_bytes == budget
        assert 0 < record.peak_held_bytes <= budget
    with_default = run_pipeline(2, 2, SIZES, "dpp:greedy")
    assert max(r.peak_held_bytes for r in with_default.records.values()) > budget


@pytest.mark.timeout(30)
def test_a_budget_below_the_minimum_is_refused_before_anything_runs():
    result = run_pipeline(2, 2, SIZES, "dpp:greedy", budget_bytes=max(SIZES) * BYTES_PER_TOKEN)
    assert set(result.errors) == {0, 1}
    assert all("below the minimum" in str(error) for error in result.errors.values())


@pytest.mark.timeout(30)
def test_adaptive_fallback_keeps_the_chosen_name_and_says_how_it_runs():
    # V=2 with an explicit budget the interleaved spines do not fit: reservation admission.
    budget = 2 * max(SIZES) * BYTES_PER_TOKEN
    result = run_pipeline(2, 2, SIZES, "dpp:adaptive", budget_bytes=budget)
    _assert_matches_reference(result, 2, 2, SIZES)
    for record in result.records.values():
        assert record.policy == "dpp:adaptive"
        assert record.strategy == ADAPTIVE_FALLBACK_STRATEGY
    assert all(r.strategy is None for r in run_pipeline(2, 2, SIZES, "dpp:adaptive").records.values())


@pytest.mark.timeout(30)
def test_received_tensors_are_released():
    """shm_tensor lends a slot to each received tensor until it is freed: the runtime must drop
    every input once its task ran, and inputs kept for a backward once the backward ran."""
    kept = {}

    def run_and_inspect(rank, runner):
        runner.run()
        kept[rank] = (dict(runner.arrived), dict(runner.saved))

    result = run_pipeline(3, 2, SIZES[:6], "dpp:adaptive", rank_fn=run_and_inspect)
    assert not result.errors, result.errors
    assert kept == {rank: ({}, {}) for rank in range(3)}
    gc.collect()
    assert result.hub.received_alive() == 0


@pytest.mark.timeout(30)
def test_forward_only_runs_no_backward():
    result = run_pipeline(2, 2, SIZES, "dpp:adaptive", forward_only=True)
    assert not result.errors, result.errors
    for record in result.records.values():
        assert {task.phase for task in record.tasks} == {Phase.F}
    assert result.grads == {}
    _, losses = reference_grads(2, 2, SIZES)
    assert result.losses == pytest.approx(losses, rel=1e-6)


@pytest.mark.timeout(30)
def test_a_silent_peer_ends_the_iteration_with_the_rank_state():
    started = time.monotonic()
    result = run_pipeline(2, 1, SIZES, "dpp:adaptive", timeout_s=0.3,
                          rank_fn=lambda rank, runner: runner.run() if rank == 1 else None)
    assert time.monotonic() - started < 5
    error = result.errors[1]
    assert isinstance(error, DPPFailure)
    assert "no progress for 0.3 s" in error.reason and not error.lost_peer
    state = "\n".join(error.state_lines)
    assert "pipeline rank 1/2" in state and "awaited (peer, tag) -> task" in state
    assert "-> F" in state  # it names the forwards whose activations never came


@pytest.mark.timeout(30)
def test_a_lost_peer_ends_the_iteration_at_once():
    def lose_rank_0(rank, runner):
        if rank == 0:
            runner.transport.hub.lost(0)
            return
        runner.run()

    started = time.monotonic()
    result = run_pipeline(2, 1, SIZES, "dpp:adaptive", timeout_s=20, rank_fn=lose_rank_0)
    assert time.monotonic() - started < 5  # well before the 20 s deadline
    error = result.errors[1]
    assert isinstance(error, DPPFailure) and "peer 0 was lost" in error.reason
    assert error.lost_peer  # exit code LOST_PEER, not the stall's
