"""Reading one traced run: find its directory, read every benchmark-rank<R>.json, check that they
are one complete run, with their timestamps on rank 0's clock.

Every problem is a TraceInputError with a one-line message naming the directory or file.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

from megatron_dpp.trace.clock import ClockAlignment

RANK_FILE = re.compile(r"benchmark-rank(\d+)\.json")


class TraceInputError(ValueError):
    """The input is not one complete traced run; the message is one line."""


@dataclass
class RankTrace:
    rank: int
    path: Path
    metadata: dict  # the file's otherData
    events: List[dict]  # traceEvents, timestamps already on rank 0's clock


@dataclass
class RunTraces:
    name: str
    directory: Path
    ranks: List[RankTrace]  # index = global rank


def rank_files(directory: Path) -> List[Tuple[int, Path]]:
    found = []
    for path in directory.iterdir():
        match = RANK_FILE.fullmatch(path.name)
        if match and path.is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def find_run_directory(path: Path) -> Tuple[Path, Optional[str]]:
    """The run directory `path` names: itself when it holds rank files, or its only subdirectory
    that does (with a note saying which run was taken)."""
    if not path.is_dir():
        raise TraceInputError(f"{path}: no such directory")
    if rank_files(path):
        return path, None
    runs = sorted(child for child in path.iterdir() if child.is_dir() and rank_files(child))
    if not runs:
        raise TraceInputError(f"{path}: no benchmark-rank*.json files here or in its subdirectories "
                              "(is it a --trace-dir?)")
    if len(runs) > 1:
        names = ", ".join(run.name for run in runs)
        raise TraceInputError(f"{path} holds {len(runs)} runs ({names}); pass one of them")
    return runs[0], f"{path} holds one run: taking {runs[0].name}"


def read_rank_file(path: Path) -> dict:
    try:
        document = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise TraceInputError(f"{path}: cannot read it ({error})") from None
    except json.JSONDecodeError as error:
        raise TraceInputError(f"{path}: truncated or invalid JSON ({error.msg} at line {error.lineno}, "
                              f"column {error.colno})") from None
    if (not isinstance(document, dict) or not isinstance(document.get("traceEvents"), list)
            or not isinstance(document.get("otherData"), dict)):
        raise TraceInputError(f"{path}: not a rank trace (expected a JSON object with traceEvents and "
                              "otherData)")
    return document


# otherData as megatron_dpp/training/observe/tracing.py writes it: key -> (type, what it is). Required ones
# first; `schedule` (older traces lack it), `node` (where torchrun says it) and `clock_alignment`
# may be absent.
REQUIRED_METADATA = {
    "run": (str, "the run's name"),
    "rank": (int, "the global rank"),
    "world_size": (int, "the number of ranks"),
    "pipeline_rank": (int, "the pipeline stage"),
    "tensor_rank": (int, "the tensor-parallel rank"),
    "data_rank": (int, "the data-parallel rank"),
    "policy": (str, "the schedule's policy"),
}
OPTIONAL_METADATA = {
    "schedule": (str, "dpp, 1f1b or interleaved"),
    "node": (int, "the node rank"),
    "clock_alignment": (dict, "the clock correction"),
}
_TYPE_NAMES = {str: "a string", int: "an integer", dict: "an object"}


def check_metadata(path: Path, metadata: dict) -> None:
    """Every required otherData key present, each known key of its type (integers not negative,
    world_size positive): one line naming the first that is not."""
    absent = [key for key in REQUIRED_METADATA if key not in metadata]
    if absent:
        raise TraceInputError(f"{path}: otherData lacks {', '.join(absent)} (a rank trace has "
                              f"{', '.join(REQUIRED_METADATA)})")
    for key, (kind, meaning) in {**REQUIRED_METADATA, **OPTIONAL_METADATA}.items():
        if key not in metadata:
            continue
        value = metadata[key]
        if not isinstance(value, kind) or isinstance(value, bool) or (
                kind is int and value < (1 if key == "world_size" else 0)):
            wanted = _TYPE_NAMES[kind] + (" above 0" if key == "world_size" else
                                          " >= 0" if kind is int else "")
            raise TraceInputError(f"{path}: otherData.{key} is {value!r}; expected {wanted} "
                                  f"({meaning})")


def align_clock(events: List[dict], alignment: Optional[dict]) -> List[dict]:
    """The events on the reference rank's clock. Files written with `clock_alignment` (the
    recorder's ClockAlignment.metadata()) say `timestamps_corrected: true`: their events are on it
    already. Files that carry the measurement without having applied it are corrected here, by the
    recorder's own ClockAlignment. Files without it (one node, before clock alignment) are on one
    node's CLOCK_MONOTONIC and stay as they are."""
    if not alignment or alignment.get("timestamps_corrected"):
        return events
    try:
        clock = ClockAlignment(reference_rank=int(alignment.get("reference_rank", 0)),
                               at_us=float(alignment.get("measured_at_us", 0.0)),
                               offset_us=float(alignment["offset_us"]), drift=float(alignment["drift"]),
                               error_us=float(alignment.get("error_us", 0.0)))
    except (KeyError, TypeError, ValueError):
        raise TraceInputError(f"clock_alignment {alignment!r}: expected numbers offset_us and drift") from None
    return clock.correct_events(events)


def load_run(directory: Path) -> RunTraces:
    """Every rank file of one run directory, checked to be one complete run."""
    files = rank_files(directory)
    if not files:
        raise TraceInputError(f"{directory}: no benchmark-rank*.json files")
    numbers = [rank for rank, _ in files]
    missing = sorted(set(range(max(numbers) + 1)) - set(numbers))
    if missing:
        raise TraceInputError(f"{directory}: rank file(s) missing for rank(s) "
                              f"{', '.join(map(str, missing))}")
    ranks = []
    for rank, path in files:
        document = read_rank_file(path)
        metadata = document["otherData"]
        check_metadata(path, metadata)
        if metadata["rank"] != rank:
            raise TraceInputError(f"{path}: its otherData says rank {metadata['rank']}")
        try:
            events = align_clock(document["traceEvents"], metadata.get("clock_alignment"))
        except TraceInputError as error:
            raise TraceInputError(f"{path}: {error}") from None
        ranks.append(RankTrace(rank, path, metadata, events))
    names = {trace.metadata.get("run") for trace in ranks}
    if len(names) > 1:
        by_name = {}
        for trace in ranks:
            by_name.setdefault(trace.metadata.get("run"), trace.path.name)
        detail = ", ".join(f"{file} is {name!r}" for name, file in by_name.items())
        raise TraceInputError(f"{directory}: files from different runs ({detail})")
    world_sizes = {trace.metadata["world_size"] for trace in ranks}
    if world_sizes != {len(ranks)}:
        raise TraceInputError(f"{directory}: {len(ranks)} rank files, but the run had "
                              f"{max(world_sizes)} ranks (otherData.world_size)")
    name = names.pop() or directory.name
    return RunTraces(name, directory, ranks)


def clock_note(run: RunTraces) -> str:
    """What the timestamps can be trusted to: one line."""
    alignments = [trace.metadata.get("clock_alignment") for trace in run.ranks]
    if not all(alignments):
        return "clocks: as recorded (no clock_alignment: right for the ranks of one node only)"
    error = max(float(alignment.get("error_us", 0.0)) for alignment in alignments)
    return f"clocks: on rank 0's clock, within +-{error:.0f} us (the largest clock_alignment.error_us)"
