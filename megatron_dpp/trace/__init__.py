"""Run-time recording (standard library only): `chrome.py`, the one Chrome-trace writer (the
simulator's timelines use it too); `recorder.py`, the per-rank recorder that the DPP runtime and
Megatron's own schedules (training/megatron_tracing.py) fill under --trace (tasks, waits with their
reason, messages, activation memory); `clock.py`, the arithmetic that puts every rank's events on
rank 0's clock (the ping-pong itself is training/clock_sync.py).

NVTX ranges (--nvtx) are pushed by the runtime itself (runtime/executor.py), torch.profiler
(--profile) runs from training/profiling.py, and the aggregation lives in `profiling/`."""
