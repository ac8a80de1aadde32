"""--profile: a window of training iterations profiled on the chosen ranks, as in Megatron-LM.

Megatron-LM's flags and counting: iteration i is the one that starts after i iterations completed,
and --profile-step-start S --profile-step-end E profile the iterations S <= i < E (logged as
iterations S+1..E). On each rank of --profile-ranks:

- --profile alone (Megatron-LM's nsys mode): `NsysCaptureRange` calls cudaProfilerStart when
  iteration S starts and cudaProfilerStop when iteration E-1 has ended, the capture range of
  `nsys profile --capture-range=cudaProfilerApi` (nsys records nothing outside it). CUDA only.
- --profile --use-pytorch-profiler: `TorchProfilerWindow` runs torch.profiler over the same
  iterations and writes TRACE_DIR/<run>/profile-rank<R>.json (torch's Chrome export: CPU operators,
  CUDA kernels on a GPU, with shapes). Works on CPU.

A run stopped inside the window closes it (the capture range, or the profile written with what it
has). The trainer calls `iteration_starts` / `iteration_ended` around every training step and
`close` when training ends.
"""
from __future__ import annotations

import abc
import argparse
import os
from typing import Optional, Union

import torch

NSYS_COMMAND = "nsys profile --capture-range=cudaProfilerApi"


def profile_activities() -> list:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


class _Window(abc.ABC):
    """Which iterations are profiled: [start, end) in iterations completed before each; the
    subclass opens and closes its profiler."""

    def __init__(self, start: int, end: int):
        self.start, self.end = start, end
        self.is_open = False
        self.profiled = 0

    def iteration_starts(self, iteration: int) -> None:
        """`iteration`: iterations completed so far."""
        if not self.is_open and self.start <= iteration < self.end:
            self.is_open = True
            self._open(iteration)

    def iteration_ended(self, iteration: int) -> None:
        """`iteration`: iterations completed, this one included."""
        if not self.is_open:
            return
        self.profiled += 1
        if iteration >= self.end:
            self.close()

    def close(self) -> None:
        """Close the window, if open."""
        if not self.is_open:
            return
        self.is_open = False
        self._close()

    @abc.abstractmethod
    def _open(self, iteration: int) -> None:
        """Start profiling as iteration `iteration` (completed before it) starts."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Stop profiling (and write what was recorded)."""


class NsysCaptureRange(_Window):
    """--profile: the nsys capture range (cudaProfilerStart/Stop) over the window."""

    def __init__(self, start: int, end: int, rank: int):
        super().__init__(start, end)
        self.rank = rank

    def _open(self, iteration: int) -> None:
        torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
        print(f" rank {self.rank}: nsys capture range opened (cudaProfilerStart) at iteration "
              f"{iteration + 1}, for `{NSYS_COMMAND}`", flush=True)

    def _close(self) -> None:
        torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
        print(f" rank {self.rank}: nsys capture range closed (cudaProfilerStop) after "
              f"{self.profiled} iteration(s) (from [{self.start}, {self.end})), for "
              f"`{NSYS_COMMAND}`", flush=True)


class TorchProfilerWindow(_Window):
    """--profile --use-pytorch-profiler: torch.profiler over the window, written to `path`."""

    def __init__(self, start: int, end: int, path: str):
        super().__init__(start, end)
        self.path = path
        self.profiler: Optional[torch.profiler.profile] = None

    def _open(self, iteration: int) -> None:
        self.profiler = torch.profiler.profile(activities=profile_activities(), record_shapes=True)
        self.profiler.start()

    def _close(self) -> None:
        self.profiler.stop()
        self.profiler.export_chrome_trace(self.path)
        self.profiler = None
        print(f" profile of {self.profiled} iteration(s) (from [{self.start}, {self.end})) written "
              f"to {self.path}", flush=True)


def make_profiler(args: argparse.Namespace, rank: int, run_directory: Optional[str]
                  ) -> Optional[Union[NsysCaptureRange, TorchProfilerWindow]]:
    """The profiling window of this rank under --profile, None when it does not profile."""
    if not args.profile or rank not in args.profile_ranks:
        return None
    if args.use_pytorch_profiler:
        return TorchProfilerWindow(args.profile_step_start, args.profile_step_end,
                                   os.path.join(run_directory, f"profile-rank{rank}.json"))
    return NsysCaptureRange(args.profile_step_start, args.profile_step_end, rank)
