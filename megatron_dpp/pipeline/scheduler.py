"""RankScheduler: the per-rank decision object both executors (simulator, runtime) drive.

An executor keeps the rank's ready set (kept by a ReadyTracker, megatron_dpp.pipeline.ready), asks `next_task(ready)`
whenever the rank is idle, and reports `on_start(task)` / `on_finish(task)`. The scheduler only
sees what the rank knows at run time.
"""
from __future__ import annotations

import abc
from typing import Collection, Sequence

from megatron_dpp.pipeline.graph import TaskGraph
from megatron_dpp.pipeline.run_log import RunLog
from megatron_dpp.pipeline.task import Phase, Task


class RankScheduler(abc.ABC):
    """Bookkeeping shared by every schedule: memory held, and the rank's RunLog (what started,
    how many finished), which `history` and `done` read.

    Activation bytes are held from the start of a forward until the end of its backward (of its
    W task, when the graph splits backwards).
    """

    # Set by make_scheduler to the policy name the user chose; `strategy` says how the policy runs
    # when that is not its usual way (dpp:adaptive's fallback), else it is None.
    name = "unnamed"
    strategy: str | None = None

    def __init__(
        self, graph: TaskGraph, rank: int, budget_bytes: int, microbatch_order: Sequence[int]
    ):
        if not 0 <= rank < graph.P:
            raise ValueError(f"rank {rank} outside the pipeline of P={graph.P} ranks")
        if sorted(microbatch_order) != list(range(graph.M)):
            raise ValueError("microbatch_order must be a permutation of range(M)")
        self.graph = graph
        self.rank = rank
        self.budget_bytes = int(budget_bytes)
        self.microbatch_order = list(microbatch_order)
        self.held_bytes = 0
        self.peak_bytes = 0
        # The one record of what this rank ran; an executor adds its times to the entries.
        self.log = RunLog()
        self._act = graph.act_bytes
        self._total = len(graph.phases) * graph.M * graph.V
        self._release = graph.release_phase

    @property
    def done(self) -> bool:
        return self.log.finished == self._total

    @property
    def history(self) -> list[Task]:
        """Every task started, in order."""
        return self.log.tasks

    @abc.abstractmethod
    def next_task(self, ready: Collection[Task]) -> Task | None:
        """The task to run now (a member of `ready`), or None to wait for an arrival."""

    def on_start(self, task: Task) -> None:
        self.log.start(task)
        if task.phase == Phase.F:
            self.held_bytes += self._act[task.microbatch]
            if self.held_bytes > self.peak_bytes:
                self.peak_bytes = self.held_bytes

    def on_finish(self, task: Task) -> None:
        self.log.finish(task)
        if task.phase == self._release:
            self.held_bytes -= self._act[task.microbatch]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, rank={self.rank}, budget={self.budget_bytes})"


class StaticOrderScheduler(RankScheduler):
    """Runs a fixed task list: returns its next listed task iff that task is ready."""

    def __init__(
        self,
        name: str,
        graph: TaskGraph,
        rank: int,
        budget_bytes: int,
        microbatch_order: Sequence[int],
        order: Sequence[Task],
    ):
        super().__init__(graph, rank, budget_bytes, microbatch_order)
        if len(order) != self._total or len(set(order)) != self._total:
            raise ValueError(f"{name}: order must list each of the rank's {self._total} tasks once")
        self.name = name
        self.order = list(order)
        self._position = 0

    def next_task(self, ready: Collection[Task]) -> Task | None:
        if self._position < len(self.order):
            task = self.order[self._position]
            if task in ready:
                return task
        return None

    def on_start(self, task: Task) -> None:
        expected = self.order[self._position] if self._position < len(self.order) else None
        if task != expected:
            raise RuntimeError(f"{self.name} rank {self.rank}: started {task}, order says {expected}")
        self._position += 1
        super().on_start(task)


class PairedReceiveScheduler(StaticOrderScheduler):
    """A static order executed the way Megatron-Core's interleaved loop executes it.

    In its steady state that loop runs a forward and a backward, then receives the inputs of the
    next forward *and* the next backward in one call (send_forward_backward_recv_forward_backward).
    So a forward that the order follows with a backward also waits for that backward's input, when
    it comes from another rank (the last virtual stage makes its own from the loss). The simulator
    uses this to predict Megatron's own loop; the DPP runtime does not pair its receives.
    """

    def __init__(self, scheduler: StaticOrderScheduler):
        super().__init__(scheduler.name, scheduler.graph, scheduler.rank, scheduler.budget_bytes,
                         scheduler.microbatch_order, scheduler.order)
        placement = self.graph.placement
        loss_chunk = placement.local_chunk(self.rank, placement.last_stage)  # None: not here
        self._gate: dict[Task, Task] = {}
        for task, following in zip(self.order, self.order[1:]):
            local_input = following.chunk == loss_chunk
            if task.phase == Phase.F and following.phase == Phase.B and not local_input:
                self._gate[task] = following

    def next_task(self, ready: Collection[Task]) -> Task | None:
        task = super().next_task(ready)
        if task is None:
            return None
        gate = self._gate.get(task)
        return task if gate is None or gate in ready else None
