"""--replay: the measured task durations of each iteration run through the simulator under every
policy, to tell "the policy chose badly" from "the machine was noisy".

The simulator (megatron_dpp.sim) gets exactly the durations the trace measured, task by task and
rank by rank (in ms), the iteration's microbatch sizes (tokens) and, when the activation-memory
counter is there, the activation bytes and budgets the runtime used. Messages are free and
decisions instant, so the replay of the policy that ran is what its choices cost on these
durations; the measured time above it is the machine's (messages, the runtime's loop, noise), and
the other policies' replays say what a different choice would have cost on the same durations.

One pipeline is replayed: the ranks of tensor rank 0 and data rank 0 (the others mirror its
decisions, or run their own batch with the same policy).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from megatron_dpp.pipeline import (SCHEDULE_NAMES, V_PLACEMENT_SCHEDULES, TaskGraph,
                                   check_policy_layout, check_policy_placement, make_scheduler)
from megatron_dpp.pipeline.placement import Placement
from megatron_dpp.pipeline import megatron_inflight_forwards
from megatron_dpp.pipeline.registry import INTERLEAVED_1F1B, ONE_F_ONE_B
from megatron_dpp.sim import SimulationDeadlock, TaskDurations, simulate
from trace_analysis.analysis import window
from trace_analysis.load import TraceInputError
from trace_analysis.timeline import RankTimeline, RunTimeline, TaskSpan

PHASES = ("F", "B", "W")
US_PER_MS = 1000.0
# otherData.schedule of a run of Megatron's own schedules -> the simulator's name for that order.
MEGATRON_SCHEDULES = {"1f1b": ONE_F_ONE_B, "interleaved": INTERLEAVED_1F1B}


def policy_that_ran(run: RunTimeline) -> str:
    """The simulator's name for what ordered the run's tasks."""
    return MEGATRON_SCHEDULES.get(run.schedule or "", run.policy)


@dataclass(frozen=True)
class MeasuredDurations:
    """What simulate() asks of a DurationModel: `sample`, here the measured durations every time."""
    flat: Tuple[float, ...]  # ms, indexed as TaskDurations: ((rank * phases + phase) * V + chunk) * M + m

    def sample(self, graph: TaskGraph, rng=None) -> TaskDurations:
        return TaskDurations(graph, list(self.flat))


@dataclass
class PolicyReplay:
    policy: str
    makespans: List[float] = field(default_factory=list)  # ms, one per iteration
    problem: Optional[str] = None  # why it could not be replayed


@dataclass
class Replay:
    iterations: List[int]
    measured: List[float]  # ms: the replayed pipeline's window, per iteration
    policies: List[PolicyReplay]
    notes: List[str]


def replayed_pipeline(run: RunTimeline) -> List[RankTimeline]:
    stages = {rank.pipeline_rank: rank for rank in run.ranks if rank.tensor_rank == 0 and rank.data_rank == 0}
    if sorted(stages) != list(range(run.pipeline_size)):
        raise TraceInputError("--replay: the run lacks a rank of tensor rank 0 and data rank 0 for some "
                              "pipeline stage")
    return [stages[p] for p in range(run.pipeline_size)]


def _activation_bytes(rank: RankTimeline, tasks: List[TaskSpan]) -> Dict[int, int]:
    """Bytes each forward added to the rank's `activation bytes` counter, by microbatch: the counter
    is sampled at the end of every task on a rank that decides."""
    times = [sample.time for sample in rank.memory]
    found: Dict[int, int] = {}
    for task in tasks:
        if task.phase != "F":
            continue
        i = bisect.bisect_left(times, task.end - 1.0)
        if i >= len(times) or times[i] > task.end + 1.0:
            continue
        before = rank.memory[i - 1].held if i > 0 else 0
        found[task.microbatch] = rank.memory[i].held - before
    return found


def _budgets(rank: RankTimeline, tasks: List[TaskSpan]) -> Optional[int]:
    start, end = tasks[0].start, tasks[-1].end + 1.0
    values = {sample.budget for sample in rank.memory if start <= sample.time <= end}
    return values.pop() if len(values) == 1 else None


def _measured_durations(per_rank: List[List[TaskSpan]], V: int, M: int, phases: int,
                        iteration: int) -> MeasuredDurations:
    flat: List[Optional[float]] = [None] * (len(per_rank) * phases * V * M)
    for p, tasks in enumerate(per_rank):
        for task in tasks:
            index = ((p * phases + PHASES.index(task.phase)) * V + task.chunk) * M + task.microbatch
            flat[index] = task.duration / US_PER_MS
    if any(d is None for d in flat):
        raise TraceInputError(f"--replay: iteration {iteration} misses tasks on some rank")
    return MeasuredDurations(tuple(flat))


@dataclass
class _Memory:
    """What the replay's schedulers admit by: activation bytes (None: sizes), the largest possible
    microbatch's bytes (None: this batch's largest), an explicit budget (None: the defaults)."""
    act_bytes: Optional[List[int]]
    max_act_bytes: Optional[int]
    budget: Optional[int]
    note: str


def _memory(pipeline: List[RankTimeline], per_rank: List[List[TaskSpan]], V: int, M: int,
            placement: Placement) -> _Memory:
    act: Dict[int, int] = {}
    for rank, tasks in zip(pipeline, per_rank):
        for m, nbytes in _activation_bytes(rank, tasks).items():
            act[m] = max(act.get(m, 0), nbytes)
    budgets = [_budgets(rank, tasks) for rank, tasks in zip(pipeline, per_rank)]
    if len(act) < M or None in budgets or min(act.values()) <= 0:
        return _Memory(None, None, None, "no activation-memory counter on every rank: activation bytes "
                                         "taken as tokens, default budgets")
    act_bytes = [act[m] for m in range(M)]
    # Default budgets are a rank's in-flight forward count (at least V) times the largest possible
    # microbatch's bytes: where every rank's budget divides into the same such size, that is it.
    P = len(pipeline)
    counts = [max(megatron_inflight_forwards(TaskGraph(P, V, M, placement=placement), p), V)
              for p in range(P)]
    per_forward = {budget / count for budget, count in zip(budgets, counts)}
    largest = per_forward.pop() if len(per_forward) == 1 else 0.0
    if largest.is_integer() and largest >= max(act_bytes):
        return _Memory(act_bytes, int(largest), None,
                       "activation bytes from the memory counter, the runtime's default budgets")
    if len(set(budgets)) == 1:
        return _Memory(act_bytes, None, budgets[0],
                       f"activation bytes from the memory counter, the run's explicit budget {budgets[0]} "
                       "bytes (largest possible microbatch unknown: this batch's largest)")
    return _Memory(act_bytes, None, None, "activation bytes from the memory counter; budgets differ by "
                                          "rank and are not the defaults: the defaults")


def _iteration_model(pipeline: List[RankTimeline], iteration: int,
                     placement: Placement) -> Tuple[TaskGraph, MeasuredDurations, _Memory]:
    """The simulator's graph of one iteration, its measured durations and its memory model."""
    per_rank = [rank.tasks_of(iteration) for rank in pipeline]
    everything = [task for tasks in per_rank for task in tasks]
    V = max(task.chunk for task in everything) + 1
    M = max(task.microbatch for task in everything) + 1
    split = any(task.phase == "W" for task in everything)
    tokens = {task.microbatch: task.tokens for task in everything if task.tokens}
    sizes = [float(tokens.get(m, 1)) for m in range(M)]
    durations = _measured_durations(per_rank, V, M, 3 if split else 2, iteration)
    memory = _memory(pipeline, per_rank, V, M, placement)
    graph = TaskGraph(len(pipeline), V, M, sizes, memory.act_bytes, max_act_bytes=memory.max_act_bytes,
                      split_backward=split, placement=placement)
    return graph, durations, memory


def _policies(graph: TaskGraph) -> List[str]:
    """The policies with an order on the run's chunks and placement."""
    usable = []
    for name in SCHEDULE_NAMES + V_PLACEMENT_SCHEDULES:
        try:
            check_policy_layout(name, graph.V)
            check_policy_placement(name, graph.placement)
        except ValueError:
            continue
        usable.append(name)
    return usable


def _simulate(graph: TaskGraph, name: str, budget: Optional[int], durations: MeasuredDurations) -> float:
    def scheduler(g: TaskGraph, rank: int):
        return make_scheduler(name, g, rank, budget_bytes=budget)

    scheduler.__name__ = name
    return simulate(graph, scheduler, durations).makespan


def replay(run: RunTimeline, iterations: List[int]) -> Replay:
    pipeline = replayed_pipeline(run)
    result: Optional[Replay] = None
    for iteration in iterations:
        graph, durations, memory = _iteration_model(pipeline, iteration, run.placement())
        if result is None:
            result = Replay([], [], [PolicyReplay(name) for name in _policies(graph)], [])
        if memory.note not in result.notes:
            result.notes.append(memory.note)
        start, end = window(run, iteration, pipeline)
        result.iterations.append(iteration)
        result.measured.append((end - start) / US_PER_MS)
        for policy in result.policies:
            if policy.problem:
                continue
            try:
                policy.makespans.append(_simulate(graph, policy.policy, memory.budget, durations))
            except (ValueError, RuntimeError, SimulationDeadlock) as error:
                policy.problem = str(error).splitlines()[0]
    assert result is not None, "select_iterations never returns an empty list"
    return result
