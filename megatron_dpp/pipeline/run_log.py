"""RunLog: the one record of what a rank ran in one global batch, in the order it ran.

The rank's scheduler keeps it (RankScheduler.log): its `history` and `done` read it, and an
executor that times its tasks writes the times into the same entries (the runtime's iteration
record and trace read them there), so no executor keeps a second list of what has run.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_dpp.pipeline.task import Task


@dataclass
class RanTask:
    """One task the rank started. Times are the executor's clock (the runtime's
    time.perf_counter()); an executor that does not time its tasks leaves them 0."""

    task: Task
    started: float = 0.0  # its step began (after the decision)
    ended: float = 0.0  # its compute ended (before its output is posted)
    # Wall seconds of the executor's loop turn that ran it (harvest arrivals, decide, run, send).
    turn_seconds: float = 0.0


class RunLog:
    """What one rank started, in order, and how many of those tasks finished. One task runs at a
    time per rank, so every entry but possibly the last has finished."""

    def __init__(self):
        self.entries: list[RanTask] = []
        self.finished = 0

    def start(self, task: Task) -> RanTask:
        entry = RanTask(task)
        self.entries.append(entry)
        return entry

    def finish(self, task: Task) -> None:
        self.finished += 1

    @property
    def last(self) -> RanTask:
        """The task started last (the one running, between start and finish)."""
        return self.entries[-1]

    @property
    def tasks(self) -> list[Task]:
        """Every task started, in order."""
        return [entry.task for entry in self.entries]

    def __len__(self) -> int:
        return len(self.entries)
