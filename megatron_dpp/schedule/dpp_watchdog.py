"""No-progress detection for the DPP runtime: report this rank's state and end the job.

Every wait in the runtime is bounded by the time left before the deadline; each task run or message
arrival counts as progress and moves the deadline. When the deadline passes the rank prints what it was
waiting for and exits with a non-zero status, so torchrun tears the job down instead of it hanging.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Callable, List


class ProgressDeadline:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s

    def progressed(self) -> None:
        self._deadline = time.monotonic() + self.timeout_s

    def remaining(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self._deadline


def report_and_exit(reason: str, state_lines: List[str], exit_code: int,
                    exit_fn: Callable[[int], None] = os._exit) -> None:
    """Print the rank's state to stderr and exit at once.

    os._exit, not an exception: an exception would run interpreter shutdown, where transport threads
    and process-group destructors can block on the very peer that stopped answering.
    """
    rank = os.environ.get("RANK", "?")
    lines = [f"[dpp rank {rank}] {reason}"] + [f"[dpp rank {rank}]   {line}" for line in state_lines]
    sys.stderr.write("\n".join(lines) + "\n")
    sys.stderr.flush()
    sys.stdout.flush()
    exit_fn(exit_code)
