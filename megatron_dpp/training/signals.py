"""SIGINT/SIGTERM, and --exit-duration-in-mins: stop at the next iteration boundary on every rank
together.

The handler only records the signal. After each iteration the ranks agree (one all-reduce) whether
any of them got one or is out of time, so they all stop after the same iteration, can save a
consistent checkpoint, and exit with 128 + signal number (0 when out of time, as Megatron-LM). A blocked collective is not interrupted: torchrun's SIGKILL after
its grace period (or the collective timeout) ends a rank whose peer is gone.
"""
from __future__ import annotations

import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class AgreedStop:
    """Why every rank stops after this iteration."""

    signal: int | None  # SIGINT/SIGTERM, received by some rank
    out_of_time: bool  # some rank found --exit-duration-in-mins passed


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

    def agreed_stop(self, out_of_time: bool = False) -> AgreedStop | None:
        """Collective over the world: whether any rank received a signal or is out of time
        (out_of_time: this rank's verdict on --exit-duration-in-mins), else None."""
        flags = torch.tensor([self.received or 0, int(out_of_time)], dtype=torch.int64,
                             device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        received, late = (int(value) for value in flags.tolist())
        if not received and not late:
            return None
        return AgreedStop(signal=received or None, out_of_time=bool(late))

    def any_rank(self, flag: bool) -> bool:
        """Collective over the world (as agreed_stop): whether `flag` holds on some rank."""
        value = torch.tensor([int(flag)], dtype=torch.int64, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return bool(value.item())
