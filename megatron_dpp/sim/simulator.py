"""Discrete-event simulator that drives the SAME RankScheduler objects the runtime drives.

Each rank runs one task at a time. When a rank is idle it asks its scheduler for a task among
its ready set, which a ReadyTracker keeps by the same rule the runtime uses; finishing a forward
sends the activation to the next virtual stage, finishing a backward (its B, when the graph splits
backwards) sends the gradient to the previous one, each arriving after the comm model's delay.
Events at the same instant are all applied before any rank decides, so decisions do not depend on
the order in which simultaneous events were queued.
"""
from __future__ import annotations

import dataclasses
import heapq
from typing import Callable

import numpy as np

from megatron_dpp.pipeline import (
    MemoryBudget,
    Phase,
    RankScheduler,
    ReadyTracker,
    Task,
    TaskGraph,
    make_scheduler,
)
from megatron_dpp.sim.models import CommModel, DurationModel
from megatron_dpp.trace import chrome

_FINISH, _ARRIVAL = 0, 1


class SimulationDeadlock(RuntimeError):
    """No rank can make progress and some rank still has tasks left."""


@dataclasses.dataclass
class SimResult:
    schedule: str
    makespan: float
    busy: list[float]  # per rank: time spent running tasks
    idle: list[float]  # per rank: makespan - busy
    peak_bytes: list[int]  # per rank: most activation bytes held at once
    budget_bytes: list[int]
    lower_bound: float  # the busiest rank's total work
    pipeline_bound: float  # also counts the unavoidable fill and drain (TaskDurations.pipeline_bound)
    timeline: list[tuple[int, Task, float, float]]  # (rank, task, start, end)

    @property
    def peak_activation(self) -> int:
        return max(self.peak_bytes)

    def chrome_trace_events(self) -> list[dict]:
        """Chrome trace events: one thread per rank, 1 time unit = 1 ms."""
        events = [chrome.process_name(0, f"sim {self.schedule}")]
        events += [chrome.thread_name(0, rank, f"rank {rank}") for rank in range(len(self.busy))]
        events += [
            chrome.span(str(task), task.phase.label, 0, rank, start * 1000.0,
                        (end - start) * 1000.0, {"microbatch": task.microbatch, "chunk": task.chunk})
            for rank, task, start, end in self.timeline
        ]
        return events

    def to_chrome_trace(self) -> dict:
        """The Chrome trace document (opens in Perfetto / chrome://tracing)."""
        return chrome.trace_document(self.chrome_trace_events())

    def write_chrome_trace(self, path: str) -> None:
        chrome.write_trace(path, self.chrome_trace_events())


SchedulerFactory = Callable[[TaskGraph, int], RankScheduler]


def simulate(
    graph: TaskGraph,
    schedule: str | SchedulerFactory,
    duration_model: DurationModel | None = None,
    comm_model: CommModel | None = None,
    seed: int = 0,
    budget_bytes: MemoryBudget = None,
    **opts,
) -> SimResult:
    """Run one global batch of `graph` under `schedule` (a make_scheduler name, with budget_bytes
    (None/'auto', 'provisioned' or bytes) and opts passed through, or a factory
    (graph, rank) -> RankScheduler)."""
    duration_model = duration_model or DurationModel()
    comm_model = comm_model or CommModel()
    if isinstance(schedule, str):
        name = schedule

        def factory(g: TaskGraph, rank: int) -> RankScheduler:
            return make_scheduler(name, g, rank, budget_bytes, **opts)
    else:
        factory = schedule
        name = getattr(schedule, "__name__", "custom")
    P, V, M = graph.P, graph.V, graph.M
    schedulers = [factory(graph, rank) for rank in range(P)]
    durations = duration_model.sample(graph, np.random.default_rng(seed))
    # Hot-loop tables: Task objects made once, durations per rank indexed by (phase*V+chunk)*M+m,
    # the (rank, chunk) each (rank, phase, chunk) sends to, and each microbatch's message delay.
    task_of = graph.task_table
    per_rank = len(graph.phases) * V * M
    rank_durations = [durations.flat[r * per_rank:(r + 1) * per_rank] for r in range(P)]
    routes = [
        [[graph.output_target(r, task_of[phase][c][0]) for c in range(V)] for phase in (Phase.F, Phase.B)]
        for r in range(P)
    ]
    routes = [[[None if t is None else (t[0], t[1].chunk) for t in row] for row in rank] for rank in routes]
    delays = [comm_model.transfer_time(graph.act_bytes[m]) for m in range(M)]

    trackers = [ReadyTracker(graph, rank) for rank in range(P)]
    ready = [tracker.ready for tracker in trackers]
    running: list[Task | None] = [None] * P
    busy = [0.0] * P
    timeline: list[tuple[int, Task, float, float]] = []
    starts = [0.0] * P
    events: list[tuple[float, int, int, int, Task]] = []
    sequence = 0
    weight_grad = Phase.W
    heappush, heappop = heapq.heappush, heapq.heappop

    def dispatch(rank: int, now: float) -> None:
        nonlocal sequence
        task = schedulers[rank].next_task(ready[rank])
        if task is None:
            return
        try:
            trackers[rank].start(task)
        except RuntimeError as error:
            raise RuntimeError(f"scheduler {name}: {error}") from None
        schedulers[rank].on_start(task)
        running[rank] = task
        starts[rank] = now
        sequence += 1
        phase, m, chunk = task
        heappush(events, (now + rank_durations[rank][(phase * V + chunk) * M + m], sequence, _FINISH, rank, task))

    for rank in range(P):
        dispatch(rank, 0.0)
    now = 0.0
    while events:
        now = events[0][0]
        touched = []
        while events and events[0][0] == now:
            _, _, kind, rank, task = heappop(events)
            touched.append(rank)
            if kind == _ARRIVAL:
                trackers[rank].input_arrived(task)
                continue
            schedulers[rank].on_finish(task)
            running[rank] = None
            busy[rank] += now - starts[rank]
            timeline.append((rank, task, starts[rank], now))
            trackers[rank].finish(task)
            phase, m, chunk = task
            if phase == weight_grad:
                continue  # W sends nothing
            route = routes[rank][phase][chunk]
            if route is None:
                continue
            dst, dst_chunk = route
            dst_task = task_of[phase][dst_chunk][m]
            delay = 0.0 if dst == rank else delays[m]
            if delay == 0.0:
                trackers[dst].input_arrived(dst_task)
                touched.append(dst)
            else:
                sequence += 1
                heappush(events, (now + delay, sequence, _ARRIVAL, dst, dst_task))
        if len(touched) == 1:
            if running[touched[0]] is None:
                dispatch(touched[0], now)
            continue
        for rank in sorted(set(touched)):
            if running[rank] is None:
                dispatch(rank, now)

    unfinished = [r for r in range(P) if not schedulers[r].done]
    if unfinished:
        detail = "; ".join(
            f"rank {r}: held {schedulers[r].held_bytes}/{schedulers[r].budget_bytes} bytes, "
            f"ready [{' '.join(sorted(map(str, ready[r]))[:8])}]"
            for r in unfinished
        )
        raise SimulationDeadlock(f"{name}: no rank can progress at t={now:g}; {detail}")
    makespan = now
    return SimResult(
        schedule=name,
        makespan=makespan,
        busy=busy,
        idle=[makespan - b for b in busy],
        peak_bytes=[s.peak_bytes for s in schedulers],
        budget_bytes=[s.budget_bytes for s in schedulers],
        lower_bound=max(durations.rank_work(r) for r in range(P)),
        pipeline_bound=durations.pipeline_bound(delays),
        timeline=timeline,
    )
