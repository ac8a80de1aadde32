"""The one ready rule: which of a rank's tasks may run now. The simulator and the runtime both keep
one ReadyTracker per rank and tell it what happened; policies read its `ready` set.

- F(m,c) is ready when its input has arrived, or it is the first virtual stage (it reads data), and it has
  not started.
- B(m,c) is ready when F(m,c) finished on this rank and its output gradient has arrived, or it is
  the last virtual stage (the loss makes the gradient), and it has not started.
- W(m,c) (split backwards only) is ready when B(m,c) finished on this rank, and it has not started.

In a forward-only pass (evaluation) no backward ever becomes ready.
"""
from __future__ import annotations

from megatron_dpp.pipeline.graph import TaskGraph
from megatron_dpp.pipeline.task import Phase, Task

_F, _B = Phase.F, Phase.B


class ReadyTracker:
    """The ready set of one rank in one global batch.

    The executor reports `input_arrived(task)` when the message `task` reads has arrived,
    `start(task)` when it begins a task (which must be ready) and `finish(task)` when the task's
    output exists. `ready` is the live set a policy's `next_task` reads.
    """

    def __init__(self, graph: TaskGraph, rank: int, forward_only: bool = False):
        self.graph = graph
        self.rank = rank
        self.forward_only = forward_only
        self.ready: set[Task] = set()
        self._table = graph.task_table
        self._forward_done = [bytearray(graph.M) for _ in range(graph.V)]
        # Gradients that arrived before their forward finished here. A real pipeline cannot do that
        # (the gradient depends on this forward's output); the rule holds without relying on it.
        self._early_gradients: set[Task] = set()
        placement = graph.placement
        # The chunk of the last virtual stage, if this rank holds it: its backwards need no message.
        self._loss_chunk = placement.local_chunk(rank, placement.last_stage)
        self._split = graph.split_backward and not forward_only
        first_chunk = placement.local_chunk(rank, placement.first_stage)
        if first_chunk is not None:
            self.ready.update(self._table[_F][first_chunk])  # the first stage reads data

    def needs_input(self, task: Task) -> bool:
        """Does `task` wait for a message from another stage? (Otherwise the rule above makes it
        ready without one.)"""
        return self.graph.input_source(self.rank, task) is not None

    def input_arrived(self, task: Task) -> None:
        if task.phase == _F or self._forward_done[task.chunk][task.microbatch]:
            self.ready.add(task)
        else:
            self._early_gradients.add(task)

    def start(self, task: Task) -> None:
        try:
            self.ready.remove(task)
        except KeyError:
            raise RuntimeError(f"rank {self.rank}: {task} started but it is not ready") from None

    def finish(self, task: Task) -> None:
        phase, m, chunk = task
        if phase == _F:
            if self.forward_only:
                return
            self._forward_done[chunk][m] = 1
            backward = self._table[_B][chunk][m]
            if chunk == self._loss_chunk:
                self.ready.add(backward)
            elif backward in self._early_gradients:
                self._early_gradients.discard(backward)
                self.ready.add(backward)
        elif phase == _B and self._split:
            self.ready.add(self._table[Phase.W][chunk][m])
