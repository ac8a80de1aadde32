"""Megatron-LM's timers (--timing-log-level, --timing-log-option, --log-timers-to-tensorboard).

`Timers` is what Megatron-Core calls on `config.timers` (its public timing hook, on the model's
TransformerConfig and the OptimizerConfig): `timers(name, log_level=None)` gives a timer with
start() and stop(), or one that does nothing when its level is above --timing-log-level. So
Megatron-Core's own schedules, forward and backward steps, optimizer and gradient sync time
themselves here, the DPP runtime (which runs Megatron's forward_step and backward_step) included.

At each logged iteration every rank gathers its timers (one all-gather over all ranks) and the
rank that prints the log line prints Megatron-LM's block, per iteration, in milliseconds:

    (min, max) time across ranks (ms):
        forward-backward ...............................: (95.12, 95.40)

What differs from Megatron-Core's own Timers: on a GPU a timer records CUDA events on the current
stream instead of synchronizing the device at every start and stop, so timing does not make the
host wait; the events are read when the timers are logged (which waits for the last of them).
A span is then the device's: from the stream reaching start() to it finishing what was queued
before stop(). On the CPU a span is the host's wall time.

torch is imported where it is used: the flag parser reads this module's defaults before anything
heavy loads.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from megatron_dpp.training.observe.timer_hooks import NO_TIMER

LOG_LEVELS = (0, 1, 2)
LOG_OPTIONS = ("max", "minmax", "all")
DEFAULT_LOG_LEVEL, DEFAULT_LOG_OPTION = 0, "minmax"  # Megatron-LM's
_UNSPECIFIED_LEVEL = 2  # a timer first asked for without a level: Megatron-Core's maximum

# What each level logs, in Megatron-LM's order (its training_log). Megatron-LM names
# 'layernorm-grads-all-reduce'; Megatron-Core 0.16's finalize_model_grads times that collective
# as 'non-tensor-parallel-grads-all-reduce', and the conditional embedder's all-reduce too.
TIMERS_BY_LEVEL: Dict[int, tuple] = {
    1: ("forward-backward", "layernorm-grads-all-reduce", "non-tensor-parallel-grads-all-reduce",
        "conditional-embedder-grads-all-reduce", "embedding-grads-all-reduce", "all-grads-sync",
        "params-all-gather", "optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf",
        "optimizer-clip-main-grad", "optimizer-count-zeros", "optimizer-inner-step",
        "optimizer-copy-main-to-model-params", "optimizer"),
    2: ("batch-generator", "forward-compute", "backward-compute", "forward-recv", "forward-send",
        "backward-recv", "backward-send", "forward-send-forward-recv",
        "forward-send-backward-recv", "backward-send-forward-recv",
        "backward-send-backward-recv", "forward-backward-send-forward-backward-recv"),
}


# Megatron-LM's level-0 timers, which it logs at every --timing-log-level, each block right after
# what it times: the set-up (both set-up timers in one block, after "done with setup ..."), a
# checkpoint's load and save, an evaluation.
MODEL_SETUP = "model-and-optimizer-setup"
DATA_SETUP = "train/valid/test-data-iterators-setup"
LOAD_CHECKPOINT = "load-checkpoint"
SAVE_CHECKPOINT = "save-checkpoint"
EVALUATE = "evaluate"


def timers_to_log(log_level: int) -> List[str]:
    """The timers a log line reports at --timing-log-level log_level."""
    return [name for level in sorted(TIMERS_BY_LEVEL) if level <= log_level
            for name in TIMERS_BY_LEVEL[level]]


class _Timer:
    """Accumulates the time between start() and stop() calls until read."""

    def __init__(self, name: str, cuda: bool):
        self.name = name
        self.cuda = cuda
        self.started_at: Optional[float] = None  # host clock (CPU)
        self.start_event = None  # CUDA: the open span's start
        self.spans: list = []  # CUDA: (start, stop) event pairs not read yet
        self.seconds = 0.0  # what the closed spans read so far add up to

    @property
    def running(self) -> bool:
        return self.started_at is not None or self.start_event is not None

    def start(self, barrier: bool = False) -> None:
        if self.running:
            raise RuntimeError(f"timer {self.name!r} started while running")
        import torch

        if barrier:
            torch.distributed.barrier()
        if self.cuda:
            self.start_event = torch.cuda.Event(enable_timing=True)
            self.start_event.record()
        else:
            self.started_at = time.perf_counter()

    def stop(self, barrier: bool = False) -> None:
        if not self.running:
            raise RuntimeError(f"timer {self.name!r} stopped while not running")
        import torch

        if barrier:
            torch.distributed.barrier()
        if self.cuda:
            stop_event = torch.cuda.Event(enable_timing=True)
            stop_event.record()
            self.spans.append((self.start_event, stop_event))
            self.start_event = None
            self._read_finished()
        else:
            self.seconds += time.perf_counter() - self.started_at
            self.started_at = None

    def _read_finished(self) -> None:
        """Reads the spans the device has finished (no waiting), so few events stay alive."""
        while self.spans and self.spans[0][1].query():
            start, stop = self.spans.pop(0)
            self.seconds += start.elapsed_time(stop) / 1000.0

    def read(self, reset: bool) -> float:
        """Seconds accumulated (an open span counts up to now and stays open); waits for the
        device on CUDA."""
        running = self.running
        if running:
            self.stop()
        if self.spans:
            self.spans[-1][1].synchronize()
            self._read_finished()
        seconds = self.seconds
        if reset:
            self.seconds = 0.0
        if running:
            self.start()
        return seconds


@dataclass(frozen=True)
class TimerReport:
    """One log interval's timers, gathered from every rank: seconds per iteration."""

    names: List[str]  # the timers that ran on some rank, in the log's order
    per_rank: List[List[float]]  # [rank][name index]

    def min_max(self, name: str) -> tuple:
        """(min, max) over the ranks where the timer ran."""
        column = self.names.index(name)
        ran = [row[column] for row in self.per_rank if row[column] > 0.0]
        return min(ran), max(ran)

    def text(self, option: str) -> Optional[str]:
        """Megatron-LM's block for --timing-log-option option, in ms (None if nothing ran)."""
        if not self.names:
            return None
        if option == "all":
            lines = ["times across ranks (ms):"]
            for column, name in enumerate(self.names):
                lines.append(f"  {name}:")
                lines += [f"     rank {rank:2d}: {row[column] * 1000.0:.2f}"
                          for rank, row in enumerate(self.per_rank) if row[column] > 0.0]
            return "\n".join(lines)
        lines = ["max time across ranks (ms):" if option == "max"
                 else "(min, max) time across ranks (ms):"]
        for name in self.names:
            low, high = self.min_max(name)
            label = (name + " ").ljust(48, ".")
            lines.append(f"    {label}: {high * 1000.0:.2f}" if option == "max"
                         else f"    {label}: ({low * 1000.0:.2f}, {high * 1000.0:.2f})")
        return "\n".join(lines)


class Timers:
    """config.timers: Megatron-Core's Timers interface, at --timing-log-level log_level."""

    def __init__(self, log_level: int, device, host_clock: bool = False):
        """device: where the gathers' tensors go (the backend's device); host_clock: every span
        is the host's wall time, also on a GPU (the level-0 timers: set-up, checkpoints)."""
        if log_level not in LOG_LEVELS:
            raise ValueError(f"timing log level {log_level} is not one of {LOG_LEVELS}")
        self.log_level = log_level
        self.device = device
        self.cuda = device.type == "cuda" and not host_clock
        self.timers: Dict[str, _Timer] = {}

    def __call__(self, name: str, log_level: Optional[int] = None):
        timer = self.timers.get(name)
        if timer is not None:
            return timer
        level = _UNSPECIFIED_LEVEL if log_level is None else log_level
        if level > self.log_level:
            return NO_TIMER
        timer = self.timers[name] = _Timer(name, self.cuda)
        return timer

    def gather(self, names: Sequence[str], normalizer: float) -> TimerReport:
        """Collective over every rank (all call it with the same names): each rank's timers in
        names, read and reset, in seconds divided by normalizer (the iterations they cover)."""
        import torch

        from megatron_dpp.comm import collectives

        local = [self.timers[name].read(reset=True) / normalizer if name in self.timers else 0.0
                 for name in names]
        mine = torch.tensor(local, dtype=torch.float64, device=self.device)
        everyone = collectives.all_gather(mine)  # staged through the host under gloo on CUDA
        per_rank = [row.tolist() for row in everyone]
        ran = [column for column in range(len(names))
               if any(row[column] > 0.0 for row in per_rank)]
        return TimerReport(names=[names[column] for column in ran],
                           per_rank=[[row[column] for column in ran] for row in per_rank])


def level0_timers(device) -> Timers:
    """Megatron-LM's level-0 timers (MODEL_SETUP ... EVALUATE), kept at every --timing-log-level
    apart from config.timers (None at level 0, so that Megatron-Core's per-micro-batch timer
    calls stay off the training step); host wall time, as the work they time is the host's."""
    return Timers(0, device, host_clock=True)


def times_text(timers: Timers, names: Sequence[str], option: str) -> Optional[str]:
    """Megatron-LM's `timers.log(names)`: collective over every rank (all call it with the same
    names); the block of those timers' times since they were last read, in ms, by
    --timing-log-option option (None where none of them ran)."""
    return timers.gather(names, normalizer=1.0).text(option)


def timers_from_args(args, device) -> Optional[Timers]:
    """--timing-log-level's timers on the training device, or None at level 0 (none kept)."""
    return Timers(args.timing_log_level, device) if args.timing_log_level > 0 else None


def attach_timers(config, timers: Optional[Timers], barrier: bool) -> None:
    """Make Megatron-Core time itself on `timers`: a TransformerConfig or an OptimizerConfig;
    barrier: --no-barrier-with-level-1-timing's opposite (ranks meet as level-1 timers start)."""
    config.timers = timers
    config.barrier_with_L1_time = barrier


@contextlib.contextmanager
def timed(timers: Optional[Timers], name: str, log_level: int, barrier: bool = False):
    """The block, timed as `name` (nothing without timers or above their level)."""
    if timers is None:
        yield
        return
    timer = timers(name, log_level=log_level)
    timer.start(barrier=barrier)
    try:
        yield
    finally:
        timer.stop()


@contextlib.contextmanager
def timers_off(config):
    """No timing on `config` inside the block (evaluation, as in Megatron-LM)."""
    kept, config.timers = config.timers, None
    try:
        yield
    finally:
        config.timers = kept


class TimedIterator:
    """A data iterator whose every next() is timed as 'batch-generator' (level 2): loading and
    collating one micro-batch, the part of Megatron-LM's batch-generator timer that is the data
    loader's (its copies to the device follow in the forward step)."""

    def __init__(self, source, timers: Timers):
        self.source, self.timers = source, timers

    def __iter__(self):
        return self

    def __next__(self):
        timer = self.timers("batch-generator", log_level=2)
        timer.start()
        try:
            return next(self.source)
        finally:
            timer.stop()
