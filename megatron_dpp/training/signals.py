"""SIGINT/SIGTERM: stop at the next iteration boundary on every rank together.

The handler only records the signal. After each iteration the ranks agree (one all-reduce) whether
any of them got one, so they all stop after the same iteration, can save a consistent checkpoint,
and exit with 128 + signal number. A blocked collective is not interrupted: torchrun's SIGKILL after
its grace period (or the collective timeout) ends a rank whose peer is gone.
"""
from __future__ import annotations

import signal

import torch
import torch.distributed as dist


class StopSignals:
    def __init__(self, device: torch.device, group=None):
        """device: where the flag lives, which `group`'s backend must take (None: the default
        group; a CPU device with a gloo group keeps the agreement off the GPU's stream)."""
        self.device = device
        self.group = group
        self.received: int | None = None
        self._previous = {}

    def __enter__(self) -> "StopSignals":
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _record(self, signum, _frame) -> None:
        if self.received is None:
            self.received = signum

    def agreed_stop(self) -> int | None:
        """Collective over the world: the signal number if any rank received one, else None."""
        flag = torch.tensor([self.received or 0], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        value = int(flag.item())
        return value or None
