"""The critical path of an iteration: the longest chain of dependent tasks, at measured durations.

A task depends on
  - its input: F(m) on virtual stage s on F(m) on stage s-1, B(m) on stage s on B(m) on s+1
    (where the run's placement puts stage s: otherData.placement, within the same tensor- and
    data-parallel ranks), W(m) on its own B(m);
  - its activations: B(m) on stage s on F(m) on stage s;
  - the rank's order: the task the rank ran just before it (a rank runs one task at a time).
An input from another rank is there from the moment its task posted it (the `send` instant, at or
after that task's end: the span is the compute, the posting follows it), not from that task's end:
the runtime's loop may come in between.

With the order each rank actually chose held fixed, the longest path through this graph is how
long the iteration would have taken had every message arrived the moment it was posted and every
wait been only for an input not yet computed: the time the chosen order needs on these durations.
The measured window minus it is what the run lost to message latency, the runtime's loop and waits
the dependencies did not force. Whether another order (another policy) would have been shorter is
the replay's question (replay.py), not this one's.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Dict, List, Tuple

from trace_analysis.load import TraceInputError
from trace_analysis.timeline import RunTimeline, TaskSpan

_Key = Tuple[int, int, int, str, int, int]  # tensor rank, data rank, pipeline rank, phase, microbatch, chunk


@dataclass
class CriticalPath:
    length: float  # microseconds
    tasks: List[TaskSpan]  # the chain, first to last


def _send_offsets(run: RunTimeline, iteration: int) -> Dict[Tuple[int, str], float]:
    """(rank, task name) -> microseconds from the task's start to its send: names are unique per
    rank within an iteration, and a task's send is posted after it starts and before the rank's
    next task starts (Megatron's and the DPP runtime's alike)."""
    offsets = {}
    for rank in run.ranks:
        tasks = {task.name: task for task in rank.tasks_of(iteration)}
        next_start = {task: following.start for task, following in zip(rank.tasks, rank.tasks[1:])}
        for message in rank.messages:
            task = tasks.get(message.task)
            if (message.kind == "send" and task is not None
                    and task.start <= message.time <= next_start.get(task, float("inf"))):
                offsets[(rank.rank, task.name)] = message.time - task.start
    return offsets


def _dependencies(run: RunTimeline, iteration: int) -> Tuple[List[TaskSpan], List[List[int]]]:
    """The iteration's tasks and, for each, the tasks it depends on (indices)."""
    placement = run.placement()
    tasks: List[TaskSpan] = []
    index: Dict[_Key, int] = {}
    place = {}
    for rank in run.ranks:
        place[rank.rank] = (rank.tensor_rank, rank.data_rank, rank.pipeline_rank)
        for task in rank.tasks_of(iteration):
            index[(*place[rank.rank], task.phase, task.microbatch, task.chunk)] = len(tasks)
            tasks.append(task)
    if not tasks:
        raise TraceInputError(f"iteration {iteration} has no tasks")
    predecessors: List[List[int]] = [[] for _ in tasks]
    previous_on_rank: Dict[int, int] = {}
    for i in sorted(range(len(tasks)), key=lambda i: tasks[i].start):
        task = tasks[i]
        tp, dp, pp = place[task.rank]
        stage = placement.stage(pp, task.chunk)
        previous, following = placement.previous_stage(stage), placement.next_stage(stage)
        wanted = []
        if task.phase == "F" and previous is not None:
            wanted.append((tp, dp, *placement.location(previous)[:1], "F", task.microbatch,
                           placement.location(previous)[1]))
        if task.phase == "B":
            wanted.append((tp, dp, pp, "F", task.microbatch, task.chunk))
            if following is not None:
                wanted.append((tp, dp, placement.location(following)[0], "B", task.microbatch,
                               placement.location(following)[1]))
        if task.phase == "W":
            wanted.append((tp, dp, pp, "B", task.microbatch, task.chunk))
        predecessors[i] = [index[key] for key in wanted if key in index]
        if task.rank in previous_on_rank:
            predecessors[i].append(previous_on_rank[task.rank])
        previous_on_rank[task.rank] = i
    return tasks, predecessors


def critical_path(run: RunTimeline, iteration: int) -> CriticalPath:
    tasks, predecessors = _dependencies(run, iteration)
    offsets = _send_offsets(run, iteration)
    successors: List[List[int]] = [[] for _ in tasks]
    for i, preds in enumerate(predecessors):
        for p in preds:
            successors[p].append(i)
    # Earliest start and finish of every task in topological order (Kahn's algorithm): a task
    # starts when its last predecessor's output is there: at that one's end on the same rank, at
    # its send on another.
    pending = [len(preds) for preds in predecessors]
    ready = deque(i for i, count in enumerate(pending) if count == 0)
    start, finish = [0.0] * len(tasks), [0.0] * len(tasks)
    via = [-1] * len(tasks)
    done = 0

    def available(p: int, consumer: TaskSpan) -> float:
        if tasks[p].rank == consumer.rank:
            return finish[p]
        return start[p] + offsets.get((tasks[p].rank, tasks[p].name), tasks[p].duration)

    while ready:
        i = ready.popleft()
        done += 1
        via[i] = max(predecessors[i], key=lambda p: available(p, tasks[i]), default=-1)
        start[i] = available(via[i], tasks[i]) if via[i] >= 0 else 0.0
        finish[i] = start[i] + tasks[i].duration
        for s in successors[i]:
            pending[s] -= 1
            if pending[s] == 0:
                ready.append(s)
    if done < len(tasks):
        raise TraceInputError(f"iteration {iteration}: a rank ran a task before one it depends on "
                              "(the trace contradicts the pipeline's dependencies)")
    last = max(range(len(tasks)), key=lambda i: finish[i])
    length = finish[last]
    chain = []
    while last >= 0:
        chain.append(tasks[last])
        last = via[last]
    return CriticalPath(length, chain[::-1])
