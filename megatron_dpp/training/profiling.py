"""--profile: torch.profiler over a window of training iterations on the chosen ranks.

Megatron-LM's flags and counting: iteration i is the one that starts after i iterations completed,
and --profile-step-start S --profile-step-end E profile the iterations S <= i < E (logged as
iterations S+1..E). Each rank of --profile-ranks starts the profiler when such an iteration starts
and stops it after the last, then writes TRACE_DIR/<run>/profile-rank<R>.json (torch's Chrome
export: CPU operators, CUDA kernels on a GPU). A run stopped inside the window writes what it has.
"""
from __future__ import annotations

import argparse
import os
from typing import Optional

import torch


def profile_activities() -> list:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


class IterationProfiler:
    """One rank's profiling window; the trainer calls `iteration_starts` / `iteration_ended` around
    every training step and `close` when training ends."""

    def __init__(self, start: int, end: int, path: str):
        self.start, self.end, self.path = start, end, path
        self.profiler: Optional[torch.profiler.profile] = None
        self.profiled = 0

    def iteration_starts(self, iteration: int) -> None:
        """`iteration`: iterations completed so far."""
        if self.profiler is None and self.start <= iteration < self.end:
            self.profiler = torch.profiler.profile(activities=profile_activities(),
                                                   record_shapes=True)
            self.profiler.start()

    def iteration_ended(self, iteration: int) -> None:
        """`iteration`: iterations completed, this one included."""
        if self.profiler is None:
            return
        self.profiled += 1
        if iteration >= self.end:
            self.close()

    def close(self) -> None:
        """Stop and write, if the window is open."""
        if self.profiler is None:
            return
        self.profiler.stop()
        self.profiler.export_chrome_trace(self.path)
        self.profiler = None
        print(f" profile of {self.profiled} iteration(s) (from [{self.start}, {self.end})) written "
              f"to {self.path}", flush=True)


def make_profiler(args: argparse.Namespace, rank: int,
                  run_directory: Optional[str]) -> Optional[IterationProfiler]:
    """The profiler of this rank under --profile, None when it does not profile."""
    if not args.profile or rank not in args.profile_ranks:
        return None
    return IterationProfiler(args.profile_step_start, args.profile_step_end,
                             os.path.join(run_directory, f"profile-rank{rank}.json"))
