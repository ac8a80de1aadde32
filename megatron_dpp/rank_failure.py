"""A rank that stops with a one-line error records that line, so that the launcher can end with it.

Each node's launcher (megatron_dpp.rank_launcher, around torchrun) gives its ranks a folder in
DPP_FAILURE_DIR; a rank that ends with a one-line error writes `rank_<RANK>.json` there: the
line, its exit code and the wall time. When torchrun reports failed ranks, the launcher prints the
line of the first rank that failed, by time, as its own last line and exits with that rank's code,
instead of torchrun's traceback. Standard library only: the launcher imports no torch.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional

from megatron_dpp.one_write import say

FAILURE_DIR_ENV = "DPP_FAILURE_DIR"


@dataclass(frozen=True)
class RankFailure:
    rank: int
    exit_code: int
    line: str
    time: float


def record_failure(line: str, exit_code: int) -> None:
    """Record this rank's one-line error where the launcher looks (nothing without a launcher).
    Never raises: the rank is on its way out and must still print its line and exit."""
    folder = os.environ.get(FAILURE_DIR_ENV)
    if not folder:
        return
    record_failure_in(folder, int(os.environ.get("RANK", "0")), line, exit_code)


def record_failure_in(folder: str, rank: int, line: str, exit_code: int) -> None:
    """Record `rank`'s one-line error in `folder` (the launcher does for a rank it ends itself).
    Never raises."""
    record = {"rank": rank, "exit_code": exit_code, "line": line, "time": time.time()}
    path = os.path.join(folder, f"rank_{rank}.json")
    try:
        with open(path + ".tmp", "w") as file:
            json.dump(record, file)
        os.replace(path + ".tmp", path)  # the launcher never reads half a record
    except OSError:
        pass


def say_failure(line: str, exit_code: int, printed: bool = True) -> None:
    """Print `line` to stderr (unless another rank prints the same line: printed=False) and
    record it for the launcher; the caller then ends with `exit_code`."""
    if printed:
        say(line)
    record_failure(line, exit_code)


def fail(line: str, exit_code: int = 2) -> None:
    """say_failure, then exit with `exit_code`."""
    say_failure(line, exit_code)
    sys.exit(exit_code)


def first_failure(folder: str) -> Optional[RankFailure]:
    """The earliest recorded failure in `folder`, or None when no rank recorded one."""
    return min(all_failures(folder), key=lambda failure: (failure.time, failure.rank),
               default=None)


def all_failures(folder: str) -> list[RankFailure]:
    """Every failure recorded in `folder` that can be read."""
    failures = []
    for name in os.listdir(folder):
        if not (name.startswith("rank_") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(folder, name)) as file:
                record = json.load(file)
            failures.append(RankFailure(int(record["rank"]), int(record["exit_code"]),
                                        str(record["line"]), float(record["time"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a rank killed while writing: the others still tell the story
    return failures
