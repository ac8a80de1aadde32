"""Checks of a traced run's per-rank files (--trace), shared by tests/test_trace.py and the
two-node tests: one run directory, messages that pair up with the task that feeds them and arrive
after they left (on rank 0's clock, within the stored error), clock alignment fields that are sane.
"""
from __future__ import annotations

import json
from pathlib import Path

from megatron_dpp.pipeline import Task, TaskGraph, parse_placement

# Half a gloo round trip bounds the alignment error; even on a loaded machine it is far below this.
MAX_ALIGNMENT_ERROR_US = 50_000


def load_traces(trace_dir: Path, world_size: int) -> tuple[Path, dict[int, dict]]:
    """The one run directory under trace_dir and each rank's trace document."""
    runs = list(trace_dir.iterdir())
    assert len(runs) == 1, runs
    return runs[0], {rank: json.loads((runs[0] / f"benchmark-rank{rank}.json").read_text())
                     for rank in range(world_size)}


def check_clock_alignment(traces: dict[int, dict]) -> None:
    """Every rank on rank 0's clock. The ranks share one machine's clock in these tests, so the
    true offset is 0 and each estimate must lie within its own error bound."""
    for rank, trace in traces.items():
        alignment = trace["otherData"]["clock_alignment"]
        assert alignment["reference_rank"] == 0 and alignment["timestamps_corrected"] is True
        if rank == 0:
            assert (alignment["offset_us"], alignment["drift"], alignment["error_us"]) == (0, 0, 0)
            continue
        assert 0 < alignment["error_us"] < MAX_ALIGNMENT_ERROR_US, alignment
        assert abs(alignment["offset_us"]) <= alignment["error_us"], alignment
        # The drift's own bound: two measurements, each within +-error_us, measured_for_us apart.
        assert alignment["measured_for_us"] > 0, alignment
        assert abs(alignment["drift"]) <= 2 * alignment["error_us"] / alignment["measured_for_us"], \
            alignment


def check_messages(traces: dict[int, dict], chunks: int, microbatches: int) -> None:
    """Each receive pairs with exactly one send by (sender, receiver, tag); the send is named for
    the task that feeds the receive's task, and the receive comes no earlier than the send, within
    both ranks' alignment errors."""
    pipeline_rank = {rank: trace["otherData"]["pipeline_rank"] for rank, trace in traces.items()}
    pipeline_size = 1 + max(pipeline_rank.values())
    placement = parse_placement(next(iter(traces.values()))["otherData"]["placement"])
    assert (placement.P, placement.V) == (pipeline_size, chunks), placement
    graph = TaskGraph(pipeline_size, chunks, microbatches, placement=placement)
    error = {rank: trace["otherData"]["clock_alignment"]["error_us"]
             for rank, trace in traces.items()}
    sends, receives = {}, []
    for rank, trace in traces.items():
        for event in trace["traceEvents"]:
            if event.get("cat") != "message":
                continue
            kind, _, task = event["name"].partition(" ")
            peer, tag = event["args"]["peer"], event["args"]["tag"]
            if kind == "send":
                key = (rank, peer, tag)
                assert key not in sends, f"two sends {key}"
                sends[key] = (Task.parse(task), event["ts"])
            else:
                receives.append((peer, rank, tag, Task.parse(task), event["ts"]))
    assert receives and len(receives) == len(sends), (len(receives), len(sends))
    for sender, receiver, tag, task, received in receives:
        sent_task, sent = sends.pop((sender, receiver, tag))
        assert graph.output_target(pipeline_rank[sender], sent_task) == (
            pipeline_rank[receiver], task), (sender, sent_task, receiver, task)
        assert received >= sent - error[sender] - error[receiver], (
            f"recv {task} on rank {receiver} at {received} before send {sent_task} on rank "
            f"{sender} at {sent}")
