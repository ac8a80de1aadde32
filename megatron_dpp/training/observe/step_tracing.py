"""--trace around the pipeline schedule: what a training iteration does besides its tasks, recorded
into the rank's trace like the schedule's tasks (same recorder, same clock), for the DPP runtime and
Megatron's own schedules alike.

- The gradient sync: config.finalize_model_grads_func, the public hook both the DPP runtime and
  Megatron's schedules call once the last backward of an iteration ran, is wrapped in a GRADIENT_SYNC
  span. Inside it Megatron's finalize_model_grads times each of its collectives on config.timers;
  those timers (FINALIZE_COLLECTIVES) become waits "in a collective: ..." on the compute lane.
- The optimizer step: an OPTIMIZER_STEP span (its gradient-norm all-reduce over the model-parallel
  group included).
- The other blocking collectives of the training loop (the loss all-reduce, agreeing on a stop
  signal): waits "in a collective: ...".
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Dict, Iterator

from megatron_dpp.trace.recorder import GRADIENT_SYNC, IN_COLLECTIVE, TraceRecorder
from megatron_dpp.training.observe.timer_hooks import HookedTimers

# Megatron-Core's timers inside finalize_model_grads, each around one kind of collective.
FINALIZE_COLLECTIVES: Dict[str, str] = {
    "all-grads-sync": "data-parallel gradient reduction",
    "conditional-embedder-grads-all-reduce": "conditional-embedder gradient all-reduce (pipeline group)",
    "non-tensor-parallel-grads-all-reduce": "layer-norm and non-tensor-parallel gradient all-reduce "
                                            "(tensor-parallel group)",
    "embedding-grads-all-reduce": "embedding gradient all-reduce (first and last pipeline stage)",
}
LOSS_ALL_REDUCE = "loss all-reduce (data-parallel group)"
STOP_AGREEMENT = "agreeing on a stop signal (all ranks)"


class StepTracer:
    """Records the parts of one rank's training step around the schedule into its recorder."""

    def __init__(self, recorder: TraceRecorder):
        self.recorder = recorder
        self._collective_started: Dict[str, float] = {}

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        """A span on the training-step lane (GRADIENT_SYNC, OPTIMIZER_STEP)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.recorder.step(name, started, time.perf_counter())

    @contextlib.contextmanager
    def collective(self, what: str) -> Iterator[None]:
        """A blocking collective: a wait on the compute lane, "in a collective: <what>"."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.recorder.wait(started, time.perf_counter(), f"{IN_COLLECTIVE} {what}")

    def traced_finalize(self, config, finalize: Callable) -> Callable:
        """`finalize` (config.finalize_model_grads_func) recorded as a GRADIENT_SYNC span, each of
        its collectives as a wait; config.timers is a stand-in only while it runs."""
        def finalize_model_grads(*args, **kwargs):
            replaced = config.timers
            config.timers = HookedTimers(FINALIZE_COLLECTIVES, self._collective_starts,
                                         self._collective_ends, replaced)
            try:
                with self.step(GRADIENT_SYNC):
                    return finalize(*args, **kwargs)
            finally:
                config.timers = replaced

        return finalize_model_grads

    def _collective_starts(self, timer: str) -> None:
        self._collective_started[timer] = time.perf_counter()

    def _collective_ends(self, timer: str) -> None:
        self.recorder.wait(self._collective_started.pop(timer), time.perf_counter(),
                           f"{IN_COLLECTIVE} {FINALIZE_COLLECTIVES[timer]}")
