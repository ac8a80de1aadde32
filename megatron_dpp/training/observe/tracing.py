"""--trace: where a run's per-rank traces go, what they say about the run, and their common clock.

Every rank of a traced run writes TRACE_DIR/<run>/benchmark-rank<R>.json (megatron_dpp.trace's
recorder) when training ends; <run> is the start time, the layout and the schedule, agreed on by all
ranks. The DPP runtime and Megatron's own schedules (training/observe/megatron_tracing.py) fill the same
recorder. Each rank measures its clock against rank 0's at start and at end (training/observe/clock_sync.py)
and writes its events on rank 0's clock.
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dpp.comm.nodes import this_node_rank
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
    return args.dpp_policy if schedule == DPP_SCHEDULE else f"megatron {schedule}"


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

    def write(self) -> None:
        """Collective (the end-of-trace clock measurement): every rank, at the same point."""
        at_end = measure_offset(self.clock_group)
        alignment = ClockAlignment.from_samples(REFERENCE_RANK, self.clock_at_start, at_end)
        self.recorder.write(self.path, self.metadata, alignment)


def agree_run_directory(args: argparse.Namespace) -> str:
    """Collective: rank 0 names the run, every rank makes TRACE_DIR/<run>/ (where --trace and
    --profile write) and returns it."""
    name = [run_name(args, time.time())]
    dist.broadcast_object_list(name, src=0)
    directory = os.path.join(args.trace_dir, name[0])
    os.makedirs(directory, exist_ok=True)
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
                "schedule": schedule_name(args), "policy": policy_label(args), **_node_metadata()}
    group = clock_group(timedelta(minutes=args.distributed_timeout_minutes))
    return RunTrace(recorder, os.path.join(directory, f"benchmark-rank{rank}.json"), metadata,
                    group, measure_offset(group))
