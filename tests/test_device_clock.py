"""--trace on a GPU: task spans in device time (megatron_dpp/trace/device_clock.py), tested on CPU
with a simulated device: one stream that runs launched work after the host launches it, events
that complete when the stream reaches them, a device clock with its own offset and drift, and a
count of every host-device synchronization."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from _gpu import gpu_env
from _runtime_harness import run_pipeline
from megatron_dpp.trace.clock import ClockAlignment, OffsetSample
from megatron_dpp.trace.device_clock import MAX_RECALIBRATION_ERROR_US, DeviceClock
from megatron_dpp.trace.recorder import TraceRecorder


class FakeDevice:
    """Host time `now` (seconds) moves only when the test says so or when the host waits.
    The device's own clock reads DEVICE_OFFSET + t * (1 + drift) at host time t."""

    DEVICE_OFFSET = 1000.0

    def __init__(self, drift: float = 0.0, launch_latency: float = 2e-6):
        self.now = 10.0
        self.drift, self.launch_latency = drift, launch_latency
        self.stream_free_at = 0.0  # host time at which the stream has run everything launched
        self.synchronizations = 0  # device synchronize + event synchronize

    # ---- the host side of a training step ----
    def advance(self, seconds: float) -> None:
        self.now += seconds

    def launch(self, seconds: float) -> None:
        """A kernel of `seconds` on the stream: starts once the stream is free."""
        self.stream_free_at = max(self.stream_free_at, self.now + self.launch_latency) + seconds

    # ---- what DeviceClock is given ----
    def host_clock(self) -> float:
        """Reading the clock takes a little time (so that a poll loop ends)."""
        self.now += 1e-7
        return self.now

    def new_event(self):
        return FakeEvent(self)

    def stream_idle(self) -> bool:
        return self.now >= self.stream_free_at

    def synchronize(self) -> None:
        self.synchronizations += 1
        self.now = max(self.now, self.stream_free_at)

    def device_time(self, host_time: float) -> float:
        return self.DEVICE_OFFSET + host_time * (1 + self.drift)


class FakeEvent:
    def __init__(self, device: FakeDevice):
        self.device = device
        self.at = None  # host time at which the stream reaches it

    def record(self):
        device = self.device
        self.at = max(device.stream_free_at, device.now + device.launch_latency)
        device.stream_free_at = self.at

    def query(self) -> bool:
        return self.device.now >= self.at

    def synchronize(self):
        self.device.synchronizations += 1
        self.device.now = max(self.device.now, self.at)

    def elapsed_time(self, end: "FakeEvent") -> float:
        """Milliseconds on the device's clock; both must have completed, as for CUDA events."""
        if not (self.query() and end.query()):
            raise RuntimeError("CUDA error: device not ready")
        return (self.device.device_time(end.at) - self.device.device_time(self.at)) * 1e3


def make_clock(device: FakeDevice) -> DeviceClock:
    return DeviceClock(device.new_event, device.stream_idle, device.synchronize, device.host_clock)


def run_iteration(device, clock, tasks, on_span, task_seconds=0.004, launch_seconds=0.001):
    """The host launches `tasks` tasks (each launch_seconds of host time, task_seconds of device
    work) far ahead of the device, then waits for the loss as a training step does; returns the
    true device (start, end) host times of each task."""
    clock.iteration_boundary()
    truth = []
    for _ in range(tasks):
        start = clock.start()
        device.advance(launch_seconds)
        device.launch(task_seconds)
        clock.when_read(clock.stop(start), on_span)
        truth.append((start.at, device.stream_free_at))
    device.synchronize()  # the loss reporting's own .item(), not the clock's
    device.advance(0.0005)
    return truth


def test_spans_are_device_times_on_the_host_clock_without_a_sync_per_task():
    device = FakeDevice()
    clock = make_clock(device)
    assert device.synchronizations == 2  # calibration at trace start: synchronize + its event
    spans, truth = [], []
    for _ in range(3):
        before = device.synchronizations
        truth += run_iteration(device, clock, 5, lambda s, d: spans.append((s, d)))
        assert device.synchronizations == before + 1  # the training step's own sync, no other
    clock.iteration_boundary()
    assert clock.pending == 0 and len(spans) == 15
    error_us = clock.calibration.error_us
    for (start_us, duration_us), (start, end) in zip(spans, truth):
        assert start_us == pytest.approx(start * 1e6, abs=error_us + 1e-3)
        assert duration_us == pytest.approx((end - start) * 1e6, abs=1e-3)
    # The device runs behind the host's launches: span i starts after the host launched it.
    assert spans[-1][0] > spans[0][0] + 4 * 4000


def test_spans_wait_for_their_events_and_finish_reads_the_rest():
    device = FakeDevice()
    clock = make_clock(device)
    spans = []
    clock.iteration_boundary()
    start = clock.start()
    device.launch(0.010)
    clock.when_read(clock.stop(start), lambda s, d: spans.append((s, d)))
    before = device.synchronizations
    clock.iteration_boundary()  # the device has not run it yet: nothing read, nothing waited for
    assert spans == [] and clock.pending == 1 and device.synchronizations == before
    clock.finish()  # end of the trace: one synchronize
    assert device.synchronizations == before + 1
    assert len(spans) == 1 and spans[0][1] == pytest.approx(10_000, abs=1e-3)


def test_recalibration_at_idle_boundaries_bounds_drift():
    drift = 1e-4  # 100 ppm: 10 us off after 0.1 s
    spans_fixed, spans_recalibrated, truth = [], [], []
    for spans, recalibrate in ((spans_fixed, False), (spans_recalibrated, True)):
        device = FakeDevice(drift=drift)
        clock = make_clock(device)
        if not recalibrate:
            clock._recalibrate_if_idle = lambda: None
        truth = []
        for _ in range(20):
            truth += run_iteration(device, clock, 4, lambda s, d: spans.append((s, d)))
            device.advance(0.1)
        clock.finish()
        if recalibrate:
            assert clock.calibrations > 10
            assert clock.calibration.error_us <= MAX_RECALIBRATION_ERROR_US
    last_start = truth[-1][0] * 1e6
    assert abs(spans_fixed[-1][0] - last_start) > 100  # drifted by about 2 s * 100 ppm = 200 us
    assert abs(spans_recalibrated[-1][0] - last_start) < 20


def test_no_recalibration_while_the_stream_is_busy():
    device = FakeDevice()
    clock = make_clock(device)
    device.launch(0.050)
    calibrations = clock.calibrations
    clock.iteration_boundary()
    assert clock.calibrations == calibrations and device.synchronizations == 2


def test_recorder_keeps_host_times_as_args_and_corrects_both_clocks(tmp_path):
    device = FakeDevice()
    recorder = TraceRecorder(0, "rank 0", make_clock(device))
    recorder.iteration_starts(0, device.now, {"forward_only": False, "policy": "test"})
    host_start = device.now
    device_start = recorder.task_starts()
    device.advance(0.001)
    device.launch(0.004)
    device_span = recorder.task_ends(device_start)
    device.launch(0.002)  # queued after the task's compute (posting its output): not in its span
    recorder.task("F0.0", "forward", host_start, device.now, {"microbatch": 0},
                  device_span=device_span)
    alignment = ClockAlignment.from_samples(0, OffsetSample(0.0, 250.0, 1.0),
                                            OffsetSample(1e9, 250.0, 1.0))
    path = tmp_path / "trace.json"
    recorder.write(str(path), {"run": "test"}, alignment)
    document = json.loads(path.read_text())
    (span,) = [e for e in document["traceEvents"] if e.get("ph") == "X"]
    assert span["args"]["host_ts"] == pytest.approx(host_start * 1e6 - 250.0)
    assert span["args"]["host_dur"] == pytest.approx(1000.0)
    # From where the stream reached the task's start (the host then launched for 1 ms, the stream
    # idle meanwhile) to the end of its 4 ms kernel.
    assert span["dur"] == pytest.approx(5000.0, abs=1e-3)
    assert span["ts"] - span["args"]["host_ts"] == pytest.approx(2.0, abs=5.0)  # launch latency
    assert span["args"]["microbatch"] == 0
    assert document["otherData"]["device_clock"]["calibrations"] >= 1


def test_recorder_without_device_clock_records_host_times():
    recorder = TraceRecorder(0, "rank 0")
    assert recorder.task_starts() is None and recorder.task_ends(None) is None
    recorder.iteration_starts(0, 1.0, {})
    recorder.task("F0.0", "forward", 1.0, 1.5, {"microbatch": 0}, device_span=None)
    (span,) = [e for e in recorder.events if e.get("ph") == "X"]
    assert (span["ts"], span["dur"]) == (1e6, 5e5) and "host_ts" not in span["args"]


def _device_spans(events):
    """The task spans, each read from the device (its host times in args)."""
    spans = [e for e in events if e.get("ph") == "X" and e["cat"] != "idle"]
    assert spans and all({"host_ts", "host_dur"} <= set(e["args"]) for e in spans), spans[:3]
    assert all(e["dur"] >= 0 for e in spans)
    return spans


def test_dpp_runtime_records_every_task_kind_in_device_time(tmp_path):
    """The DPP runtime (threads harness, split backwards: F, B and W) with a device clock per rank:
    every task span is resolved; the clock synchronizes only at trace start and end."""
    devices = {rank: FakeDevice() for rank in range(2)}
    recorders = {rank: TraceRecorder(rank, f"rank {rank}", make_clock(devices[rank]))
                 for rank in range(2)}

    def run_recorded(rank, runner):
        runner.recorder = runner.session.recorder = recorders[rank]
        runner.run()

    result = run_pipeline(2, 1, [5, 9, 3, 7], "dpp:adaptive", split_backward=True,
                          rank_fn=run_recorded)
    assert not result.errors, result.errors
    alignment = ClockAlignment.from_samples(0, OffsetSample(0.0, 0.0, 0.0),
                                            OffsetSample(1.0, 0.0, 0.0))
    for rank, recorder in recorders.items():
        assert devices[rank].synchronizations == 2  # the calibration at trace start only
        recorder.write(str(tmp_path / f"rank{rank}.json"), {}, alignment)
        assert devices[rank].synchronizations == 3  # and one at the end, in write
        spans = _device_spans(recorder.events)  # the toy model launches nothing on this device
        assert sorted(e["name"][0] for e in spans) == sorted("FBW" * 4)


def test_megatron_schedule_steps_in_device_time():
    from megatron_dpp.training.observe.megatron_tracing import MegatronScheduleTracer

    device = FakeDevice()
    recorder = TraceRecorder(0, "rank 0", make_clock(device))
    tracer = MegatronScheduleTracer(recorder, pipeline_rank=0, pipeline_size=2, microbatch_work=len,
                                    policy="megatron 1f1b")

    class Config:
        timers = None
        microbatch_group_size_per_vp_stage = None

    def schedule(*, data_iterator, model, num_microbatches, forward_only):
        for phase in ("forward", "forward", "backward", "backward"):
            Config.timers(f"{phase}-compute", log_level=2).start()
            device.advance(0.001)
            device.launch(0.003)
            Config.timers(f"{phase}-compute").stop()

    tracer.run(schedule, Config, {"data_iterator": iter([]), "model": object(), "num_microbatches": 2,
                                  "forward_only": False})
    recorder.device_clock.finish()
    spans = _device_spans(recorder.events)
    assert [e["name"] for e in spans] == ["F0.0", "F1.0", "B0.0", "B1.0"]
    # The first step waits for its own launch (1 ms) then runs 3 ms; the device then runs behind the
    # host, so each later step is its 3 ms kernel alone.
    assert [e["dur"] for e in spans] == pytest.approx([4000.0, 3000.0, 3000.0, 3000.0], abs=1e-3)
    # The device runs the four steps back to back, behind the host's launches.
    for before, after in zip(spans, spans[1:]):
        assert after["ts"] >= before["ts"] + before["dur"] - 1.0


# On a GPU: the threads harness with CUDA tensors and a real DeviceClock per rank, under
# torch.cuda.set_sync_debug_mode("error") (reading the spans must not synchronize); every task span
# is resolved, starts no earlier than its host launch and lasts longer than zero.
_DEVICE_SPANS_ON_GPU = r"""
import os, tempfile
import torch
from _runtime_harness import run_pipeline
from megatron_dpp.trace.clock import ClockAlignment, OffsetSample
from megatron_dpp.trace.device_clock import DeviceClock
from megatron_dpp.trace.recorder import TraceRecorder

torch.cuda.init()
recorders = {rank: TraceRecorder(rank, f"rank {rank}", DeviceClock.for_current_cuda_device())
             for rank in range(2)}

def run_recorded(rank, runner):
    runner.recorder = runner.session.recorder = recorders[rank]
    runner.run()

result = run_pipeline(2, 1, [3, 1, 4, 1, 5, 9, 2, 6], "dpp:adaptive", split_backward=True,
                      device="cuda", sync_debug_mode="error", timeout_s=60.0, join_s=120.0,
                      rank_fn=run_recorded)
assert not result.errors, result.errors
alignment = ClockAlignment.from_samples(0, OffsetSample(0.0, 0.0, 0.0), OffsetSample(1.0, 0.0, 0.0))
directory = tempfile.mkdtemp()
for rank, recorder in recorders.items():
    recorder.write(os.path.join(directory, f"rank{rank}.json"), {}, alignment)
    spans = [e for e in recorder.events if e.get("ph") == "X" and e["cat"] != "idle"]
    error = recorder.device_clock.calibration.error_us
    assert spans and all("host_ts" in e["args"] and e["dur"] > 0 for e in spans), spans[:3]
    assert all(e["ts"] >= e["args"]["host_ts"] - 2 * error - 50 for e in spans), spans[:3]
    print("ok rank", rank, len(spans), "spans", flush=True)
"""


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_device_spans_on_a_gpu_without_a_synchronization_per_task():
    result = subprocess.run([sys.executable, "-c", _DEVICE_SPANS_ON_GPU],
                            cwd=str(Path(__file__).resolve().parent), env=gpu_env(),
                            capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert result.stdout.count("ok rank") == 2, result.stdout
