"""Helpers for the scheduler tests: check a simulated timeline against the task graph."""
from __future__ import annotations

from megatron_dpp.pipeline import Phase, Task, TaskGraph
from megatron_dpp.sim import CommModel, SimResult

EPS = 1e-9


def check_timeline(graph: TaskGraph, result: SimResult, comm: CommModel) -> None:
    """Every task ran once; no rank ran two at once; every dependency finished (and its message
    arrived) before the task that needs it started."""
    ends: dict[tuple[int, Task], float] = {}
    starts: dict[tuple[int, Task], float] = {}
    per_rank: dict[int, list[tuple[float, float]]] = {}
    for rank, task, start, end in result.timeline:
        key = (rank, task)
        assert key not in ends, f"{task} ran twice on rank {rank}"
        ends[key], starts[key] = end, start
        per_rank.setdefault(rank, []).append((start, end))
    for rank in range(graph.P):
        assert {t for (r, t) in ends if r == rank} == set(graph.tasks(rank)), f"rank {rank} missed tasks"
        intervals = sorted(per_rank[rank])
        for (s0, e0), (s1, _) in zip(intervals, intervals[1:]):
            assert s1 >= e0 - EPS, f"rank {rank} overlapped tasks at {s1}"
    for (rank, task), start in starts.items():
        source = graph.input_source(rank, task)
        if source is not None:
            src_rank, src_task = source
            delay = 0.0 if src_rank == rank else comm.transfer_time(graph.act_bytes[task.microbatch])
            assert start >= ends[source] + delay - EPS, f"{task} on rank {rank} started before its input"
        if task.phase == Phase.B:
            forward = (rank, Task(Phase.F, task.microbatch, task.chunk))
            assert start >= ends[forward] - EPS, f"{task} on rank {rank} started before its forward"
        if task.phase == Phase.W:
            backward = (rank, Task(Phase.B, task.microbatch, task.chunk))
            assert start >= ends[backward] - EPS, f"{task} on rank {rank} started before its B"


def peak_inflight(result: SimResult, rank: int) -> int:
    """Most forwards rank `rank` held at once (a forward holds from its start to its backward's end,
    or its W's end when backwards are split; a release at t comes before a forward starting at t,
    as the scheduler saw it)."""
    split = any(task.phase == Phase.W for _, task, _, _ in result.timeline)
    release = Phase.W if split else Phase.B
    events = []
    for r, task, start, end in result.timeline:
        if r == rank:
            if task.phase == Phase.F:
                events.append((start, 1))
            elif task.phase == release:
                events.append((end, -1))
    held = peak = 0
    for _, change in sorted(events):
        held += change
        peak = max(peak, held)
    return peak


def naive_safe_deviation(scheduler, ready):
    """dpp:adaptive's deviation rule written the slow, obvious way (a reference for its one-pass
    version): the earliest ready later spine forward q such that, after starting it now, the spine
    run in order holds at most the envelope at every step before q."""
    nxt = scheduler._next
    limit = min(len(scheduler.spine), nxt + scheduler._lookahead)
    for q in range(nxt + 1, limit):
        task = scheduler.spine[q]
        if scheduler._done[q] or task.phase != Phase.F or task not in ready:
            continue
        extra = scheduler._delta[q]
        now = scheduler._envelope[nxt - 1] if nxt > 0 else scheduler._limit
        fits = scheduler._admitted + extra <= now
        for i in range(nxt, q):
            early_beyond = sum(d for j, d in scheduler._early.items() if j > i)
            if scheduler._profile[i] + early_beyond + extra > scheduler._envelope[i]:
                fits = False
        if fits:
            return task
    return None
