"""The launcher's watch for ranks that are stopped while the job ends.

Once a rank has failed, torchrun stops the others with SIGTERM and waits 30 s before SIGKILL. A
rank stopped by a signal (SIGSTOP, Ctrl-Z, a debugger's stop) cannot act on SIGTERM until it is
continued, so the whole job would wait those 30 s after its peers have already reported it lost.
`StoppedRankWatch`, a thread of the launcher (megatron_dpp.rank_launcher), looks every
`interval_s` while torchrun runs: once any rank has recorded its failure (megatron_dpp.rank_failure),
each of this launcher's ranks that is stopped is killed at once, with its own line recorded for it.
Standard library and Linux's /proc only, as the launcher is.
"""
from __future__ import annotations

import os
import signal
import socket
import threading
from typing import Iterator, Optional

from megatron_dpp.rank_failure import all_failures, record_failure_in

STOPPED_STATES = ("T",)  # /proc/PID/stat's state of a process stopped by a signal


def child_pids(parent: int) -> Iterator[int]:
    """The processes whose parent is `parent` (torchrun's ranks are the launcher's children)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = _stat_fields(int(name))
        if stat is not None and int(stat[1]) == parent:
            yield int(name)


def _stat_fields(pid: int) -> Optional[list[str]]:
    """/proc/PID/stat after the command name: [state, ppid, ...]; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            text = file.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()  # the name may hold spaces and parentheses


def is_stopped(pid: int) -> bool:
    stat = _stat_fields(pid)
    return stat is not None and stat[0] in STOPPED_STATES


def rank_of(pid: int) -> Optional[int]:
    """RANK in the process's environment (torchrun sets it), or None."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as file:
            variables = file.read().split(b"\0")
    except OSError:
        return None
    for variable in variables:
        if variable.startswith(b"RANK="):
            try:
                return int(variable[5:])
            except ValueError:
                return None
    return None


class StoppedRankWatch(threading.Thread):
    """Kills this launcher's stopped ranks once a rank of the job has recorded its failure in
    `folder`; stop() ends the watch and joins it."""

    def __init__(self, folder: str, parent: Optional[int] = None, interval_s: float = 0.5):
        super().__init__(name="stopped-rank-watch")
        self.folder = folder
        self.parent = os.getpid() if parent is None else parent
        self.interval_s = interval_s
        self._stop_event = threading.Event()
        self.killed: list[int] = []  # the ranks it ended

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            self.kill_stopped_ranks_if_a_rank_failed()

    def kill_stopped_ranks_if_a_rank_failed(self) -> None:
        if not all_failures(self.folder):
            return
        for pid in list(child_pids(self.parent)):
            if not is_stopped(pid):
                continue
            rank = rank_of(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:  # it ended meanwhile
                continue
            if rank is not None:
                self.killed.append(rank)
                record_failure_in(
                    self.folder, rank,
                    f"megatron_dpp.rank_launcher: rank {rank} on {socket.gethostname()} was stopped "
                    f"(SIGSTOP or a debugger) when the job ended; the launcher killed it",
                    128 + signal.SIGKILL)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()
