"""One Chrome trace for the whole run: every rank's events as one process each, and a flow arrow
from each send to its receive, so Perfetto draws the pipeline as one picture.

Each arrow starts on the task that posted the message (the last task of that name to start at or
before its `send` instant, which comes at or after the task's end) and ends on the task that consumed it (the first task of that name on the receiver at or after
the `recv` instant). Both ends bind to the enclosing slice (`bp: e`) on the compute lane: the
instants of the messages lane are zero-length and nothing reliably encloses them. The send and
recv instants themselves stay on the messages lane, each with the arrow's `flow_id` in its args.
"""
from __future__ import annotations

import bisect
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from megatron_dpp.trace import chrome
from megatron_dpp.trace.recorder import COMPUTE_LANE
from trace_analysis.load import RunTraces
from trace_analysis.messages import MessageMatch
from trace_analysis.timeline import RunTimeline, TaskSpan

AGGREGATED_SUFFIX = "-aggregated.json"


def aggregated_path(run: RunTraces) -> Path:
    """Next to the rank files: DIR/<run>-aggregated.json (the loader reads benchmark-rank*.json only)."""
    return run.directory / f"{run.name}{AGGREGATED_SUFFIX}"


def flow_start(flow_id: int, name: str, pid: int, tid: int, time_us: float) -> dict:
    return {"name": name, "cat": "message", "ph": "s", "id": flow_id, "pid": pid, "tid": tid,
            "ts": time_us, "bp": "e"}


def flow_end(flow_id: int, name: str, pid: int, tid: int, time_us: float) -> dict:
    return {"name": name, "cat": "message", "ph": "f", "id": flow_id, "pid": pid, "tid": tid,
            "ts": time_us, "bp": "e"}


class _TasksByName:
    """A rank's tasks by name, each list in start order, for finding a message's task."""

    def __init__(self, run: RunTimeline):
        self._starts: Dict[Tuple[int, str], List[float]] = defaultdict(list)
        self._tasks: Dict[Tuple[int, str], List[TaskSpan]] = defaultdict(list)
        for rank in run.ranks:
            for task in rank.tasks:
                self._starts[(rank.rank, task.name)].append(task.start)
                self._tasks[(rank.rank, task.name)].append(task)

    def started_last_by(self, rank: int, name: str, time: float) -> Optional[TaskSpan]:
        index = bisect.bisect_right(self._starts[(rank, name)], time) - 1
        return self._tasks[(rank, name)][index] if index >= 0 else None

    def first_from(self, rank: int, name: str, time: float) -> Optional[TaskSpan]:
        index = bisect.bisect_left(self._starts[(rank, name)], time - 1.0)  # 1 µs of rounding
        tasks = self._tasks[(rank, name)]
        return tasks[index] if index < len(tasks) else None


def _inside(task: Optional[TaskSpan], time: float) -> float:
    """`time` moved inside `task`'s span (when there is a task), so the arrow binds to it."""
    if task is None:
        return time
    margin = min(1.0, task.duration / 2)
    return min(max(time, task.start + margin), task.end - margin)


def merged_events(traces: RunTraces, run: RunTimeline, match: MessageMatch) -> List[dict]:
    tasks = _TasksByName(run)
    flow_ids: Dict[Tuple[int, str, float], int] = {}
    flows: List[dict] = []
    for flow_id, pair in enumerate(match.pairs, start=1):
        send, recv = pair.send, pair.recv
        flow_ids[(send.rank, f"send {send.task}", send.time)] = flow_id
        flow_ids[(recv.rank, f"recv {recv.task}", recv.time)] = flow_id
        sender = tasks.started_last_by(send.rank, send.task, send.time)
        consumer = tasks.first_from(recv.rank, recv.task, recv.time)
        name = f"{send.task} -> {recv.task}"
        flows.append(flow_start(flow_id, name, send.rank, COMPUTE_LANE, _inside(sender, send.time)))
        start = recv.time if consumer is None else consumer.start
        flows.append(flow_end(flow_id, name, recv.rank, COMPUTE_LANE, _inside(consumer, start)))

    events: List[dict] = []
    for trace, timeline in zip(traces.ranks, run.ranks):
        events.append(chrome.process_name(trace.rank, timeline.label))
        events.append({"name": "process_sort_index", "ph": "M", "pid": trace.rank,
                       "args": {"sort_index": trace.rank}})
        for event in trace.events:
            if event.get("ph") == "M" and event.get("name") == "process_name":
                continue  # replaced by the label above, which adds the node
            event = {**event, "pid": trace.rank}
            key = (trace.rank, event.get("name"), event.get("ts"))
            if event.get("cat") == "message" and key in flow_ids:
                event["args"] = {**event.get("args", {}), "flow_id": flow_ids[key]}
            events.append(event)
    return events + flows


def write_aggregated(traces: RunTraces, run: RunTimeline, match: MessageMatch) -> Path:
    path = aggregated_path(traces)
    clocks = sorted({str(trace.metadata.get("clock", "")) for trace in traces.ranks} - {""})
    metadata = {
        "run": traces.name,
        "policy": run.policy,
        "ranks": [timeline.label for timeline in run.ranks],
        "files": [trace.path.name for trace in traces.ranks],
        "clock": "; ".join(clocks) or "unknown",
        "clock_aligned": all("clock_alignment" in trace.metadata for trace in traces.ranks),
        "flows": len(match.pairs),
        "unmatched_sends": len(match.unmatched_sends),
        "unmatched_receives": len(match.unmatched_recvs),
    }
    chrome.write_trace(str(path), merged_events(traces, run, match), metadata)
    return path
