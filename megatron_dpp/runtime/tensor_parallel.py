"""Task decisions inside a tensor-parallel group: rank 0 of the group decides, the others follow.

The ranks of a tensor-parallel group must run the same task sequence (their forward steps share
collectives), but their messages arrive at slightly different times, so each cannot decide alone. The
leader sends every decision point-to-point (three int64s) to each follower before running the task; a
follower receives decision k, waits for that task's input, and runs it. No collective per decision.
"""
from __future__ import annotations

from typing import Any, Callable, List

import torch

from megatron_dpp.pipeline import Phase, Task


class DecisionChannel:
    def __init__(self, transport: Any, tp_ranks: List[int], my_rank: int, tag_of: Callable[[int], int]):
        self.transport = transport
        self.leader = tp_ranks[0]
        self.followers = [r for r in tp_ranks if r != self.leader]
        self.is_leader = my_rank == self.leader
        self._tag_of = tag_of
        self.sequence = 0
        self._sends: List[Any] = []

    def publish(self, task: Task) -> None:
        """Leader: tell every follower that decision number `sequence` is `task`."""
        if not self.followers:
            return
        message = torch.tensor([int(task.phase), task.microbatch, task.chunk], dtype=torch.int64)
        tag = self._tag_of(self.sequence)
        for follower in self.followers:
            self._sends.append(self.transport.isend(message, follower, tag))
        self.sequence += 1

    def expect_next(self) -> Any:
        """Follower: the receive handle of the next decision."""
        handle = self.transport.irecv(self.leader, self._tag_of(self.sequence))
        self.sequence += 1
        return handle

    @staticmethod
    def decode(message: torch.Tensor) -> Task:
        phase, microbatch, chunk = (int(v) for v in message.tolist())
        return Task(Phase(phase), microbatch, chunk)

    def drain(self, wait: Callable[[Any, str], Any]) -> None:
        """Leader: wait until every decision was delivered (before the iteration ends)."""
        for handle in self._sends:
            wait(handle, "a decision message to be delivered")
        self._sends = []
