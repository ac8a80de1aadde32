"""Where one rank's host time goes in training: a pp=1 run on one process, with the training
iterations from --from-iteration on under cProfile and, on a GPU, under
torch.cuda.set_sync_debug_mode("warn") (every call that makes the host wait for the device is
counted at its call site). Writes a report: each iteration's host time, the synchronizing call sites
with a stack each, and the profile sorted by own time and by cumulative time.

    python tools/host_profile.py --report runs/host_profile.txt -- TRAINER_FLAGS...
    python tools/host_profile.py --model bert --report R -- TRAINER_FLAGS...

TRAINER_FLAGS are megatron_dpp.pretrain's (a recipe's, as a launcher prints them with --dry-run):
    FLAGS=$(PP=1 TP=1 NPROC=1 bash run_scripts/run_single_gpt.sh --dry-run --train-iters 12 2>&1 \\
            | tail -1 | sed 's/.* -m megatron_dpp.pretrain_gpt //')
    python tools/host_profile.py --report runs/host_profile.txt -- $FLAGS

cProfile slows Python code (not the device, nor C++ such as the autograd engine), so the profiled
iterations take longer than plain ones; compare shares within a report, not its times with a log's.
On a GPU the autograd engine runs backward on its own thread, which cProfile does not see: Python
called from backward (hooks, custom functions' backward) is inside `run_backward` there. Only the
training thread is profiled, on every Python (ThreadProfile).
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import pstats
import sys
import threading
import time
import traceback
import types
import warnings

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ("gpt", "bert", "llama")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        usage="python tools/host_profile.py [--model M] --report FILE [--from-iteration N] "
              "[--top N] -- TRAINER_FLAGS...")
    parser.add_argument("--model", choices=MODELS, default="gpt", help="the model (gpt)")
    parser.add_argument("--report", required=True, help="the report file to write")
    parser.add_argument("--from-iteration", type=int, default=6,
                        help="first profiled training iteration, counted from 1 (6: after start-up "
                             "and torch.compile's first calls)")
    parser.add_argument("--top", type=int, default=50, help="rows of each profile table (50)")
    return parser


class ThreadProfile:
    """cProfile of the thread that enables it, with whole call trees, on every Python.

    Up to Python 3.11 cProfile hooks the enabling thread only (sys.setprofile). From 3.12 on it
    listens through sys.monitoring, and two things break its one call stack (seen on 3.12.1 and
    3.13.0; the GPU images ship 3.12.3): events come from every thread (the watchdog, heartbeats;
    on a GPU the autograd engine's hooks), and a C function called as a bound method (e.g. a
    classmethod over a builtin) is reported to CALL as the bound method, which cProfile does not
    count as a C call, but to C_RETURN as the function, which it does: each such call pops its
    caller's frame. Whole call trees then count as recursive and lose their cumulative time, and
    the training step's own frames vanish. So there each of cProfile's callbacks is wrapped: only
    this thread's events pass, and a bound method is passed as its function and `self` at CALL
    as at C_RETURN (every profiled call costs a little more). The wrapping happens as cProfile
    registers its callbacks, before it turns the events on: wrapped afterwards, another thread
    could run a whole GIL switch interval of calls into the profile in between."""

    def __init__(self):
        self.profile = cProfile.Profile()

    def enable(self) -> None:
        monitoring = getattr(sys, "monitoring", None)
        if monitoring is None:
            self.profile.enable()
            return
        register = monitoring.register_callback
        thread = threading.get_ident()
        wrapped = []

        def register_wrapped(tool, event, callback):
            if callback is not None:
                callback = _this_thread_only(monitoring, event, callback, thread)
                wrapped.append(event)
            return register(tool, event, callback)

        # cProfile's enable looks register_callback up on sys.monitoring, then calls set_events.
        monitoring.register_callback = register_wrapped
        try:
            self.profile.enable()
        finally:
            monitoring.register_callback = register
        if not wrapped:
            self.profile.disable()
            raise RuntimeError("cProfile did not register its callbacks through "
                               "sys.monitoring.register_callback on this Python: its profile "
                               "would mix the threads' calls")

    def disable(self) -> None:
        self.profile.disable()


def _this_thread_only(monitoring, event: int, callback, thread: int):
    """`callback`, for events of `thread` only; at CALL, C_RETURN and C_RAISE a bound method is
    passed as its function and `self` (see ThreadProfile)."""
    if event in (monitoring.events.CALL, monitoring.events.C_RETURN, monitoring.events.C_RAISE):
        def forward_call(code, offset, function, self_argument):
            if threading.get_ident() != thread:
                return None
            if isinstance(function, types.MethodType):
                function, self_argument = function.__func__, function.__self__
            return callback(code, offset, function, self_argument)

        return forward_call

    def forward(*args):
        if threading.get_ident() != thread:
            return None
        return callback(*args)

    return forward


class IterationProfiler:
    """Wraps Trainer.train_step: times every call; profiles those from `first` on."""

    def __init__(self, first: int):
        self.first = first
        self.calls = 0
        self.host_seconds: list[float] = []
        self.profile = ThreadProfile()
        self.sync_sites: collections.Counter = collections.Counter()
        self.sync_stacks: dict = {}
        self.cuda = False
        self.profiled_once = False  # the profile holds data (pstats refuses an empty one)

    def install(self) -> None:
        import torch

        from megatron_dpp.training import step

        self.cuda = torch.cuda.is_available()
        original = step.Trainer.train_step
        profiler = self

        def train_step(trainer, data_iterators):
            profiler.calls += 1
            active = profiler.calls >= profiler.first
            if active:
                profiler._start(torch)
            start = time.perf_counter()
            try:
                return original(trainer, data_iterators)
            finally:
                profiler.host_seconds.append(time.perf_counter() - start)
                if active:
                    profiler._stop(torch)

        step.Trainer.train_step = train_step

    def _start(self, torch) -> None:
        if self.cuda:
            self._saved_showwarning = warnings.showwarning
            warnings.showwarning = self._count_sync
            self._filters = warnings.filters[:]
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        self.profiled_once = True
        self.profile.enable()

    def _stop(self, torch) -> None:
        self.profile.disable()
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
            warnings.filters[:] = self._filters
            warnings.showwarning = self._saved_showwarning

    def _count_sync(self, message, category, filename, lineno, file=None, line=None) -> None:
        key = (f"{filename}:{lineno}", str(message).split("(Triggered")[0].strip()[:100])
        self.sync_sites[key] += 1
        if key not in self.sync_stacks:
            self.sync_stacks[key] = "".join(traceback.format_stack(limit=14)[:-2])

    @property
    def profiled(self) -> int:
        return max(0, self.calls - self.first + 1)

    def report(self, top: int) -> str:
        times = ", ".join(f"{seconds * 1e3:.1f}" for seconds in self.host_seconds)
        out = [f"host time per training iteration (ms, iterations 1..{self.calls}; "
               f"profiled from {self.first}): {times}",
               f"profiled iterations: {self.profiled}", ""]
        if not self.cuda:
            out.append("synchronizing calls: not checked (no CUDA device)")
        elif not self.sync_sites:
            out.append("synchronizing calls: none seen (torch's sync debug mode)")
        else:
            out.append("synchronizing calls (torch's sync debug mode), per profiled iteration:")
            for (site, message), count in self.sync_sites.most_common():
                out.append(f"  {count / max(1, self.profiled):g} x {site}: {message}")
                out.append("    " + self.sync_stacks[(site, message)].replace("\n", "\n    "))
        if self.profiled_once:
            for order in ("tottime", "cumulative"):
                text = io.StringIO()
                pstats.Stats(self.profile.profile, stream=text).sort_stats(order).print_stats(top)
                out += ["", f"== cProfile of the profiled iterations, by {order} ==", text.getvalue()]
        return "\n".join(out) + "\n"


def _one_rank_environment() -> None:
    """torchrun's variables for a single process (a run on one GPU, or on the CPU)."""
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                        ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(29500 + os.getpid() % 2000))):
        os.environ.setdefault(name, value)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        build_parser().error("put the trainer's flags after `--`")
    split = argv.index("--")
    args = build_parser().parse_args(argv[:split])
    trainer_flags = argv[split + 1:]
    if args.from_iteration < 1:
        build_parser().error(f"--from-iteration {args.from_iteration}: expected 1 or more")
    report_dir = os.path.dirname(os.path.abspath(args.report))
    if not os.path.isdir(report_dir):
        build_parser().error(f"--report {args.report}: no directory {report_dir}")
    sys.path.insert(0, REPO_ROOT)
    _one_rank_environment()
    from megatron_dpp import kernels
    from megatron_dpp.pretrain import main as pretrain_main

    kernels.install_warning_filters()  # before Megatron-Core is imported, as the trainer does
    kernels.import_megatron_core()  # as the trainer does

    profiler = IterationProfiler(args.from_iteration)
    profiler.install()
    returncode = pretrain_main(trainer_flags, model=args.model,
                               prog=f"tools/host_profile.py --model {args.model} --")
    with open(args.report, "w") as report:
        report.write(profiler.report(args.top))
    print(f"host_profile: {profiler.profiled} iterations profiled; report: {args.report}")
    if returncode == 0 and profiler.profiled == 0:
        print(f"host_profile: the run had {profiler.calls} iterations, fewer than "
              f"--from-iteration {args.from_iteration}: nothing was profiled", file=sys.stderr)
        return 1
    return returncode


if __name__ == "__main__":
    sys.exit(main())
