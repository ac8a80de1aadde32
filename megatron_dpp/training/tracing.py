"""--trace: where a run's per-rank traces go and what they say about the run.

Every rank of a traced run writes TRACE_DIR/<run>/benchmark-rank<R>.json (megatron_dpp.trace's
recorder) when training ends; <run> is the start time and the layout, agreed on by all ranks.
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dpp.trace.recorder import TraceRecorder


def run_name(args: argparse.Namespace, started: float) -> str:
    """E.g. 20261124-153000-pp2-vpp2-tp2-dpp: the start time and the parallel layout."""
    parts = [time.strftime("%Y%m%d-%H%M%S", time.localtime(started)),
             f"pp{args.pipeline_model_parallel_size}"]
    if args.virtual_pipeline_model_parallel_size:
        parts.append(f"vpp{args.virtual_pipeline_model_parallel_size}")
    if args.tensor_model_parallel_size > 1:
        parts.append(f"tp{args.tensor_model_parallel_size}")
    if args.data_parallel_size > 1:
        parts.append(f"dp{args.data_parallel_size}")
    parts.append("dpp")
    return "-".join(parts)


@dataclass
class RunTrace:
    recorder: TraceRecorder
    path: str
    metadata: dict

    def write(self) -> None:
        self.recorder.write(self.path, self.metadata)


def start_trace(args: argparse.Namespace) -> RunTrace:
    """Collective: rank 0 names the run, every rank makes the directory and its recorder."""
    name = [run_name(args, time.time())]
    dist.broadcast_object_list(name, src=0)
    directory = os.path.join(args.trace_dir, name[0])
    os.makedirs(directory, exist_ok=True)
    rank = dist.get_rank()
    pp = parallel_state.get_pipeline_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_rank()
    dp = parallel_state.get_data_parallel_rank()
    recorder = TraceRecorder(rank, f"rank {rank} (pp {pp}, tp {tp}, dp {dp})")
    metadata = {"run": name[0], "rank": rank, "pipeline_rank": pp, "tensor_rank": tp,
                "data_rank": dp, "policy": args.dpp_policy}
    return RunTrace(recorder, os.path.join(directory, f"benchmark-rank{rank}.json"), metadata)
