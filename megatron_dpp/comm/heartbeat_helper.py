"""The heartbeat helper: a small process beside each training rank that sends and reads its
heartbeats (heartbeat.Heartbeat), so that they never wait for the training process's GIL.

The training process starts it (heartbeat.HeartbeatProcess) with `python -m
megatron_dpp.comm.heartbeat_helper`, passing its bound UDP socket and two pipes, and its settings
as one JSON document on standard input (this rank's address, its peers', the interval and the
timeout, and the three file descriptors):
- ticks, training -> helper: a byte every interval from the training process's own thread. The
  helper beats only while ticks came within TICKS_MISSED_AS_STOPPED intervals, so a stopped or
  frozen training process is named by its peers. "B" asks for a bye and an exit, "Q" for an exit
  without one; the pipe's end (the training process died) counts as "Q".
The helper ignores SIGINT and SIGTERM: a Ctrl-C or torchrun's SIGTERM goes to the whole process
group, and the training process answers it by saving a checkpoint and leaving with a bye, which
needs its helper alive until then; if the training process dies of it instead, the pipe ends.
- reports, helper -> training: READY once it beats, then one JSON line per lost peer
  (LostPeer.encode).
Standard library only, so that it starts in milliseconds.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

from megatron_dpp.comm.heartbeat import (BYE, QUIT, READY, TICKS_MISSED_AS_STOPPED, Heartbeat,
                                         LostPeer, PeerAddress)


def main() -> int:
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.SIG_IGN)
    settings = json.loads(sys.stdin.buffer.read().decode())
    interval_s = settings["interval_s"]
    sock = socket.socket(fileno=settings["socket_fd"])
    ticks, reports = settings["ticks_fd"], settings["reports_fd"]
    last_tick = [time.monotonic()]

    def training_runs() -> bool:
        return time.monotonic() - last_tick[0] < TICKS_MISSED_AS_STOPPED * interval_s

    def report(lost: LostPeer) -> None:
        os.write(reports, lost.encode() + b"\n")

    beat = Heartbeat(sock, PeerAddress(**settings["me"]),
                     [PeerAddress(**peer) for peer in settings["peers"]], interval_s,
                     settings["timeout_s"], report, alive=training_runs,
                     key=bytes.fromhex(settings["key"]) if settings["key"] else None)
    os.write(reports, READY)
    say_bye = False
    try:
        while True:
            data = os.read(ticks, 64)  # blocks: this thread holds no GIL the beats need
            if not data or QUIT in data:
                break
            if BYE in data:
                say_bye = True
                break
            last_tick[0] = time.monotonic()
    finally:
        beat.close(say_bye=say_bye)
        os.close(reports)
    return 0


if __name__ == "__main__":
    sys.exit(main())
