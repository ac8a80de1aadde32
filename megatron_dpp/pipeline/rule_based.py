"""Rule-based dynamic policies: pick among ready tasks by a fixed preference, under admission.

`greedy` is the reference MegatronDPP's rule (first ready backward, else first ready forward);
`breadth-first` prefers forwards, shallow chunks first; `depth-first` prefers backwards and the
deepest chunk. All three admit a new microbatch only under the rank's byte budget (or a count
cap), with a reservation that rules out deadlock for V > 1 (see `_admits`). On graphs that split
backwards they run each W as soon as its B ends, as the reference's fused backward did.
"""
from __future__ import annotations

import abc
from typing import Collection, Sequence

from megatron_dpp.pipeline.budget import minimum_budget_bytes
from megatron_dpp.pipeline.graph import TaskGraph
from megatron_dpp.pipeline.scheduler import RankScheduler
from megatron_dpp.pipeline.task import Phase, Task

# Below this many ready tasks, candidates are read off the ready set; above it (a first stage with
# the whole batch ready) each chunk's next forwards are found by walking the priority order.
_SMALL_READY_SET = 64


class RuleBasedScheduler(RankScheduler):
    """Admission plus candidate bookkeeping; subclasses rank the candidates in `_choose`.

    Admission (deadlock-free for any V): a microbatch's first forward on this rank (chunk 0)
    reserves its activations on ALL V chunks; its later chunks' forwards use that reservation.
    A microbatch is admitted only while the reservations fit the budget (bytes, or a count cap
    `max_inflight` of chunk activations). So a microbatch that entered the last rank can always
    finish, which frees memory for the next: no deadlock once budget >= V * largest activation.
    """

    def __init__(
        self,
        graph: TaskGraph,
        rank: int,
        budget_bytes: int,
        microbatch_order: Sequence[int],
        max_inflight: int | None = None,
    ):
        super().__init__(graph, rank, budget_bytes, microbatch_order)
        V = graph.V
        if max_inflight is not None:
            if max_inflight < V:
                raise ValueError(f"max_inflight={max_inflight} must be >= V={V} (one microbatch on every chunk)")
        elif self.budget_bytes < minimum_budget_bytes(V, graph.max_act_bytes):
            raise ValueError(
                f"budget_bytes={self.budget_bytes} on rank {rank} is below the minimum "
                f"V * max_act_bytes = {minimum_budget_bytes(V, graph.max_act_bytes)}"
            )
        self.max_inflight = max_inflight
        self._position = {m: i for i, m in enumerate(self.microbatch_order)}
        self._reserved_bytes = 0
        self._reserved_count = 0
        # Forwards started whose backward has not: the only possible backward candidates.
        self._inflight: dict[Task, None] = {}
        # Per chunk: forwards not started yet, walked in priority order from a moving pointer.
        self._forward_started = [bytearray(graph.M) for _ in range(V)]
        self._forward_pointer = [0] * V
        self._weight_grad_due: Task | None = None  # split backwards: the W of the B that just ended

    # --- admission ----------------------------------------------------------------------------
    def _admits(self, task: Task) -> bool:
        if task.chunk > 0:
            return True  # reserved when the microbatch entered chunk 0
        V = self.graph.V
        if self.max_inflight is not None:
            return self._reserved_count + V <= self.max_inflight
        return self._reserved_bytes + V * self._act[task.microbatch] <= self.budget_bytes

    # --- candidates ---------------------------------------------------------------------------
    def _candidates(self, ready: Collection[Task]) -> tuple[list[Task], list[Task | None]]:
        """Ready backwards, and per chunk the ready unstarted forward earliest in
        microbatch_order (or None)."""
        V = self.graph.V
        best: list[Task | None] = [None] * V
        if len(ready) <= _SMALL_READY_SET:
            backwards = []
            position = self._position
            for task in ready:
                if task.phase == Phase.F:
                    current = best[task.chunk]
                    if current is None or position[task.microbatch] < position[current.microbatch]:
                        best[task.chunk] = task
                elif task.phase == Phase.B:
                    backwards.append(task)
            return backwards, best
        backwards = [
            Task(Phase.B, f.microbatch, f.chunk)
            for f in self._inflight
            if Task(Phase.B, f.microbatch, f.chunk) in ready
        ]
        order = self.microbatch_order
        for chunk in range(V):
            started = self._forward_started[chunk]
            for i in range(self._forward_pointer[chunk], len(order)):
                m = order[i]
                if not started[m] and Task(Phase.F, m, chunk) in ready:
                    best[chunk] = Task(Phase.F, m, chunk)
                    break
        return backwards, best

    # --- bookkeeping --------------------------------------------------------------------------
    def on_start(self, task: Task) -> None:
        super().on_start(task)
        m, chunk = task.microbatch, task.chunk
        if task.phase == Phase.F:
            if chunk == 0:
                self._reserved_bytes += self.graph.V * self._act[m]
                self._reserved_count += self.graph.V
            self._inflight[Task(Phase.F, m, chunk)] = None
            started = self._forward_started[chunk]
            started[m] = 1
            order, pointer = self.microbatch_order, self._forward_pointer[chunk]
            while pointer < len(order) and started[order[pointer]]:
                pointer += 1
            self._forward_pointer[chunk] = pointer
        elif task.phase == Phase.B:
            del self._inflight[Task(Phase.F, m, chunk)]
        else:
            self._weight_grad_due = None

    def on_finish(self, task: Task) -> None:
        super().on_finish(task)
        if task.phase == self._release:
            self._reserved_bytes -= self._act[task.microbatch]
            self._reserved_count -= 1
        if task.phase == Phase.B and self.graph.split_backward:
            self._weight_grad_due = self.graph.task_table[Phase.W][task.chunk][task.microbatch]

    def next_task(self, ready: Collection[Task]) -> Task | None:
        if not ready:
            return None
        if self._weight_grad_due is not None:
            return self._weight_grad_due
        backwards, forwards = self._candidates(ready)
        return self._choose(backwards, [t for t in forwards if t is not None and self._admits(t)])

    @abc.abstractmethod
    def _choose(self, backwards: list[Task], forwards: list[Task]) -> Task | None:
        """Pick among ready backwards and admissible ready forwards, or None to wait."""

    def _key(self, task: Task) -> tuple[int, int]:
        return self._position[task.microbatch], task.chunk


class GreedyScheduler(RuleBasedScheduler):
    """The reference rule: first ready backward, else first ready forward (earliest microbatch)."""

    def _choose(self, backwards, forwards):
        if backwards:
            return min(backwards, key=self._key)
        if forwards:
            return min(forwards, key=self._key)
        return None


class BreadthFirstScheduler(RuleBasedScheduler):
    """Forwards first, shallowest chunk first (fill the pipeline wide); backwards when none admits."""

    def _choose(self, backwards, forwards):
        if forwards:
            return min(forwards, key=lambda t: (t.chunk, self._position[t.microbatch]))
        if backwards:
            return min(backwards, key=lambda t: (-t.chunk, self._position[t.microbatch]))
        return None


class DepthFirstScheduler(RuleBasedScheduler):
    """Backwards first; forwards of the deepest chunk first (finish microbatches before new ones)."""

    def _choose(self, backwards, forwards):
        if backwards:
            return min(backwards, key=lambda t: (self._position[t.microbatch], -t.chunk))
        if forwards:
            return min(forwards, key=lambda t: (-t.chunk, self._position[t.microbatch]))
        return None
