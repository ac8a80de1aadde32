"""--trace: where a run's per-rank traces go, what they say about the run, and their common clock.

Every rank of a traced run writes TRACE_DIR/<run>/benchmark-rank<R>.json (megatron_dpp.trace's
recorder) when training ends; <run> is the start time, the layout and the schedule, agreed on by all
ranks. The DPP runtime and Megatron's own schedules (training/observe/megatron_tracing.py) fill the same
recorder. Each rank measures its clock against rank 0's at start and at end (training/observe/clock_sync.py)
and writes its events on rank 0's clock.

A trace never fails a run: a file that cannot be written (the disk full, no permission, the
directory gone) is one warning line on the rank, naming the file and the reason, and no temporary
file stays (trace/chrome.py's write_trace); training's exit code is its own. At start, one warning
line per node when the trace directory's filesystem has clearly too little free space for the
traces (trace_space_warning).
"""
from __future__ import annotations

import argparse
import os
import shutil
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dpp.comm.nodes import this_node_rank
from megatron_dpp.one_write import say
from megatron_dpp.pipeline.placement import INTERLEAVED, named_placement
from megatron_dpp.pipeline.registry import ONE_F_ONE_B
from megatron_dpp.trace.clock import ClockAlignment, OffsetSample
from megatron_dpp.trace.device_clock import DeviceClock
from megatron_dpp.trace.recorder import TraceRecorder
from megatron_dpp.training.observe.clock_sync import REFERENCE_RANK, clock_group, measure_offset

# What ordered the tasks, as the run name ends: the DPP runtime, or Megatron's own schedule.
DPP_SCHEDULE = "dpp"
MEGATRON_INTERLEAVED_SCHEDULE = "interleaved"
MEGATRON_1F1B_SCHEDULE = ONE_F_ONE_B


def schedule_name(args: argparse.Namespace) -> str:
    if getattr(args, "use_dpp", False):
        return DPP_SCHEDULE
    if args.parallel.virtual_pipeline_model_parallel_size:
        return MEGATRON_INTERLEAVED_SCHEDULE
    return MEGATRON_1F1B_SCHEDULE


def policy_label(args: argparse.Namespace) -> str:
    """otherData.policy and each iteration mark's: the DPP policy, or `megatron <schedule>`."""
    schedule = schedule_name(args)
    if schedule != DPP_SCHEDULE:
        return f"megatron {schedule}"
    if getattr(args, "dpp_schedule", None) is not None:
        return f"schedule file {os.path.basename(args.dpp_schedule)}"
    return args.dpp_policy


def run_name(args: argparse.Namespace, started: float) -> str:
    """E.g. 20261124-153000-pp2-vpp2-tp2-dpp: the start time, the parallel layout, the schedule."""
    parts = [time.strftime("%Y%m%d-%H%M%S", time.localtime(started)),
             f"pp{args.pipeline_model_parallel_size}"]
    if args.parallel.virtual_pipeline_model_parallel_size:
        parts.append(f"vpp{args.parallel.virtual_pipeline_model_parallel_size}")
    if args.tensor_model_parallel_size > 1:
        parts.append(f"tp{args.tensor_model_parallel_size}")
    if args.parallel.data_parallel_size > 1:
        parts.append(f"dp{args.parallel.data_parallel_size}")
    parts.append(schedule_name(args))
    return "-".join(parts)


# The size of a trace, measured on the tiny GPT at pp=2, M=8 (tests/_train_util.py's TINY_GPT_ARGS,
# 4 iterations): a task brings 3.6 to 4.5 events (its span, its waits, its messages, the memory
# counter, its share of the step lane), an event 170 to 185 bytes of JSON; a rank's file was 670
# to 760 bytes a task. The estimate takes less of both: it warns only when space is clearly short.
TRACE_EVENTS_PER_TASK = 3.5
TRACE_BYTES_PER_EVENT = 160


def estimated_trace_bytes(args: argparse.Namespace) -> int:
    """A low estimate of one rank's trace: the training iterations x the microbatches of one x the
    tasks of a microbatch on a rank (F and B, and W with --dpp-split-backward, per model chunk) x
    TRACE_EVENTS_PER_TASK x TRACE_BYTES_PER_EVENT. Evaluation iterations are left out."""
    data_parallel = max(1, args.parallel.data_parallel_size)
    microbatches = max(1, args.global_batch_size // (args.micro_batch_size * data_parallel))
    chunks = args.parallel.virtual_pipeline_model_parallel_size or 1
    split = getattr(args, "use_dpp", False) and getattr(args, "dpp_split_backward", False)
    phases = 3 if split else 2  # F, B (and W)
    tasks = (args.train_iters or 0) * microbatches * chunks * phases
    return int(tasks * TRACE_EVENTS_PER_TASK * TRACE_BYTES_PER_EVENT)


def trace_space_warning(directory: str, ranks: int, per_rank_bytes: int,
                        free: int | None = None) -> str | None:
    """The warning line when `directory`'s filesystem has less free space than the traces of
    `ranks` ranks need (per_rank_bytes each); None when they fit or the free space is unknown."""
    needed = ranks * per_rank_bytes
    if free is None:
        try:
            free = shutil.disk_usage(directory).free
        except OSError:
            return None
    if free >= needed:
        return None
    return (f"megatron_dpp: warning: trace directory {directory} has {free} bytes free, and the "
            f"traces of this node's {ranks} rank(s) need about {needed} bytes; they may not be "
            f"written (training is unaffected)")


def trace_write_warning(path: str, error: OSError) -> str:
    """The one line a rank prints when its trace cannot be written."""
    if error.errno is not None and error.strerror:
        reason = f"[Errno {error.errno}] {error.strerror}"
    else:
        reason = str(error) or type(error).__name__
    return (f"megatron_dpp: warning: could not write the trace {path}: {reason}; training is "
            f"unaffected")


def _warn(line: str) -> None:
    say(line)


def _node_metadata() -> dict:
    """otherData.node: torchrun's node rank, where torchrun says it."""
    try:
        return {"node": this_node_rank()}
    except ValueError:
        return {}


@dataclass
class RunTrace:
    recorder: TraceRecorder
    path: str
    metadata: dict
    clock_group: dist.ProcessGroup
    clock_at_start: OffsetSample

    def write(self) -> bool:
        """Collective (the end-of-trace clock measurement): every rank, at the same point. The file
        is written after the measurement, so a rank whose write fails has entered it like the
        others; a write that fails is one warning line (trace_write_warning), not an error.
        Returns whether the file was written."""
        at_end = measure_offset(self.clock_group)
        alignment = ClockAlignment.from_samples(REFERENCE_RANK, self.clock_at_start, at_end)
        try:
            self.recorder.write(self.path, self.metadata, alignment)
        except OSError as error:
            _warn(trace_write_warning(self.path, error))
            return False
        return True


def agree_run_directory(args: argparse.Namespace) -> str:
    """Collective: rank 0 names the run, every rank makes TRACE_DIR/<run>/ (where --trace and
    --profile write) and returns it."""
    name = [run_name(args, time.time())]
    dist.broadcast_object_list(name, src=0)
    directory = os.path.join(args.trace_dir, name[0])
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError:
        # --trace alone: the trace's write at the end says so, in its one line (the directory is
        # missing then); torch.profiler's files need the directory as before.
        if getattr(args, "profile", False) and getattr(args, "use_pytorch_profiler", False):
            raise
    return directory


def start_trace(args: argparse.Namespace, directory: str) -> RunTrace:
    """Collective: every rank makes its recorder and measures its clock against rank 0's.
    `directory` is agree_run_directory's."""
    rank = dist.get_rank()
    pp = parallel_state.get_pipeline_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_rank()
    dp = parallel_state.get_data_parallel_rank()
    # On a GPU, task spans are device time (trace/device_clock.py; calibrating synchronizes once).
    device_clock = DeviceClock.for_current_cuda_device() if torch.cuda.is_available() else None
    recorder = TraceRecorder(rank, f"rank {rank} (pp {pp}, tp {tp}, dp {dp})", device_clock)
    metadata = {"run": os.path.basename(directory), "rank": rank, "world_size": dist.get_world_size(),
                "pipeline_rank": pp, "tensor_rank": tp, "data_rank": dp,
                "schedule": schedule_name(args), "policy": policy_label(args),
                "placement": str(named_placement(
                    getattr(args, "dpp_stage_placement", INTERLEAVED),
                    parallel_state.get_pipeline_model_parallel_world_size(),
                    parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1)),
                **_node_metadata()}
    if int(os.environ.get("LOCAL_RANK", rank)) == 0:  # one line per node
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        warning = trace_space_warning(directory, ranks_here, estimated_trace_bytes(args))
        if warning is not None:
            _warn(warning)
    group = clock_group(timedelta(minutes=args.distributed_timeout_minutes))
    return RunTrace(recorder, os.path.join(directory, f"benchmark-rank{rank}.json"), metadata,
                    group, measure_offset(group))
