"""No-progress detection for the DPP runtime: report this rank's state and end the job.

Two layers:
- Inside the pipeline schedule, every wait is bounded by the time left before a `ProgressDeadline`;
  each task run or message arrival counts as progress and moves it. When it passes, the runtime prints
  what it was waiting for (ready tasks, awaited tags, bytes held) and exits non-zero.
- Around it, a `StallWatchdog` thread covers the blocking collectives a training step also makes
  (the batch-size agreement, gradient all-reduces, the optimizer's norm): a peer that stops while this
  rank sits in one of them would otherwise hang it for the process-group timeout. The watchdog fires a
  little after the deadline, so inside the schedule the runtime's richer report comes first.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, List, Optional

from megatron_dpp.rank_failure import record_failure


class ProgressClock:
    """When this process last made progress (a task ran, a message arrived, a step phase began)."""

    def __init__(self):
        self.last = time.monotonic()

    def tick(self) -> None:
        self.last = time.monotonic()


# One per process: the runtime's deadlines tick it, the training loop's watchdog reads it.
PROCESS_PROGRESS = ProgressClock()


class ProgressDeadline:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s

    def progressed(self) -> None:
        self._deadline = time.monotonic() + self.timeout_s
        PROCESS_PROGRESS.tick()

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
    record_failure(lines[0], exit_code)
    sys.stdout.flush()
    exit_fn(exit_code)


class StallWatchdog:
    """A thread that ends the job when an armed phase makes no progress for `timeout_s`.

    `arm(phase)` names what the rank is doing (and counts as progress); `disarm()` stops watching
    (checkpoint saves and logging may take as long as they need). The thread sleeps on an Event, so
    it costs no CPU; `close()` stops and joins it.
    """

    def __init__(self, timeout_s: float, exit_code: int, clock: ProgressClock = PROCESS_PROGRESS,
                 exit_fn: Callable[[int], None] = os._exit):
        self.timeout_s = timeout_s
        self.exit_code = exit_code
        self.clock = clock
        self.exit_fn = exit_fn
        self._phase: Optional[str] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dpp-stall-watchdog")
        self._thread.start()

    def arm(self, phase: str) -> None:
        self.clock.tick()
        self._phase = phase

    def disarm(self) -> None:
        self._phase = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        check_every_s = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(check_every_s):
            phase = self._phase
            if phase is None:
                continue
            stalled_s = time.monotonic() - self.clock.last
            if stalled_s >= self.timeout_s:
                report_and_exit(
                    f"no progress for {self.timeout_s:g} s (watchdog)",
                    [f"stuck in: {phase}",
                     f"last progress {stalled_s:.1f} s ago; a peer rank has probably stopped"],
                    self.exit_code, self.exit_fn)
