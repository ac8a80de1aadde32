"""A peer that went away: one report naming it and exit code LOST_PEER, however it is noticed.

- A collective fails because the peer's process died: gloo says "Read error [10.0.0.2]:42206:
  Connection reset by peer"; NCCL "remote process exited or there was a network error". The
  peer's address maps to its node through --node-ips (`lost_peer_report`).
- The peer stops answering while alive (stopped, frozen, its link down): its heartbeats stop
  (comm/heartbeat.py, started by `start_peer_heartbeat` right after the process group exists).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from typing import Iterator, Optional, Sequence

import torch.distributed as dist

from megatron_dpp.comm.heartbeat import (HEARTBEAT_OFF, HeartbeatError, HeartbeatProcess,
                                         JobKeyMismatch, LostPeer, heartbeat_host, node_label,
                                         protection_line, start_heartbeat)
from megatron_dpp.comm.job_key import job_key
from megatron_dpp.exit_codes import BAD_INPUT, FAILED, LOST_PEER
from megatron_dpp.one_write import say
from megatron_dpp.runtime.watchdog import report_and_exit

# Messages of torch.distributed backends whose peer process or link went away.
_LOST_PEER_PATTERNS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "remote process exited",
    "Socket Timeout",
)
_ADDRESS_IN_BRACKETS = re.compile(r"\[([0-9a-fA-F.:]+)\]:\d+")


def is_lost_peer_error(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, RuntimeError) and any(pattern in text for pattern in _LOST_PEER_PATTERNS)


def lost_peer_report(error: BaseException, phase: Optional[str],
                     node_ips: Optional[Sequence[str]]) -> tuple[str, list[str]]:
    """(reason, state lines) for report_and_exit: which peer (address, and node with --node-ips),
    during what, and the backend's own first line."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    found = _ADDRESS_IN_BRACKETS.search(text)
    peer = "a peer"
    if found:
        address = found.group(1)
        peer = f"the peer at {address}"
        if node_ips and address in node_ips:
            peer += f" (node {list(node_ips).index(address)} of --node-ips)"
    reason = f"lost {peer}" + (f" during {phase}" if phase else "")
    return reason, [f"backend: {text}", "that node's log says why its rank stopped"]


def _one_line(reason: str, details: Sequence[str]) -> str:
    """A lost peer's report as one line (the launcher's last line is the same): the reason, then
    what it tells, each after a semicolon."""
    return "; ".join([reason, *details])


def exit_for_lost_peer(error: BaseException, phase: Optional[str],
                       node_ips: Optional[Sequence[str]]) -> None:
    """Report a collective's lost peer (lost_peer_report) in one line and exit with LOST_PEER."""
    reason, lines = lost_peer_report(error, phase, node_ips)
    report_and_exit(_one_line(reason, lines), [], LOST_PEER)


def exit_for_silent_peer(lost: LostPeer) -> None:
    """A peer's heartbeats stopped (called from the heartbeat thread): report it in one line, exit
    LOST_PEER."""
    report_and_exit(_one_line(lost.reason(), lost.state_lines()), [], LOST_PEER)


def exit_for_failed_heartbeat(reason: str) -> None:
    """The heartbeat helper ended on its own (called from the heartbeat thread): without it the
    peers would name this rank lost, so end here, saying why."""
    report_and_exit(reason, [], FAILED)


def start_peer_heartbeat(args: argparse.Namespace) -> Optional[HeartbeatProcess]:
    """Heartbeats with every other rank, on this node's --node-ips address (127.0.0.1 on one
    node); None with --heartbeat-timeout 0 or a single rank. Collective over the default store:
    call right after init_process_group, on every rank. Datagrams are sealed with the job's key
    (DPP_JOB_KEY) where the environment holds one; rank 0 says in one line which protection is
    on. Exits in one line when they cannot start: BAD_INPUT when the ranks' keys differ, else
    FAILED."""
    if args.heartbeat_timeout == HEARTBEAT_OFF or dist.get_world_size() == 1:
        return None
    key = job_key(os.environ)  # its form was checked with the flags (comm/flags.py)
    host = heartbeat_host(args.node_ips if args.multi_node else None)
    try:
        heartbeat = start_heartbeat(
            dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size(),
            host, node_label(), args.heartbeat_interval, args.heartbeat_timeout,
            on_lost=exit_for_silent_peer,
            rendezvous_timeout_s=60.0 * args.distributed_timeout_minutes,
            on_helper_failed=exit_for_failed_heartbeat, key=key)
    except HeartbeatError as error:
        say(f"megatron_dpp: error: {error}")
        raise SystemExit(BAD_INPUT if isinstance(error, JobKeyMismatch) else FAILED) from None
    if dist.get_rank() == 0:
        say(protection_line(key, os.environ.get("MASTER_ADDR", "")), sys.stdout)
    return heartbeat


@contextlib.contextmanager
def peer_heartbeat(args: argparse.Namespace) -> Iterator[Optional[HeartbeatProcess]]:
    """start_peer_heartbeat around a block, stopped on every way out of it: with a bye when the
    block returns or raises SystemExit (every rank ends together: training finished, an agreed
    stop, a failed save), without one on any other error, so that the peers name this rank."""
    heartbeat = start_peer_heartbeat(args)
    left_on_purpose = False
    try:
        yield heartbeat
        left_on_purpose = True
    except SystemExit:
        left_on_purpose = True
        raise
    finally:
        if heartbeat is not None:
            heartbeat.close(say_bye=left_on_purpose)
