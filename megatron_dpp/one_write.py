"""A line printed by a rank goes out in one write.

The ranks of a node share their launcher's stdout and stderr pipes. print() writes the text and
its newline apart, and when Python runs unbuffered (PYTHONUNBUFFERED, common under SLURM and in
our tests) each is its own system call, so two ranks' lines could run together on one line. A
single write below PIPE_BUF (4096 bytes) to a pipe lands whole. Standard library only."""
from __future__ import annotations

import sys
from typing import Optional, TextIO


def say(line: str, stream: Optional[TextIO] = None) -> None:
    """Write `line` and its newline to `stream` (stderr by default) in one write, then flush."""
    stream = sys.stderr if stream is None else stream
    stream.write(line + "\n")
    stream.flush()
