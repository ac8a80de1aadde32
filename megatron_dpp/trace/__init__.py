"""Run-time recording (standard library only): `chrome.py`, the one Chrome-trace writer (the
simulator's timelines use it too); `recorder.py`, the per-rank recorder that the DPP runtime and
Megatron's own schedules (training/observe/megatron_tracing.py) fill under --trace (tasks, waits with their
reason, messages, activation memory); `clock.py`, the arithmetic that puts every rank's events on
rank 0's clock (the ping-pong itself is training/observe/clock_sync.py); `device_clock.py`, task spans in
device time on a GPU (CUDA events, given by its caller, read without a host-device sync).

NVTX ranges (--nvtx) are pushed by the runtime itself (runtime/executor.py), Megatron's schedules'
tracer and the trainer (training/step.py); --profile's nsys capture range or torch.profiler
(--use-pytorch-profiler) runs from training/observe/profiler_window.py, and the aggregation lives in `trace_analysis/`."""
