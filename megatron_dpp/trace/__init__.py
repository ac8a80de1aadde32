"""Run-time recording (standard library only): `chrome.py`, the one Chrome-trace writer (the
simulator's timelines use it too), and `recorder.py`, the per-rank recorder the DPP runtime fills
under --trace (tasks, waits with their reason, messages, activation memory).

Not here yet: clock alignment across nodes, NVTX ranges, recording Megatron's own schedules, and
the aggregation behind `profiling/aggregate.py`."""
