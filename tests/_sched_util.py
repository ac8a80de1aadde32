"""Helpers for the scheduler tests: check a simulated timeline against the task graph."""
from __future__ import annotations

from megatron_dpp.schedule import Phase, Task, TaskGraph
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
