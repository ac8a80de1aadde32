"""The Chrome trace format (opens as is in Perfetto and chrome://tracing): the one writer of the
runtime's per-rank traces and the simulator's timelines. Times are microseconds."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterable, List, Optional


def process_name(pid: int, name: str) -> dict:
    return {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}


def thread_name(pid: int, tid: int, name: str) -> dict:
    return {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}


def span(name: str, category: str, pid: int, tid: int, start_us: float, duration_us: float,
         args: Optional[Dict[str, Any]] = None) -> dict:
    """A complete event: something that ran from start_us for duration_us on one lane."""
    event = {"name": name, "cat": category, "ph": "X", "pid": pid, "tid": tid, "ts": start_us,
             "dur": duration_us}
    if args:
        event["args"] = args
    return event


def instant(name: str, category: str, pid: int, tid: int, time_us: float,
            args: Optional[Dict[str, Any]] = None) -> dict:
    event = {"name": name, "cat": category, "ph": "i", "s": "t", "pid": pid, "tid": tid,
             "ts": time_us}
    if args:
        event["args"] = args
    return event


def counter(name: str, pid: int, time_us: float, values: Dict[str, float]) -> dict:
    return {"name": name, "ph": "C", "pid": pid, "ts": time_us, "args": values}


def trace_document(events: Iterable[dict], metadata: Optional[Dict[str, Any]] = None) -> dict:
    document: Dict[str, Any] = {"traceEvents": list(events), "displayTimeUnit": "ms"}
    if metadata:
        document["otherData"] = metadata
    return document


def write_trace(path: str, events: List[dict], metadata: Optional[Dict[str, Any]] = None) -> None:
    """Write the trace whole or not at all: into a temporary file beside `path`, then renamed, so a
    run killed mid-write leaves no truncated file. A write that fails (OSError: the disk full, no
    permission, the directory gone) removes the temporary file and raises the error."""
    temporary = f"{path}.tmp{os.getpid()}"
    try:
        with open(temporary, "w") as f:
            json.dump(trace_document(events, metadata), f)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.remove(temporary)
        except OSError:  # never made (open failed), or already renamed
            pass
        raise
