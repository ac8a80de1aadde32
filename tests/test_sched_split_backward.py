"""Split backwards (B + W tasks): the graph, the simulator's timing and memory, and the policies."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from _sched_util import check_timeline
from megatron_dpp.pipeline import Phase, Task, TaskGraph, make_scheduler
from megatron_dpp.pipeline import static_orders
from megatron_dpp.sim import CommModel, DurationModel, simulate

REPO = Path(__file__).resolve().parents[1]


def test_split_graph_has_local_weight_grad_tasks():
    g = TaskGraph(2, 2, 3, split_backward=True)
    tasks = g.tasks(0)
    assert len(tasks) == 3 * 2 * 3 and sum(t.phase == Phase.W for t in tasks) == 6
    w = Task(Phase.W, 1, 0)
    assert g.input_source(0, w) is None and g.output_target(0, w) is None
    # B still crosses ranks exactly as a fused backward does.
    assert g.input_source(0, Task(Phase.B, 1, 0)) == (1, Task(Phase.B, 1, 0))
    assert g.release_phase == Phase.W and TaskGraph(2, 2, 3).release_phase == Phase.B
    assert g.task_table[Phase.W][1][2] == Task(Phase.W, 2, 1)
    assert "split_backward=True" in repr(g)


def test_static_orders_run_each_w_right_after_its_b():
    g = TaskGraph(4, 2, 8, split_backward=True)
    for rank in range(4):
        order = make_scheduler("interleaved-1f1b", g, rank).order
        fused = make_scheduler("interleaved-1f1b", TaskGraph(4, 2, 8), rank).order
        assert [t for t in order if t.phase != Phase.W] == fused
        for task, following in zip(order, order[1:]):
            if task.phase == Phase.B:
                assert following == Task(Phase.W, task.microbatch, task.chunk)
        # The same in-flight count: memory is released at W, right after B.
        assert static_orders.peak_inflight_forwards(order) == static_orders.peak_inflight_forwards(fused)


def test_gradient_leaves_after_b_not_after_w():
    # P=2, one microbatch, F=1, B=W=1. Fused: F F BB BB = 6. Split: rank 0's B starts when rank 1's
    # B ends (t=3), while rank 1 runs its W; rank 0's W ends at 5.
    fused = simulate(TaskGraph(2, 1, 1, sizes=[1.0]), "1f1b")
    split_graph = TaskGraph(2, 1, 1, sizes=[1.0], split_backward=True)
    for name in ("1f1b", "dpp:adaptive", "dpp:greedy"):
        split = simulate(split_graph, name)
        assert fused.makespan == pytest.approx(6.0)
        assert split.makespan == pytest.approx(5.0), name
        spans = {(rank, str(task)): (start, end) for rank, task, start, end in split.timeline}
        assert spans[(1, "B0.0")] == pytest.approx((2.0, 3.0))
        assert spans[(0, "B0.0")] == pytest.approx((3.0, 4.0))
        assert spans[(1, "W0.0")] == pytest.approx((3.0, 4.0))
        assert spans[(0, "W0.0")] == pytest.approx((4.0, 5.0))


def test_duration_model_splits_each_backward_draw():
    sizes = np.random.default_rng(0).lognormal(0, 0.5, 8) * 100
    model = DurationModel(jitter_sigma=0.3, straggler_prob=0.2, straggler_factor=2.0, weight_grad_fraction=0.3)
    fused = model.sample(TaskGraph(3, 2, 8, sizes), np.random.default_rng(7))
    split = model.sample(TaskGraph(3, 2, 8, sizes, split_backward=True), np.random.default_rng(7))
    for rank in range(3):
        assert split.rank_work(rank) == pytest.approx(fused.rank_work(rank))
        for m in range(8):
            backward = fused(rank, Task(Phase.B, m, 1))
            assert split(rank, Task(Phase.B, m, 1)) == pytest.approx(0.7 * backward)
            assert split(rank, Task(Phase.W, m, 1)) == pytest.approx(0.3 * backward)
            assert split(rank, Task(Phase.F, m, 1)) == fused(rank, Task(Phase.F, m, 1))
    with pytest.raises(ValueError, match="weight_grad_fraction"):
        DurationModel(weight_grad_fraction=1.0)


def test_memory_is_held_until_w_ends():
    # Greedy runs W right after B, so the peak equals the fused run's; a run that never executed
    # W would free nothing and the bookkeeping would end non-zero.
    g = TaskGraph(3, 1, 6, sizes=[100.0] * 6, split_backward=True)
    for name in ("1f1b", "dpp:adaptive", "dpp:greedy"):
        schedulers = []

        def factory(graph, rank, name=name):
            schedulers.append(make_scheduler(name, graph, rank))
            return schedulers[-1]

        result = simulate(g, factory)
        assert all(s.held_bytes == 0 and s.done for s in schedulers)
        assert result.peak_bytes == [300, 200, 100]


def test_adaptive_defers_w_into_waits_and_stays_in_budget():
    rng = np.random.default_rng(3)
    deferred = 0
    for seed, (P, V, M) in enumerate([(4, 2, 16), (4, 1, 16), (8, 2, 16), (3, 3, 9)]):
        sizes = rng.lognormal(0, 0.5, M) * 1000
        g = TaskGraph(P, V, M, sizes, split_backward=True)
        megatron = simulate(g, "1f1b" if V == 1 else "interleaved-1f1b", seed=seed)
        result = simulate(g, "dpp:adaptive", DurationModel(), CommModel(latency=1.0), seed=seed)
        check_timeline(g, result, CommModel(latency=1.0))
        assert all(p <= b for p, b in zip(result.peak_bytes, result.budget_bytes))
        runs = {}
        for rank, task, start, end in result.timeline:
            runs.setdefault(rank, []).append((start, task))
        for rank, spans in runs.items():
            order = [task for _, task in sorted(spans)]
            deferred += sum(1 for t, u in zip(order, order[1:]) if t.phase == Phase.B and u.phase != Phase.W)
        fused = simulate(TaskGraph(P, V, M, sizes), "dpp:adaptive", seed=seed)
        assert result.makespan < fused.makespan
        assert megatron.makespan > 0
    assert deferred > 0


def test_pipeline_bound_with_split_backwards_is_a_lower_bound():
    rng = np.random.default_rng(11)
    for P, V, M in [(4, 1, 8), (4, 2, 8), (2, 2, 4), (6, 1, 12)]:
        g = TaskGraph(P, V, M, sizes=rng.lognormal(0, 0.5, M) * 100, split_backward=True)
        for name in ("gpipe", "dpp:adaptive", "dpp:greedy", "1f1b" if V == 1 else "interleaved-1f1b"):
            r = simulate(g, name, DurationModel(jitter_sigma=0.3), CommModel(latency=2.0), seed=4)
            assert r.lower_bound <= r.pipeline_bound <= r.makespan + 1e-9, (P, V, M, name)
    # One microbatch on two ranks (test_gradient_leaves_after_b_not_after_w): the bound is tight.
    r = simulate(TaskGraph(2, 1, 1, sizes=[1.0], split_backward=True), "1f1b")
    assert r.pipeline_bound == pytest.approx(r.makespan)


def test_chrome_trace_names_weight_grad_tasks():
    r = simulate(TaskGraph(2, 1, 2, split_backward=True), "dpp:adaptive")
    categories = {e.get("cat") for e in r.to_chrome_trace()["traceEvents"]}
    assert {"forward", "backward", "weight-grad"} <= categories


@pytest.mark.timeout(300)
def test_benchmark_reports_split_rows(tmp_path):
    out = tmp_path / "sim.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "schedule_sim.py"), "--P", "4", "--V", "2", "--M", "8",
         "--seeds", "2", "--scenarios", "varlen", "--weight-grad-fraction", "0.4", "--budgets", "auto",
         "provisioned", "--json", str(out)],
        capture_output=True, text=True, timeout=280, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Split backwards (+W)" in proc.stdout and "dpp:adaptive+W / interleaved-1f1b" in proc.stdout
    data = json.loads(out.read_text())
    assert data["config"]["weight_grad_fraction"] == 0.4
    rows = {r["schedule"]: r for r in data["results"]}
    assert {"interleaved-1f1b+W", "1f1b-sorted+W", "dpp:adaptive+W"} <= set(rows)
    assert rows["dpp:adaptive+W"]["split_backward"] and not rows["dpp:adaptive"]["split_backward"]
    assert rows["dpp:adaptive+W"]["within_budget"]
    # --budgets: dpp:adaptive again under 'provisioned', fused and +W, in their own table.
    assert "dpp:adaptive under each budget" in proc.stdout
    for name in ("dpp:adaptive@provisioned", "dpp:adaptive+W@provisioned"):
        assert rows[name]["budget_mode"] == "provisioned" and rows[name]["within_budget"]
    assert rows["dpp:adaptive+W"]["budget_mode"] == "auto"
    assert rows["dpp:adaptive+W@provisioned"]["budget"] == rows["dpp:adaptive+W"]["budget"]  # rank 0's
    bad = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "schedule_sim.py"), "--quick", "--weight-grad-fraction", "1"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert bad.returncode == 2 and "--weight-grad-fraction 1" in bad.stderr


class _Rank:
    """One rank's scheduler driven by hand through the shared ReadyTracker, as both executors
    drive it: `arrive` a message, `expect` the policy's next decision and run it."""

    def __init__(self, graph, rank, budget=None):
        from megatron_dpp.pipeline import ReadyTracker

        self.scheduler = make_scheduler("dpp:adaptive", graph, rank, budget)
        self.tracker = ReadyTracker(graph, rank)

    def arrive(self, text):
        self.tracker.input_arrived(Task.parse(text))

    def decide(self):
        task = self.scheduler.next_task(self.tracker.ready)
        return None if task is None else str(task)

    def expect(self, *texts):
        for text in texts:
            assert self.decide() == text
            task = Task.parse(text)
            self.tracker.start(task)
            self.scheduler.on_start(task)
            self.tracker.finish(task)
            self.scheduler.on_finish(task)


def test_adaptive_runs_w_when_the_next_task_is_not_ready_or_the_budget_holds_a_forward():
    """Issue 15's rule for dpp:adaptive with split backwards, decision by decision (P=2, V=1,
    equal sizes of 10 bytes): a ready spine task that fits runs before queued W tasks; a W runs
    when the spine's next F or B has not arrived, or when its next forward does not fit because
    queued W tasks still hold memory."""
    g = TaskGraph(2, 1, 4, sizes=[10.0] * 4, split_backward=True)
    # Last rank, 'auto' (one microbatch): F1 has arrived, but W0 still holds B0's microbatch.
    last = _Rank(g, 1)
    last.arrive("F0.0")
    last.arrive("F1.0")
    last.expect("F0.0", "B0.0")
    assert last.scheduler.held_bytes == 10 and last.decide() == "W0.0"  # the budget holds F1 back
    last.expect("W0.0", "F1.0", "B1.0")
    assert last.decide() == "W1.0"  # F2 has not arrived: fill the wait
    last.expect("W1.0")
    assert last.decide() is None  # nothing ready: wait for F2
    # Last rank, 'provisioned' (two microbatches, rank 0's count): F1 fits beside W0's memory, so
    # it runs first and the W waits for a gap.
    ahead = _Rank(g, 1, "provisioned")
    assert ahead.scheduler.budget_bytes == 20
    ahead.arrive("F0.0")
    ahead.arrive("F1.0")
    ahead.expect("F0.0", "B0.0", "F1.0", "B1.0")
    assert ahead.scheduler.held_bytes == 20
    assert ahead.decide() == "W0.0"  # F2 has not arrived, and would not fit either
    ahead.expect("W0.0", "W1.0")
    # First rank with an explicit budget of three microbatches (one more than its spine needs):
    # when the next backward has not arrived, the queued W runs before the rank would wait.
    first = _Rank(g, 0, 30)
    first.expect("F0.0", "F1.0")
    first.arrive("B0.0")
    first.expect("B0.0", "F2.0")  # F2 fits beside W0: the spine goes first
    # B1 has not arrived, and W0's memory leaves no room for F3 as a deviation: W0.
    assert first.scheduler.held_bytes == 30 and first.decide() == "W0.0"
    first.expect("W0.0", "F3.0")  # now the budget's room beyond the spine takes F3 early
    assert first.decide() is None  # B1 not arrived, no W queued: wait
    first.arrive("B1.0")
    first.expect("B1.0")
    assert first.decide() == "W1.0"  # B2 not arrived
    first.expect("W1.0")
    first.arrive("B2.0")
    first.arrive("B3.0")
    first.expect("B2.0", "B3.0", "W2.0", "W3.0")  # ready spine tasks first, then the queue drains
    assert first.decide() is None and first.scheduler.done and first.scheduler.held_bytes == 0



@pytest.mark.parametrize("split", [False, True])
def test_provisioned_budget_holds_in_the_simulator_and_lets_later_ranks_hold_more(split):
    """Every policy under 'provisioned' finishes within it on every rank (varlen, P=2/4, V=1/2);
    with equal sizes dpp:adaptive+W uses the later ranks' extra room (their peak exceeds their
    'auto' budget), and is no slower than under 'auto'."""
    from megatron_dpp.pipeline import DYNAMIC_SCHEDULES, default_budget_bytes, provisioned_budget_bytes

    rng = np.random.default_rng(5)
    for P, V, M in [(2, 1, 8), (4, 1, 16), (2, 2, 8), (4, 2, 16)]:
        g = TaskGraph(P, V, M, rng.lognormal(0, 0.5, M) * 100, split_backward=split)
        for name in DYNAMIC_SCHEDULES:
            r = simulate(g, name, DurationModel(jitter_sigma=0.2), CommModel(latency=1.0), seed=P + V,
                         budget_bytes="provisioned")
            assert r.budget_bytes == [provisioned_budget_bytes(g)] * P, (P, V, name)
            assert all(p <= b for p, b in zip(r.peak_bytes, r.budget_bytes)), (P, V, name, r.peak_bytes)
        uniform = TaskGraph(P, V, M, split_backward=split)
        auto = simulate(uniform, "dpp:adaptive")
        provisioned = simulate(uniform, "dpp:adaptive", budget_bytes="provisioned")
        assert provisioned.makespan <= auto.makespan + 1e-9
        if split:
            assert provisioned.peak_bytes[-1] > default_budget_bytes(uniform, P - 1), (P, V)
            assert provisioned.makespan < auto.makespan, (P, V)

