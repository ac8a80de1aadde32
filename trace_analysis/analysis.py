"""Where each rank's time went in an iteration: busy, idle by reason, bubble fraction.

An iteration's window runs from the first task start on any rank to the last task end on any rank:
the pipeline's part of the step (the optimizer step and logging between iterations lie outside).
A rank's idle time is the window minus its task time, so the fill before its first task and the
drain after its last count as bubble. Idle is split by the recorded waits' reasons, clipped to the
window. What no wait of a known reason covers is `fill` before the rank's first task of the
iteration, `drain` after its last (the pipeline's shape: another rank is still computing), and
`other` between them (the runtime's loop, decisions between tasks, waits of another reason).
Posting a task's output send (the transport's isend, after the task's
span) is its own group: with the shm transport it can take tens of milliseconds. So is waiting in a
blocking collective inside the window (a last stage's part of the embedding-gradient all-reduce
while the first stage still runs its backwards, say).

The training step around the window (gradient sync, optimizer step, the loop's collectives) is
`StepTime`: each rank's time from one iteration's start to the next's, split into its parts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

from megatron_dpp.trace.recorder import GRADIENT_SYNC, IN_COLLECTIVE, OPTIMIZER_STEP, POSTING_SEND
from trace_analysis.load import TraceInputError
from trace_analysis.timeline import RankTimeline, RunTimeline

INPUT, HELD_BACK, TENSOR_PARALLEL, POSTING, COLLECTIVE, FILL, DRAIN, OTHER = (
    "input wait", "held back", "tp decision", "send posting", "collective", "fill", "drain", "other")
IDLE_GROUPS = (INPUT, HELD_BACK, TENSOR_PARALLEL, POSTING, COLLECTIVE, FILL, DRAIN, OTHER)
KNOWN_GROUPS = IDLE_GROUPS[:5]  # the groups of recorded waits' reasons


def reason_group(reason: str) -> str:
    """The recorded wait reasons in six groups: the DPP runtime's (runtime/executor.py), those of
    Megatron's own schedules (comm/megatron_p2p.py: "waiting for an input from rank N") and the
    training step's collectives (training/observe/step_tracing.py)."""
    if "waiting for an input" in reason:
        return INPUT  # nothing to run until a message arrives
    if reason.startswith("the policy held back"):
        return HELD_BACK  # ready tasks existed; the memory budget or the policy's order kept them
    if reason.startswith("the decision of tensor-parallel rank"):
        return TENSOR_PARALLEL  # a tensor-parallel follower waiting to be told the next task
    if reason.startswith(POSTING_SEND):
        return POSTING  # the transport's isend of the last task's output, both runtimes
    if reason.startswith(IN_COLLECTIVE):
        return COLLECTIVE  # a blocking collective of the training step (gradient sync, loss)
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


def _uncovered(start: float, end: float, waits: Sequence[Tuple[float, float]]) -> float:
    """Time in [start, end] that none of the (disjoint) `waits` covers."""
    covered = sum(max(0.0, min(w_end, end) - max(w_start, start)) for w_start, w_end in waits)
    return max(0.0, end - start - covered)


def rank_time(rank: RankTimeline, iteration: int, start: float, end: float) -> RankTime:
    tasks = rank.tasks_of(iteration)
    time = RankTime(window=end - start, busy=sum(task.duration for task in tasks))
    known_waits = []
    for wait in rank.waits:
        overlap = min(wait.end, end) - max(wait.start, start)
        if overlap > 0:
            group = reason_group(wait.reason)
            time.idle[group] += overlap
            if group != OTHER:
                known_waits.append((wait.start, wait.end))
    # Idle time that no wait of a known reason covers: fill before the rank's first task, drain
    # after its last, `other` between (rounding may make it -0).
    if tasks:
        first, last = min(task.start for task in tasks), max(task.end for task in tasks)
        time.idle[FILL] = _uncovered(start, max(start, first), known_waits)
        time.idle[DRAIN] = _uncovered(min(end, last), end, known_waits)
    known = sum(time.idle[group] for group in KNOWN_GROUPS)
    time.idle[OTHER] = max(0.0, time.idle_total - known - time.idle[FILL] - time.idle[DRAIN])
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


@dataclass
class StepTime:
    """One rank's training step (µs): from an iteration's start on that rank (its mark) to the next
    iteration's start (training or evaluation), or to the rank's last recorded event for the last
    one. `rest` is what no part covers: waiting for inputs, posting sends, the runtime's loop,
    logging."""
    step: float = 0.0
    tasks: float = 0.0
    gradient_sync: float = 0.0
    optimizer: float = 0.0
    collectives: float = 0.0  # blocking collectives outside the gradient sync (loss, stop signal)

    @property
    def rest(self) -> float:
        return self.step - self.tasks - self.gradient_sync - self.optimizer - self.collectives

    def add(self, other: "StepTime") -> None:
        self.step += other.step
        self.tasks += other.tasks
        self.gradient_sync += other.gradient_sync
        self.optimizer += other.optimizer
        self.collectives += other.collectives


def has_step_parts(run: RunTimeline) -> bool:
    """Whether the traces recorded the step around the schedule (traces of older runs did not)."""
    return any(rank.steps for rank in run.ranks)


def _step_window(rank: RankTimeline, iteration: int) -> Tuple[float, float]:
    starts = [time for time, number in rank.marks if number == iteration]
    if not starts:
        raise TraceInputError(f"{rank.label}: no start recorded for iteration {iteration}")
    start = starts[0]
    later = [time for time, _ in rank.marks if time > start]
    if later:
        return start, min(later)
    ends = [item.end for item in (*rank.tasks, *rank.waits, *rank.steps) if item.end >= start]
    return start, max(ends, default=start)


def step_time(rank: RankTimeline, iteration: int) -> StepTime:
    start, end = _step_window(rank, iteration)

    def inside(item) -> bool:
        return start <= item.start < end

    syncs = [step for step in rank.steps if inside(step) and step.name == GRADIENT_SYNC]

    def in_sync(wait) -> bool:
        return any(sync.start <= wait.start < sync.end for sync in syncs)

    return StepTime(
        step=end - start,
        tasks=sum(task.duration for task in rank.tasks_of(iteration)),
        gradient_sync=sum(sync.duration for sync in syncs),
        optimizer=sum(step.duration for step in rank.steps if inside(step) and step.name == OPTIMIZER_STEP),
        collectives=sum(wait.end - wait.start for wait in rank.waits
                        if inside(wait) and wait.reason.startswith(IN_COLLECTIVE) and not in_sync(wait)))


def mean_step_times(run: RunTimeline, iterations: Sequence[int]) -> List[StepTime]:
    """Each rank's step parts, averaged over the iterations."""
    means = []
    for rank in run.ranks:
        summed = StepTime()
        for iteration in iterations:
            summed.add(step_time(rank, iteration))
        n = len(iterations)
        means.append(StepTime(summed.step / n, summed.tasks / n, summed.gradient_sync / n,
                              summed.optimizer / n, summed.collectives / n))
    return means
