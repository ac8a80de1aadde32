"""A torchrun entry point for benchmarks/trace_overhead.py: pinned_rank.py's, plus a stopwatch on
every method of the trace recorder that records an event, so a traced run measures how long its own
recording took, iteration by iteration, in the same iterations it times:

    python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/recording_time_rank.py <flags> --trace

At exit each rank prints one line, RECORDING_PREFIX and JSON: {"rank": r, "ms": [...]}, the
milliseconds spent recording in each schedule call (from one iteration mark to the next; the spans
of the step after the schedule fall into its iteration). The stopwatch's own two clock reads per
event are counted in, so the figure errs high.
"""
import atexit
import json
import os
import sys
import time

from pinned_rank import pin_to_own_core, run_pretrain_gpt

RECORDING_PREFIX = "RECORDING_MS "
RECORDING_METHODS = ("task", "wait", "step", "message", "mark", "memory")


def install_stopwatch() -> None:
    from megatron_dpp.trace.recorder import TraceRecorder

    spent = [0.0]  # seconds spent in recording methods so far
    at_marks: list = []  # `spent` when each iteration mark was recorded

    def timed(method):
        def wrapper(self, *args, **kwargs):
            started = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - started
        return wrapper

    def timed_mark(method):
        def wrapper(self, name, *args, **kwargs):
            if name.startswith("iteration "):
                at_marks.append(spent[0])
            return method(self, name, *args, **kwargs)
        return wrapper

    for name in RECORDING_METHODS:
        setattr(TraceRecorder, name, timed(getattr(TraceRecorder, name)))
    TraceRecorder.mark = timed_mark(TraceRecorder.mark)

    def report() -> None:
        bounds = [*at_marks, spent[0]]
        per_iteration = [(b - a) * 1e3 for a, b in zip(bounds, bounds[1:])]
        line = RECORDING_PREFIX + json.dumps({"rank": int(os.environ.get("RANK", 0)),
                                              "ms": per_iteration})
        # One write, so the two ranks' lines (one pipe under torchrun) do not interleave.
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    atexit.register(report)


if __name__ == "__main__":
    pin_to_own_core()
    install_stopwatch()
    run_pretrain_gpt()
