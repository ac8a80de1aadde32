"""Where each rank's time went in an iteration: busy, idle by reason, bubble fraction.

An iteration's window runs from the first task start on any rank to the last task end on any rank:
the pipeline's part of the step (the optimizer step and logging between iterations lie outside).
A rank's idle time is the window minus its task time, so the fill before its first task and the
drain after its last count as bubble. Idle is split by the recorded waits' reasons, clipped to the
window; `other` is waits with another reason plus the time no wait covers (the runtime's loop,
decisions between tasks). Posting a task's output send (the transport's isend, after the task's
span) is its own group: with the shm transport it can take tens of milliseconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

from megatron_dpp.trace.recorder import POSTING_SEND
from profiling.load import TraceInputError
from profiling.timeline import RankTimeline, RunTimeline

INPUT, HELD_BACK, TENSOR_PARALLEL, POSTING, OTHER = (
    "input wait", "held back", "tp decision", "send posting", "other")
IDLE_GROUPS = (INPUT, HELD_BACK, TENSOR_PARALLEL, POSTING, OTHER)
KNOWN_GROUPS = IDLE_GROUPS[:-1]


def reason_group(reason: str) -> str:
    """The recorded wait reasons in five groups: the DPP runtime's (runtime/executor.py) and those
    of Megatron's own schedules (comm/megatron_p2p.py: "waiting for an input from rank N")."""
    if "waiting for an input" in reason:
        return INPUT  # nothing to run until a message arrives
    if reason.startswith("the policy held back"):
        return HELD_BACK  # ready tasks existed; the memory budget or the policy's order kept them
    if reason.startswith("the decision of tensor-parallel rank"):
        return TENSOR_PARALLEL  # a tensor-parallel follower waiting to be told the next task
    if reason.startswith(POSTING_SEND):
        return POSTING  # the transport's isend of the last task's output, both runtimes
    return OTHER


@dataclass
class RankTime:
    """One rank's time over one or more iterations, in microseconds."""
    window: float = 0.0
    busy: float = 0.0
    idle: Dict[str, float] = field(default_factory=lambda: dict.fromkeys(IDLE_GROUPS, 0.0))

    @property
    def idle_total(self) -> float:
        return self.window - self.busy

    @property
    def bubble(self) -> float:
        return self.idle_total / self.window if self.window > 0 else 0.0

    def add(self, other: "RankTime") -> None:
        self.window += other.window
        self.busy += other.busy
        for group in IDLE_GROUPS:
            self.idle[group] += other.idle[group]


@dataclass
class IterationTime:
    iteration: int
    start: float
    end: float
    ranks: List[RankTime]  # by global rank

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def bubble(self) -> float:
        return total(self.ranks).bubble


def window(run: RunTimeline, iteration: int, ranks: Sequence[RankTimeline] = ()) -> Tuple[float, float]:
    """(first task start, last task end) of `iteration` over `ranks` (default: all)."""
    tasks = [task for rank in (ranks or run.ranks) for task in rank.tasks_of(iteration)]
    if not tasks:
        raise TraceInputError(f"iteration {iteration} has no tasks")
    return min(task.start for task in tasks), max(task.end for task in tasks)


def rank_time(rank: RankTimeline, iteration: int, start: float, end: float) -> RankTime:
    time = RankTime(window=end - start, busy=sum(task.duration for task in rank.tasks_of(iteration)))
    for wait in rank.waits:
        overlap = min(wait.end, end) - max(wait.start, start)
        if overlap > 0:
            time.idle[reason_group(wait.reason)] += overlap
    # Whatever idle time no wait of a known reason covers is `other`; rounding may make it -0.
    known = sum(time.idle[group] for group in KNOWN_GROUPS)
    time.idle[OTHER] = max(0.0, time.idle_total - known)
    return time


def iteration_time(run: RunTimeline, iteration: int) -> IterationTime:
    start, end = window(run, iteration)
    return IterationTime(iteration, start, end, [rank_time(rank, iteration, start, end) for rank in run.ranks])


def total(times: Sequence[RankTime]) -> RankTime:
    summed = RankTime()
    for time in times:
        summed.add(time)
    return summed


def per_rank_totals(iterations: Sequence[IterationTime]) -> List[RankTime]:
    """Each rank's time summed over the iterations."""
    ranks = len(iterations[0].ranks)
    return [total([it.ranks[r] for it in iterations]) for r in range(ranks)]
