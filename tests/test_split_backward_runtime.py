"""--dpp-split-backward in the runtime, in one process (tests/_runtime_harness.py): B and W tasks
on the toy pipeline (its linear defers its weight gradient), the flag's checks, and the gradient
sync's launch order. Each test takes about a second; test_dpp_split_parity.py covers the real GPT."""
import argparse
import contextlib

import pytest
import torch

from _runtime_harness import reference_grads, run_pipeline
from megatron_dpp.pipeline import Phase, Task
from megatron_dpp.runtime.grad_sync import GradSync

SIZES = [3, 1, 4, 1, 5, 9, 2, 6]
LAYOUTS = [(2, 1, "dpp:adaptive"), (4, 1, "dpp:adaptive"), (2, 2, "dpp:adaptive"),
           (4, 1, "1f1b"), (2, 2, "interleaved-1f1b"), (2, 1, "1f1b-sorted"),
           (4, 2, "dpp:greedy"), (2, 2, "dpp:depth-first"), (2, 1, "gpipe")]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("P,V,policy", LAYOUTS)
def test_weight_grad_tasks_give_the_unpipelined_gradients(P, V, policy):
    result = run_pipeline(P, V, SIZES, policy, split_backward=True)
    assert not result.errors, result.errors
    grads, losses = reference_grads(P, V, SIZES)
    for stage, grad in grads.items():
        torch.testing.assert_close(result.grads[stage], grad, rtol=1e-5, atol=1e-6)
    assert result.losses == pytest.approx(losses, rel=1e-6)
    for rank, record in result.records.items():
        tasks = record.tasks
        assert len(tasks) == len(set(tasks)) == 3 * V * len(SIZES)  # every F, B and W once
        position = {task: i for i, task in enumerate(tasks)}
        for task in tasks:
            if task.phase is Phase.W:  # a W never runs before its B, nor a B before its F
                backward = task._replace(phase=Phase.B)
                assert position[backward] < position[task], (rank, task)
                assert position[backward._replace(phase=Phase.F)] < position[backward]
        assert result.stashes[rank].keys() == []  # every W drained its work
        assert str(Task(Phase.W, 3, 1)) == "W3.1" and Phase.W.label == "weight-grad"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["dpp:adaptive", "dpp:greedy", "dpp:breadth-first"])
def test_the_budget_holds_with_the_stash(policy):
    """An explicit budget of three largest microbatches (stash included) per rank: the scheduler's
    held bytes stay within it, and what the stash measurably holds per microbatch is what the
    budget counts for it."""
    P, V = 4, 1
    largest = max(SIZES) * (100 + 32)  # BYTES_PER_TOKEN + the toy's stash per token
    result = run_pipeline(P, V, SIZES, policy, split_backward=True, budget_bytes=3 * largest)
    assert not result.errors, result.errors
    for record in result.records.values():
        assert record.budget_bytes == 3 * largest
        assert 0 < record.peak_held_bytes <= record.budget_bytes
        stash = record.split_backward
        assert stash.weight_grad_bytes_estimated == [32 * s for s in SIZES]
        assert len(stash.weight_grad_bytes_measured) == len(SIZES) * V
        for (m, _chunk), measured in stash.weight_grad_bytes_measured.items():
            assert 0 < measured <= stash.weight_grad_bytes_estimated[m]
        assert 0 < stash.peak_stash_bytes <= record.peak_held_bytes


@pytest.mark.timeout(60)
def test_tensor_parallel_followers_run_the_leaders_weight_grads():
    result = run_pipeline(2, 2, SIZES, "dpp:adaptive", tp=2, split_backward=True)
    assert not result.errors, result.errors
    for stage in range(2):
        assert result.records[2 * stage + 1].tasks == result.records[2 * stage].tasks
        assert any(t.phase is Phase.W for t in result.records[2 * stage].tasks)


@pytest.mark.timeout(60)
def test_a_failed_iteration_discards_the_stash():
    """A W that fails (here: the first W of rank 1) ends the iteration with its error, and the
    stash is emptied so that the next iteration does not find stale work."""

    def fail_in_weight_grad(rank, runner):
        if rank != 1:
            runner.run()
            return
        handler = runner.handlers[Phase.W]

        def broken(task):
            raise RuntimeError(f"W failed: {task}")

        handler.run = broken
        try:
            runner.run()
        finally:
            stashes[rank] = runner.session.stash

    stashes = {}
    result = run_pipeline(2, 1, SIZES, "1f1b", split_backward=True, timeout_s=2.0,
                          rank_fn=fail_in_weight_grad)
    assert "W failed" in str(result.errors[1])
    assert stashes[1].keys() == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("P,V", [(2, 2), (4, 1)])
def test_the_runtime_runs_the_policy_object_the_simulator_builds(P, V, monkeypatch):
    """Issue 15: one policy object for both executors. The runtime and the simulator both get
    the rank's scheduler from the pipeline core's make_scheduler; replaying what the runtime's
    dpp:adaptive saw (ready sets, starts, finishes) through a fresh make_scheduler gives the same
    decision every time, W tasks included."""
    from megatron_dpp.pipeline import make_scheduler, registry
    from megatron_dpp.pipeline.adaptive import AdaptiveScheduler
    from megatron_dpp.runtime import executor
    from megatron_dpp.sim import DurationModel, simulate, simulator

    assert executor.make_scheduler is registry.make_scheduler is simulator.make_scheduler
    made = {}

    def logged(name, graph, rank, budget_bytes=None, **opts):
        scheduler = make_scheduler(name, graph, rank, budget_bytes, **opts)
        log = []
        made[(id(graph), rank)] = (name, graph, rank, budget_bytes, opts, scheduler, log)
        decide, start, finish = scheduler.next_task, scheduler.on_start, scheduler.on_finish

        def next_task(ready):
            task = decide(ready)
            log.append(("next", frozenset(ready), task))
            return task

        scheduler.next_task = next_task
        scheduler.on_start = lambda task: (log.append(("start", task)), start(task))[1]
        scheduler.on_finish = lambda task: (log.append(("finish", task)), finish(task))[1]
        return scheduler

    monkeypatch.setattr(executor, "make_scheduler", logged)
    result = run_pipeline(P, V, SIZES, "dpp:adaptive", split_backward=True)
    assert not result.errors, result.errors
    runtime = [entry for entry in made.values()]
    assert sorted(entry[2] for entry in runtime) == list(range(P))
    monkeypatch.setattr(simulator, "make_scheduler", logged)
    graph = runtime[0][1]
    simulate(graph, "dpp:adaptive", DurationModel())
    simulated = [entry for entry in made.values() if entry[1] is graph and entry not in runtime]
    assert len(simulated) == P
    for entry in runtime + simulated:
        assert type(entry[5]) is AdaptiveScheduler and entry[5].name == "dpp:adaptive"
    deferred = 0
    for name, graph, rank, budget, opts, scheduler, log in runtime:
        assert [e[1] for e in log if e[0] == "start"] == result.records[rank].tasks
        replay = make_scheduler(name, graph, rank, budget, **opts)
        for event in log:
            if event[0] == "next":
                assert replay.next_task(event[1]) == event[2], (rank, event)
            else:
                getattr(replay, f"on_{event[0]}")(event[1])
        assert replay.done and replay.history == scheduler.history
        tasks = result.records[rank].tasks
        deferred += sum(1 for t, u in zip(tasks, tasks[1:]) if t.phase is Phase.B and u != t._replace(phase=Phase.W))
    assert deferred > 0  # some W ran later than right after its B


@pytest.mark.timeout(60)
def test_provisioned_lets_the_last_rank_run_ahead_within_its_budget():
    """--dpp-memory-budget provisioned in the runtime (P=4, V=1, split backwards, equal sizes):
    every rank gets rank 0's 'auto' budget, counted with the stash like 'auto'. The last rank
    starts late, so F0 and F1 are waiting: under 'auto' (one microbatch) W0 must run before F1;
    under 'provisioned' (four) F1 runs first, and the rank holds more than its 'auto' budget,
    within its own."""
    import time

    P, sizes = 4, [4] * 8
    unit = 4 * (100 + 32)  # the harness's activations + stash per token, for the longest sample
    runs = {}
    for budget in (None, "provisioned"):
        records = {}

        def late_last_rank(rank, runner, records=records):
            if rank == P - 1:
                time.sleep(0.3)
            runner.run()
            records[rank] = runner.record

        result = run_pipeline(P, 1, sizes, "dpp:adaptive", split_backward=True, budget_bytes=budget,
                              rank_fn=late_last_rank)
        assert not result.errors, result.errors
        runs[budget] = records
    auto, provisioned = runs[None], runs["provisioned"]
    assert [auto[r].budget_bytes for r in range(P)] == [4 * unit, 3 * unit, 2 * unit, unit]
    assert [provisioned[r].budget_bytes for r in range(P)] == [4 * unit] * P
    last = P - 1
    assert [str(t) for t in auto[last].tasks[:4]] == ["F0.0", "B0.0", "W0.0", "F1.0"]
    assert auto[last].peak_held_bytes == unit
    assert [str(t) for t in provisioned[last].tasks[:3]] == ["F0.0", "B0.0", "F1.0"]
    assert auto[last].budget_bytes < provisioned[last].peak_held_bytes <= provisioned[last].budget_bytes
    for records in runs.values():
        for record in records.values():
            assert 0 < record.peak_held_bytes <= record.budget_bytes
            assert 0 < record.split_backward.peak_stash_bytes <= record.peak_held_bytes


class _FakeChunkSync:
    """Records Megatron's protocol calls of one chunk."""

    def __init__(self, chunk, log):
        self.chunk, self.log = chunk, log

    @contextlib.contextmanager
    def no_sync(self):
        self.log.append(("no_sync", self.chunk))
        yield

    def start_grad_sync(self, *_):
        self.log.append(("launch", self.chunk))

    def parameters(self):
        return iter(())


@pytest.mark.timeout(10)
def test_reductions_start_in_chunk_order_whatever_order_the_last_ws_run():
    log = []
    chunks = [_FakeChunkSync(c, log) for c in range(3)]
    config = argparse.Namespace(no_sync_func=[c.no_sync for c in chunks],
                                grad_sync_func=[c.start_grad_sync for c in chunks])
    sync = GradSync(config, chunks, forward_only=False)
    sync.check_split_backward()
    sync.disable()
    launches = lambda: [c for kind, c in log if kind == "launch"]
    sync.before_weight_grad(0, True)
    sync.after_weight_grad(0, True)  # chunk 0 done first: it waits for chunks 2 and 1
    assert launches() == []
    sync.before_weight_grad(2, True)
    sync.after_weight_grad(2, True)
    assert launches() == [2]
    sync.before_weight_grad(1, True)
    sync.after_weight_grad(1, True)
    assert launches() == [2, 1, 0]
    sync.finish()
    assert launches() == [2, 1, 0]


def test_overlap_without_grad_sync_func_is_refused_with_split():
    model = torch.nn.Linear(1, 1)
    model.ddp_config = argparse.Namespace(overlap_grad_reduce=True)
    config = argparse.Namespace(no_sync_func=None, grad_sync_func=None)
    with pytest.raises(ValueError, match="grad_sync_func"):
        GradSync(config, [model], forward_only=False).check_split_backward()
    GradSync(config, [model], forward_only=False)  # the fused backward takes any order


def _dpp_args(sequence_parallel=False, **overrides):
    from megatron_dpp.parallel.layout import ParallelLayout

    values = dict(use_dpp=True, dpp_policy="dpp:adaptive", dpp_memory_budget="auto",
                  dpp_timeout=30.0, dpp_stage_placement="interleaved", dpp_schedule=None,
                  pipeline_model_parallel_size=2, context_parallel_size=1,
                  dpp_split_backward=True, use_flash_attn=False, attention_backend="auto",
                  parallel=ParallelLayout(sequence_parallel=sequence_parallel))
    values.update(overrides)
    return argparse.Namespace(**values)


@pytest.mark.parametrize("overrides,message", [
    ({"use_dpp": False}, "--dpp-split-backward splits the backward of the DPP runtime; add --use-dpp"),
    ({"sequence_parallel": True}, "--dpp-split-backward does not support --sequence-parallel"),
    ({"attention_backend": "flash"}, "drop --attention-backend flash or --dpp-split-backward"),
])
def test_split_backward_flag_errors_are_one_line(overrides, message):
    from megatron_dpp.arguments import ArgsError
    from megatron_dpp.runtime.flags import validate_dpp_args

    validate_dpp_args(_dpp_args(), minimum_budget_bytes=None)  # (no model here: no minimum)
    with pytest.raises(ArgsError, match=message) as error:
        validate_dpp_args(_dpp_args(**overrides), minimum_budget_bytes=None)
    assert "\n" not in str(error.value)
