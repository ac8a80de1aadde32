"""Typed records out of a rank's Chrome-trace events (the format megatron_dpp/trace/recorder.py
writes): its tasks, waits, messages and activation-memory samples. Times stay in microseconds."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

from megatron_dpp.pipeline.placement import Placement, interleaved, parse_placement
from megatron_dpp.pipeline.task import Task
from megatron_dpp.trace.recorder import STEP_CATEGORY
from trace_analysis.load import RankTrace, RunTraces, TraceInputError

TASK_CATEGORIES = ("forward", "backward", "weight-grad")
TASK_PHASES = ("F", "B", "W")  # Phase names, in the order a microbatch runs them


@dataclass(frozen=True)
class TaskSpan:
    rank: int
    name: str  # short form, F3.0
    phase: str  # F, B or W
    microbatch: int
    chunk: int
    iteration: int
    start: float
    end: float
    tokens: Optional[int]

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Wait:
    rank: int
    start: float
    end: float
    reason: str


@dataclass(frozen=True)
class StepSpan:
    """A part of the training step around the schedule (recorder.GRADIENT_SYNC, OPTIMIZER_STEP)."""
    rank: int
    name: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Message:
    rank: int  # where it was recorded
    kind: str  # send or recv
    task: str  # the recording rank's task: the sender's for a send, the receiver's for a recv
    peer: int
    tag: int
    nbytes: Optional[int]
    time: float


@dataclass(frozen=True)
class MemorySample:
    time: float
    held: int
    budget: int


@dataclass
class RankTimeline:
    rank: int
    pipeline_rank: int
    tensor_rank: int
    data_rank: int
    node: Optional[int]  # otherData.node when the trace says; None otherwise
    tasks: List[TaskSpan] = field(default_factory=list)  # by start time
    waits: List[Wait] = field(default_factory=list)
    messages: List[Message] = field(default_factory=list)
    memory: List[MemorySample] = field(default_factory=list)
    steps: List[StepSpan] = field(default_factory=list)
    marks: List[Tuple[float, int]] = field(default_factory=list)  # (time, iteration) of each start
    forward_only_iterations: Set[int] = field(default_factory=set)

    @property
    def label(self) -> str:
        node = "?" if self.node is None else self.node
        return (f"rank {self.rank} (pp {self.pipeline_rank}, tp {self.tensor_rank}, "
                f"dp {self.data_rank}, node {node})")

    def tasks_of(self, iteration: int) -> List[TaskSpan]:
        return [task for task in self.tasks if task.iteration == iteration]


@dataclass
class RunTimeline:
    name: str
    policy: str  # otherData.policy: the DPP policy, or "megatron 1f1b" for Megatron's own schedule
    schedule: Optional[str]  # otherData.schedule: "dpp", "1f1b" or "interleaved" (None in older traces)
    ranks: List[RankTimeline]
    # otherData.placement (pipeline/placement.py's text form: 'interleaved:2x1', 'v:4'); None in
    # traces written before it was recorded, which were all Megatron's interleaved placement.
    placement_text: Optional[str] = None

    def placement(self) -> Placement:
        """Which rank held each virtual stage."""
        if self.placement_text is not None:
            return parse_placement(self.placement_text)
        chunks = 1 + max((task.chunk for rank in self.ranks for task in rank.tasks), default=0)
        return interleaved(self.pipeline_size, chunks)

    @property
    def pipeline_size(self) -> int:
        return max(rank.pipeline_rank for rank in self.ranks) + 1

    @property
    def training_iterations(self) -> List[int]:
        """Iterations with tasks, without forward-only ones (evaluation)."""
        skipped = set().union(*(rank.forward_only_iterations for rank in self.ranks))
        return sorted({task.iteration for rank in self.ranks for task in rank.tasks} - skipped)


def rank_timeline(trace: RankTrace) -> RankTimeline:
    meta = trace.metadata
    timeline = RankTimeline(trace.rank, meta.get("pipeline_rank", trace.rank), meta.get("tensor_rank", 0),
                            meta.get("data_rank", 0), meta.get("node"))
    try:
        for event in trace.events:
            _add_event(timeline, event)
    except (KeyError, TypeError, ValueError) as error:
        raise TraceInputError(f"{trace.path}: malformed event ({type(error).__name__}: {error})") from None
    timeline.tasks.sort(key=lambda task: task.start)
    timeline.waits.sort(key=lambda wait: wait.start)
    timeline.messages.sort(key=lambda message: message.time)
    timeline.memory.sort(key=lambda sample: sample.time)
    timeline.steps.sort(key=lambda step: step.start)
    timeline.marks.sort()
    return timeline


def _add_event(timeline: RankTimeline, event: Dict) -> None:
    phase, category, args = event.get("ph"), event.get("cat"), event.get("args") or {}
    if phase == "X" and category in TASK_CATEGORIES:
        task = Task.parse(event["name"])
        start = float(event["ts"])
        timeline.tasks.append(TaskSpan(
            timeline.rank, event["name"], task.phase.name, task.microbatch, task.chunk,
            int(args["iteration"]), start, start + float(event["dur"]), args.get("tokens")))
    elif phase == "X" and category == "idle":
        start = float(event["ts"])
        timeline.waits.append(Wait(timeline.rank, start, start + float(event["dur"]),
                                   str(args.get("reason", ""))))
    elif phase == "i" and category == "message":
        kind, _, task = event["name"].partition(" ")
        timeline.messages.append(Message(timeline.rank, kind, task, int(args["peer"]), int(args["tag"]),
                                         args.get("bytes"), float(event["ts"])))
    elif phase == "X" and category == STEP_CATEGORY:
        start = float(event["ts"])
        timeline.steps.append(StepSpan(timeline.rank, event["name"], start, start + float(event["dur"])))
    elif phase == "i" and category == "iteration":
        iteration = int(event["name"].split()[-1])
        timeline.marks.append((float(event["ts"]), iteration))
        if args.get("forward_only"):
            timeline.forward_only_iterations.add(iteration)
    elif phase == "C" and event.get("name") == "activation bytes":
        timeline.memory.append(MemorySample(float(event["ts"]), int(args["held"]), int(args["budget"])))


def run_timeline(run: RunTraces) -> RunTimeline:
    policies = {trace.metadata.get("policy") for trace in run.ranks} - {None}
    schedules = {trace.metadata.get("schedule") for trace in run.ranks} - {None}
    placements = {trace.metadata.get("placement") for trace in run.ranks} - {None}
    if len(placements) > 1:
        raise TraceInputError(f"{run.name}: the ranks name different placements: "
                              f"{', '.join(sorted(placements))}")
    timeline = RunTimeline(run.name, ", ".join(sorted(policies)) or "unknown",
                           schedules.pop() if len(schedules) == 1 else None,
                           [rank_timeline(trace) for trace in run.ranks],
                           placements.pop() if placements else None)
    check_complete(run, timeline)
    return timeline


def _listed(names: List[str], most: int = 4) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def check_complete(run: RunTraces, timeline: RunTimeline) -> None:
    """What every rank of a traced run records (training/observe/tracing.py), checked so that a rank file
    with events missing is refused in one line instead of measured as idle time:
    - at least one task;
    - the same iterations (its "iteration N" marks and the iterations of its tasks) as every rank;
    - in each iteration with tasks, each task of the grid exactly once: every microbatch 0..M-1 on
      every model chunk 0..V-1, in each phase (F; B and W where any rank ran one that iteration:
      forward-only iterations run F only, split backwards add W), M the iteration's microbatch count
      and V the chunks per rank, both as large as any rank records them."""
    for trace, rank in zip(run.ranks, timeline.ranks):
        if not rank.tasks:
            raise TraceInputError(f"{trace.path}: no task events (an empty or cut rank file: every "
                                  f"rank of a --trace run records its tasks)")
    seen = [{task.iteration for task in rank.tasks} | {it for _, it in rank.marks}
            for rank in timeline.ranks]
    every = set().union(*seen)
    for trace, iterations in zip(run.ranks, seen):
        absent = sorted(every - iterations)
        if absent:
            raise TraceInputError(f"{trace.path}: no events of iteration(s) "
                                  f"{_listed([str(i) for i in absent])}, which other ranks record "
                                  f"(an incomplete rank file)")
    chunks = max(task.chunk for rank in timeline.ranks for task in rank.tasks) + 1
    for iteration in sorted(every):
        tasks = [rank.tasks_of(iteration) for rank in timeline.ranks]
        if not any(tasks):
            continue
        microbatches = max(task.microbatch for ranks in tasks for task in ranks) + 1
        phases = sorted({task.phase for ranks in tasks for task in ranks},
                        key=TASK_PHASES.index)
        grid = [f"{phase}{m}.{c}" for phase in phases for m in range(microbatches)
                for c in range(chunks)]
        for trace, ranks in zip(run.ranks, tasks):
            counts = Counter(f"{task.phase}{task.microbatch}.{task.chunk}" for task in ranks)
            twice = sorted(name for name, count in counts.items() if count > 1)
            if twice:
                raise TraceInputError(f"{trace.path}: iteration {iteration} records "
                                      f"{_listed(twice)} more than once (a damaged rank file)")
            missing = [name for name in grid if name not in counts]
            if missing:
                raise TraceInputError(
                    f"{trace.path}: iteration {iteration} lacks {len(missing)} of the {len(grid)} "
                    f"tasks every rank runs ({_listed(missing)}; {microbatches} microbatches x "
                    f"{chunks} chunks x {'/'.join(phases)}): an incomplete rank file")
