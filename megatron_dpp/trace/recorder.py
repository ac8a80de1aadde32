"""Per-rank recording of what a pipeline schedule did (the DPP runtime's, or Megatron-Core's own
1F1B and interleaved): a Chrome trace per rank.

Lanes (threads) of a rank's process: `compute` holds every task as a span named in the task's
short form (`F3.1`) and covering its compute alone, and the waits between them with their reason
(posting a task's output send is one: POSTING_SEND; a blocking collective another: IN_COLLECTIVE);
`messages` holds every send as it is posted and every receive as it is taken in; `training step`
holds what a training iteration does around the schedule's tasks (GRADIENT_SYNC, OPTIMIZER_STEP),
its collectives' waits being on the compute lane. A counter tracks the activation bytes held
against the budget (DPP only). Events are recorded in time.perf_counter() microseconds of this
rank; `write` puts them on the reference rank's clock (trace/clock.py's ClockAlignment).

With a DeviceClock (on a GPU, trace/device_clock.py) a task span is device time: from the event
recorded on the compute stream where the task starts to the one where it ends, on the same host
clock, read without waiting (at the next iteration mark, or at `write`); the host's own start and
duration of the task (its launches) stay in args host_ts and host_dur. Waits, messages and the
step lane are host times on any device.

Recording costs a list append per event; with no recorder the runtime skips it entirely.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from megatron_dpp.trace import chrome
from megatron_dpp.trace.clock import HOST_DURATION, HOST_START, ClockAlignment
from megatron_dpp.trace.device_clock import DeviceClock, DeviceSpan

COMPUTE_LANE, MESSAGE_LANE, STEP_LANE = 0, 1, 2
STEP_CATEGORY = "step"
# The spans of the training-step lane: Megatron's finalize_model_grads (data-parallel gradient
# reduction, embedding and layer-norm gradient all-reduces) and the optimizer's step (with its
# gradient-norm all-reduce).
GRADIENT_SYNC, OPTIMIZER_STEP = "gradient sync", "optimizer step"
# The reason of a wait in a blocking collective ("in a collective: loss all-reduce (...)").
IN_COLLECTIVE = "in a collective:"
# The reason of the wait that follows a task's span while its output send is posted (the
# transport's isend): not compute, so a task's span is its compute alone on both sides.
POSTING_SEND = "posting the output send of"
CLOCK = ("time.perf_counter (CLOCK_MONOTONIC) of each rank, moved onto the reference rank's clock "
         "(otherData.clock_alignment)")


def _us(seconds: float) -> float:
    return seconds * 1e6


class TraceRecorder:
    """The events of one rank; `write(path)` stores them as one Chrome trace."""

    def __init__(self, rank: int, label: str, device_clock: Optional[DeviceClock] = None):
        self.rank = rank
        self.device_clock = device_clock  # on a GPU: task spans in device time
        self.events: List[dict] = [
            chrome.process_name(rank, label),
            chrome.thread_name(rank, COMPUTE_LANE, "compute"),
            chrome.thread_name(rank, MESSAGE_LANE, "messages"),
            chrome.thread_name(rank, STEP_LANE, "training step"),
        ]

    def task_starts(self) -> Any:
        """Where a task starts on the device (a DeviceClock event), None without a device clock;
        pass it to `task_ends` right after the task's compute."""
        return None if self.device_clock is None else self.device_clock.start()

    def task_ends(self, device_start: Any) -> Optional[DeviceSpan]:
        """Where the task's compute ends on the device; pass it to `task`."""
        return None if device_start is None else self.device_clock.stop(device_start)

    def task(self, name: str, category: str, start: float, end: float, args: Dict[str, Any],
             device_span: Optional[DeviceSpan] = None) -> None:
        """A task that ran from host time `start` to `end`; with a `device_span` (task_ends'), its
        span becomes device time once the device has run it (the host times go to args)."""
        event = chrome.span(name, category, self.rank, COMPUTE_LANE, _us(start), _us(end - start),
                            args)
        self.events.append(event)
        if device_span is not None:
            def on_device(start_us: float, duration_us: float) -> None:
                event["args"] = {**event.get("args", {}), HOST_START: event["ts"],
                                 HOST_DURATION: event["dur"]}
                event["ts"], event["dur"] = start_us, duration_us

            self.device_clock.when_read(device_span, on_device)

    def wait(self, start: float, end: float, reason: str) -> None:
        self.events.append(chrome.span("wait", "idle", self.rank, COMPUTE_LANE, _us(start),
                                       _us(end - start), {"reason": reason}))

    def step(self, name: str, start: float, end: float) -> None:
        """A part of the training step around the schedule (GRADIENT_SYNC, OPTIMIZER_STEP)."""
        self.events.append(chrome.span(name, STEP_CATEGORY, self.rank, STEP_LANE, _us(start),
                                       _us(end - start)))

    def message(self, name: str, time: float, args: Dict[str, Any]) -> None:
        self.events.append(chrome.instant(name, "message", self.rank, MESSAGE_LANE, _us(time), args))

    def mark(self, name: str, time: float, args: Optional[Dict[str, Any]] = None) -> None:
        """An instant on the compute lane (an iteration boundary, say)."""
        self.events.append(chrome.instant(name, "iteration", self.rank, COMPUTE_LANE, _us(time), args))

    def iteration_starts(self, iteration: int, time: float, args: Dict[str, Any]) -> None:
        """The mark "iteration <i>"; with a device clock, also where the spans of tasks the device
        has run are read (never waiting for the rest)."""
        self.mark(f"iteration {iteration}", time, args)
        if self.device_clock is not None:
            self.device_clock.iteration_boundary()

    def memory(self, time: float, held_bytes: int, budget_bytes: int,
               stash_bytes: Optional[int] = None) -> None:
        """held/budget: the scheduler's accounting; stash (split backwards): the bytes the
        weight-gradient stash measurably holds, part of what `held` reserves."""
        values = {"held": held_bytes, "budget": budget_bytes}
        if stash_bytes is not None:
            values["stash"] = stash_bytes
        self.events.append(chrome.counter("activation bytes", self.rank, _us(time), values))

    def write(self, path: str, metadata: Dict[str, Any], alignment: ClockAlignment) -> None:
        """The events on the reference clock; the alignment goes into otherData.clock_alignment
        (and the device clock's calibration into otherData.device_clock)."""
        extra = {}
        if self.device_clock is not None:
            self.device_clock.finish()  # end of the run: the one wait for the device's last tasks
            extra["device_clock"] = self.device_clock.metadata()
        chrome.write_trace(path, alignment.correct_events(self.events),
                           {"clock": CLOCK, "clock_alignment": alignment.metadata(), **extra,
                            **metadata})
