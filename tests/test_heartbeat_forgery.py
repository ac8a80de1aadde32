"""Forged heartbeats against a training job, end to end: a forger on the same machine reads rank 0's
heartbeat address and run id from the job's rendezvous store (unauthenticated, as torch's TCPStore
is) and sends rank 1, in rank 0's name, each datagram of ATTACKS while the job trains. The job
trains on to the end with the losses of an undisturbed run, and no peer is named lost.

Each attack alone ended a healthy job before (issue 61): a bye made rank 1 stop watching and
beating to rank 0, which then declared the live rank 1 lost; a beat numbered 2**64 - 1 made every
real beat after it look old. The raw-socket attacks (the source address and port forged to rank
0's own, root only) are what only the job's key stops; the others the sender's address and the
sequence window stop too.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
import subprocess
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from _ports import free_local_port
from _train_util import (ITERATION_RE, PYTHON, REPO_ROOT, TINY_GPT_ARGS, _env, assert_losses_close,
                         data_args, parse_log, run_training)
from megatron_dpp.comm.heartbeat import _BEAT, _BYE, LOOPBACK, encode_packet

ITERATIONS = 60
# Short heartbeats: a believed forgery ends the job within about a second, long before it ends.
EXTRA = ["--train-iters", str(ITERATIONS), "--eval-iters", "0", "--heartbeat-interval", "0.2",
         "--heartbeat-timeout", "1"]
# (name, needs a raw socket): what the forger sends rank 1 in rank 0's name.
ATTACKS = [
    ("bye from another socket, numbers in the window", False),
    ("beat numbered 2**64 - 1 from another socket", False),
    ("bye from rank 0's own address and port (raw socket), numbers in the window", True),
    ("replay of a datagram rank 0 sent (raw socket)", True),
]


def _rank0_address(port: int) -> dict:
    """Rank 0's published heartbeat address, read from the job's store as any process can."""
    client = dist.TCPStore(LOOPBACK, port, None, False, timedelta(seconds=30))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        keys = [key for key in client.list_keys() if key.endswith("megatron_dpp/heartbeat/0")]
        if keys:
            return json.loads(client.get(keys[0]).decode())
        time.sleep(0.2)
    raise AssertionError("rank 0 never published its heartbeat address")


def _rank1_port(rank1_pid: int) -> int:
    """Rank 1's heartbeat port: the UDP socket on 127.0.0.1 its helper process holds."""
    inodes = set()
    for pid in [rank1_pid, *_children(rank1_pid)]:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    with open("/proc/net/udp") as rows:
        next(rows)
        for row in rows:
            fields = row.split()
            if fields[9] in inodes and fields[1].startswith("0100007F:"):
                return int(fields[1].split(":")[1], 16)
    raise AssertionError(f"rank 1 (pid {rank1_pid}) holds no UDP socket on 127.0.0.1")


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    if int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except OSError:
                continue
    return found


def _rank_pid(launcher_pid: int, rank: int) -> int:
    for pid in _children(launcher_pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as environ:
                if f"RANK={rank}".encode() in environ.read().split(b"\0"):
                    return pid
        except OSError:
            continue
    raise AssertionError(f"no rank {rank} among the launcher's children")


def _spoofed(source: tuple[str, int], target: tuple[str, int], payload: bytes) -> bytes:
    """An IPv4 packet with a UDP datagram whose source is `source` (checksum 0: none)."""
    udp = struct.pack("!HHHH", source[1], target[1], 8 + len(payload), 0) + payload
    return struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, socket.IPPROTO_UDP, 0,
                       socket.inet_aton(source[0]), socket.inet_aton(target[0])) + udp


def _captured_datagram(source_port: int, target_port: int, timeout_s: float = 5.0) -> bytes:
    """One UDP payload rank 0 sent rank 1, read off the loopback interface (root)."""
    sniffer = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))
    with sniffer:
        sniffer.bind(("lo", 0))
        sniffer.settimeout(timeout_s)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            frame = sniffer.recv(65536)
            packet = frame[14:]  # the Ethernet header loopback frames carry
            if len(packet) < 28 or packet[9] != socket.IPPROTO_UDP:
                continue
            header = (packet[0] & 0x0F) * 4
            ports = struct.unpack("!HH", packet[header:header + 4])
            if ports == (source_port, target_port):
                return packet[header + 8:]
    raise AssertionError("no datagram from rank 0 to rank 1 seen on lo")


def _attack(name: str, rank0: dict, rank1_port: int) -> int:
    """Send rank 1 the attack `name`; the number of datagrams sent."""
    target = (LOOPBACK, rank1_port)
    own = (LOOPBACK, rank0["port"])
    # The numbers rank 0 reaches over the next seconds (one per 0.2 s since it started), and a
    # margin: some forged datagram is in sequence, whatever rank 0's count is now.
    numbers = range(1, 2000)
    sent = 0
    if name.startswith("bye from another socket"):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as forger:
            for sequence in numbers:
                forger.sendto(encode_packet(_BYE, 0, rank0["run_id"], sequence, 0), target)
                sent += 1
    elif name.startswith("beat numbered"):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as forger:
            forger.sendto(encode_packet(_BEAT, 0, rank0["run_id"], 2**64 - 1, 0), target)
            sent += 1
    elif name.startswith("bye from rank 0's own address"):
        with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW) as raw:
            for sequence in numbers:
                raw.sendto(_spoofed(own, target, encode_packet(_BYE, 0, rank0["run_id"],
                                                               sequence, 0)), (LOOPBACK, 0))
                sent += 1
    elif name.startswith("replay"):
        datagram = _captured_datagram(rank0["port"], rank1_port)
        time.sleep(0.5)
        with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW) as raw:
            for _ in range(5):
                raw.sendto(_spoofed(own, target, datagram), (LOOPBACK, 0))
                sent += 1
    return sent


@pytest.mark.timeout(300)
def test_forged_heartbeats_change_nothing_the_job_trains_on_with_equal_losses(tmp_path):
    raw_allowed = os.geteuid() == 0
    attacks = [(name, raw) for name, raw in ATTACKS if raw_allowed or not raw]
    code, want, _norms, reference = run_training(EXTRA)
    assert code == 0 and len(want) == ITERATIONS, reference[-3000:]

    port = free_local_port()
    log = tmp_path / "job.log"
    env = {name: value for name, value in _env().items() if name != "DPP_JOB_KEY"}
    with open(log, "w") as out:
        job = subprocess.Popen(
            [PYTHON, "-m", "megatron_dpp.rank_launcher", "--nnodes", "1", "--master-addr",
             LOOPBACK, "--master-port", str(port), "--nproc-per-node", "2", "-m",
             "megatron_dpp.pretrain_gpt", *data_args(), *TINY_GPT_ARGS, *EXTRA],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT, start_new_session=True)
    sent = {}
    try:
        rank0 = _rank0_address(port)
        deadline = time.monotonic() + 120
        while not any(int(found) >= 2 for found in ITERATION_RE.findall(log.read_text())):
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        rank1_port = _rank1_port(_rank_pid(job.pid, 1))
        for name, _raw in attacks:
            sent[name] = _attack(name, rank0, rank1_port)
        code = job.wait(timeout=200)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    output = log.read_text()
    assert code == 0, f"the job ended with {code} after {sent}:\n{output[-3000:]}"
    assert "lost rank" not in output
    assert re.search(r"job protection: one node: the rendezvous store and every socket on "
                     r"127\.0\.0\.1; heartbeats authenticated", output), output[:3000]
    got, _ = parse_log(output)
    assert_losses_close(got, want, rel=1e-6)
    assert all(count > 0 for count in sent.values()), sent
