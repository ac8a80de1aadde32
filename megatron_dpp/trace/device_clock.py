"""GPU-true task spans for --trace: CUDA events around each task, read without a host-device sync.

On a GPU the host only launches a task's kernels and runs ahead; the device runs them later. A task
span on the host clock would measure the launches. Here each task gets an event recorded on the
current (compute) stream where it starts and one where it ends, and its span is the time between
the two on the device, put on the host's clock (time.perf_counter):

- Calibration. Events only give relative times (elapsed_time, milliseconds). A reference event is
  tied to the host clock with the stream idle: note the host time, record the event, wait for it
  (on an idle stream it completes at once), note the host time again; the event happened between
  the two, so at their midpoint within half the window (`error_us`). An event e is then at
  reference_host + reference.elapsed_time(e). At trace start the clock synchronizes once (not yet
  training); afterwards it re-calibrates whenever it finds the stream idle at an iteration boundary
  (Stream.query() does not wait; after the loss reporting's own sync it usually is idle), which
  bounds the drift between the device's and the host's clocks. Each span uses the calibration that
  was current when it ran, so elapsed times are never negative.
- Reading. Nothing waits for an event during training: a span is read once its end event has
  completed (Event.query(), which does not wait), at each iteration boundary for what has
  completed, and at the end of the run (after one synchronize, off the training path) for the rest.

The events, the stream and synchronize are passed in (`for_current_cuda_device` gives torch's), so
the logic runs on CPU with stand-ins.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, List

# A re-calibration whose window is wider than this (the host was descheduled, or the stream was
# not idle after all) is dropped; the previous calibration stays.
MAX_RECALIBRATION_ERROR_US = 50.0
# How long a re-calibration waits (polling query(), never synchronizing) for its reference event
# on a stream that said it was idle.
RECALIBRATION_POLL_LIMIT_S = 0.001


@dataclass(frozen=True)
class Calibration:
    """`event` happened at `host_us` on the host clock (time.perf_counter microseconds), within
    +-error_us."""

    event: Any
    host_us: float
    error_us: float


@dataclass(frozen=True)
class DeviceSpan:
    """A task's two events on the stream, and the calibration that was current when it ran (one
    iteration boundary never falls inside a task)."""

    start: Any
    end: Any
    calibration: Calibration


@dataclass
class _PendingSpan:
    span: DeviceSpan
    on_ready: Callable[[float, float], None]  # (device start us on the host clock, duration us)


class DeviceClock:
    """Device-timed spans on the host clock; see the module docstring.

    new_event(): an event with record() (on the current stream), query(), elapsed_time(other)
    (milliseconds) and synchronize(); stream_idle(): whether the current stream has no work left
    (does not wait); synchronize(): waits for the device (trace start and end only)."""

    def __init__(self, new_event: Callable[[], Any], stream_idle: Callable[[], bool],
                 synchronize: Callable[[], None],
                 host_clock: Callable[[], float] = time.perf_counter):
        self._new_event, self._stream_idle = new_event, stream_idle
        self._synchronize, self._host_clock = synchronize, host_clock
        self._pending: List[_PendingSpan] = []
        self.calibrations = 0
        self.calibration = self._calibrate_synchronized()

    @classmethod
    def for_current_cuda_device(cls) -> "DeviceClock":
        import torch  # only here: the rest of megatron_dpp.trace is standard library only

        return cls(lambda: torch.cuda.Event(enable_timing=True),
                   lambda: torch.cuda.current_stream().query(), torch.cuda.synchronize)

    # ---- calibration --------------------------------------------------------------------------
    def _host_us(self) -> float:
        return self._host_clock() * 1e6

    def _calibrate_synchronized(self) -> Calibration:
        """At trace start, before training: the device is idle once synchronize returns."""
        self._synchronize()
        before = self._host_us()
        event = self._new_event()
        event.record()
        event.synchronize()  # on an idle device: at once
        after = self._host_us()
        self.calibrations += 1
        return Calibration(event, (before + after) / 2, (after - before) / 2)

    def _recalibrate_if_idle(self) -> None:
        """A new calibration where the stream is idle already; never waits beyond a short poll."""
        if not self._stream_idle():
            return
        before = self._host_us()
        event = self._new_event()
        event.record()
        deadline = self._host_clock() + RECALIBRATION_POLL_LIMIT_S
        while not event.query():
            if self._host_clock() > deadline:
                return
        after = self._host_us()
        if (after - before) / 2 <= MAX_RECALIBRATION_ERROR_US:
            self.calibrations += 1
            self.calibration = Calibration(event, (before + after) / 2, (after - before) / 2)

    # ---- spans --------------------------------------------------------------------------------
    def start(self) -> Any:
        """An event recorded where a task starts on the current stream; pass it to `stop`."""
        event = self._new_event()
        event.record()
        return event

    def stop(self, start_event: Any) -> DeviceSpan:
        """The task's compute ends here on the stream (record it before anything else, such as
        posting the task's output, is queued); pass the span to `when_read`."""
        event = self._new_event()
        event.record()
        return DeviceSpan(start_event, event, self.calibration)

    def when_read(self, span: DeviceSpan, on_ready: Callable[[float, float], None]) -> None:
        """`on_ready(start_us, duration_us)` once the span's events have completed (read at an
        iteration boundary or at `finish`)."""
        self._pending.append(_PendingSpan(span, on_ready))

    def iteration_boundary(self) -> None:
        """Read the spans that completed and re-calibrate if the stream is idle; never waits."""
        self._read(lambda pending: pending.span.end.query())
        self._recalibrate_if_idle()

    def finish(self) -> None:
        """End of the trace: synchronize once and read every span left."""
        self._synchronize()
        self._read(lambda pending: True)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _read(self, completed: Callable[[_PendingSpan], bool]) -> None:
        waiting = []
        for pending in self._pending:
            if not completed(pending):  # the end event follows the start on the same stream
                waiting.append(pending)
                continue
            span = pending.span
            reference = span.calibration
            start_us = reference.host_us + reference.event.elapsed_time(span.start) * 1e3
            pending.on_ready(start_us, span.start.elapsed_time(span.end) * 1e3)
        self._pending = waiting

    def metadata(self) -> dict:
        """otherData.device_clock of a trace."""
        return {"task_spans": "device time (CUDA events on the compute stream)",
                "calibrations": self.calibrations, "last_error_us": self.calibration.error_us}

