"""Tasks: what one pipeline rank computes, in a short form that prints and parses back.

`F3.1` is the forward of microbatch 3 on the rank's local chunk 1, `B3.1` its backward (its input
gradient, when backwards are split), `W3.1` its weight gradient. Schedules, logs, state reports,
traces and tests all speak this form: `Task.parse(str(task)) == task`.
"""
from __future__ import annotations

import enum
import re
from typing import NamedTuple


class Phase(enum.IntEnum):
    """What a task computes. An IntEnum so Task hashes as fast as a plain tuple.

    F: forward. B: backward; with a split backward (TaskGraph(split_backward=True)) only the input
    gradient, which the previous stage waits for. W: the weight gradient of a split backward, a
    local task that nothing downstream waits for (zero-bubble style).
    """

    F = 0
    B = 1
    W = 2

    def __str__(self) -> str:
        return self.name

    @property
    def label(self) -> str:
        """The phase in words, as traces categorise tasks: forward, backward, weight-grad."""
        return _PHASE_LABELS[self]


_PHASE_LABELS = {Phase.F: "forward", Phase.B: "backward", Phase.W: "weight-grad"}

_TASK_FORM = re.compile(r"([FBW])(\d+)\.(\d+)")


class Task(NamedTuple):
    """One unit of work on one rank: `phase` of `microbatch` on the rank's LOCAL `chunk` (0..V-1).

    `microbatch` is always the microbatch's index in the global batch as the data iterator yields it
    (an index into TaskGraph.sizes), whatever order a schedule processes microbatches in.
    """

    phase: Phase
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.phase.name}{self.microbatch}.{self.chunk}"

    @classmethod
    def parse(cls, text: str) -> "Task":
        """The task `str(task)` printed: 'F3.1' -> Task(Phase.F, 3, 1)."""
        match = _TASK_FORM.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"not a task: {text!r}; expected a phase F, B or W, a microbatch, a dot "
                             "and a chunk, e.g. 'F3.1'")
        phase, microbatch, chunk = match.groups()
        return cls(Phase[phase], int(microbatch), int(chunk))


def format_tasks(tasks) -> str:
    """A task list as one line, 'F0.0 F1.0 B0.0', the form parse_tasks reads back."""
    return " ".join(str(task) for task in tasks)


def parse_tasks(text: str) -> list[Task]:
    """The tasks format_tasks printed."""
    return [Task.parse(word) for word in text.split()]
