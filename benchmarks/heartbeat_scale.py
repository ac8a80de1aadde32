"""Heartbeats beside a busy training thread, as the job grows: do they get through, and what do
they cost?

Heartbeats go between every pair of ranks (megatron_dpp/comm/heartbeat.py): each rank sends and
reads world_size - 1 datagrams per interval. For each --ranks N this runs the heartbeat of one
rank with N - 1 peers, while this process's main thread runs Python without pause, as a training
loop bound by its host does, and two other processes play the peers: one beats to it every
interval (each peer at its own random phase, or with --arrivals aligned all at one moment), one
receives its beats. Two designs:
- thread: the beats sent and read by a thread of the training process (the design before the
  helper): every system call hands Python's GIL to the busy thread and waits up to 5 ms for it;
- helper: HeartbeatProcess, the beats in a helper process, this process only ticking once per
  interval (the design in use).
With the shortest timeout allowed (4 intervals), reported per N and design:
- false losses: healthy peers it named lost (in training each one ends the job);
- delivered: the share of its beats that reached the peers within the run;
- CPU per second of wall time of its thread in this process (at most what it takes from
  training), and of the helper process.
Also the time one rank takes to read the N - 1 addresses from a TCPStore at start, in one request
(as start_heartbeat does) and key by key (as it did before). --job-key seals every datagram with a
job key (DPP_JOB_KEY), as a job started by the one-node launcher or under SLURM does.

    python benchmarks/heartbeat_scale.py --json runs/heartbeat_scale.json
    python benchmarks/heartbeat_scale.py --quick
    python benchmarks/heartbeat_scale.py --designs helper --job-key
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import socket
import statistics
import sys
import time
from datetime import timedelta
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_dpp.comm.heartbeat import (_BEAT, LOOPBACK, MIN_BEATS_PER_TIMEOUT,  # noqa: E402
                                         Heartbeat, HeartbeatProcess, PeerAddress, _read_peers,
                                         bind_udp, encode_packet)
from megatron_dpp.comm.job_key import DatagramSeal  # noqa: E402

DESIGNS = ("thread", "helper")
ARRIVALS = ("spread", "aligned")
RUN_ID_BASE = 1000  # the played ranks' run ids: RUN_ID_BASE + rank


def _rank_counts(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None
    if not values or any(value < 2 for value in values):
        raise argparse.ArgumentTypeError(f"every rank count must be at least 2, got {text!r}")
    return values


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=_rank_counts, default=[64, 256, 1024, 4096],
                        help="Job sizes to play, comma-separated (default 64,256,1024,4096).")
    parser.add_argument("--interval", type=_positive_float, default=1.0,
                        help="Heartbeat interval in seconds (default 1, --heartbeat-interval's).")
    parser.add_argument("--intervals", type=int, default=12,
                        help="Intervals per run (default 12: three timeouts of 4 intervals).")
    parser.add_argument("--arrivals", choices=ARRIVALS, default="spread",
                        help="How the played peers' beats arrive: each peer at its own random "
                             "phase (spread, as ranks beat now) or all at once (aligned).")
    parser.add_argument("--designs", type=lambda text: text.split(","), default=list(DESIGNS),
                        help="Designs to run, comma-separated: thread, helper (default both).")
    parser.add_argument("--job-key", action="store_true",
                        help="Seal every datagram with a job key (HMAC-SHA256), as training does "
                             "where DPP_JOB_KEY is set.")
    parser.add_argument("--quick", action="store_true",
                        help="Smoke run (about 10 s): 8 and 400 ranks, 0.25 s intervals, 8 of "
                             "them.")
    parser.add_argument("--json", type=str, default=None,
                        help="Write the settings and results here.")
    args = parser.parse_args(argv)
    if args.quick:
        args.ranks, args.interval, args.intervals = [8, 400], 0.25, 2 * MIN_BEATS_PER_TIMEOUT
    if args.intervals < 2 * MIN_BEATS_PER_TIMEOUT:
        parser.error(f"--intervals must be at least {2 * MIN_BEATS_PER_TIMEOUT} (two timeouts)")
    unknown = sorted(set(args.designs) - set(DESIGNS))
    if unknown:
        parser.error(f"--designs: unknown {', '.join(unknown)} (choose from {', '.join(DESIGNS)})")
    return args


# ----------------------------------------------------------------------------------------------
# the peers, in processes of their own
# ----------------------------------------------------------------------------------------------
def play_peers(sock: socket.socket, target: tuple, peers: int, arrivals: str, interval_s: float,
               intervals: int, seed: int, started, key: bytes | None = None) -> None:
    """Beat to `target` as ranks 1..peers, `intervals` times, each at its own random phase
    ("spread") or all at once ("aligned"), from `sock`: the socket the peers published (the rank
    counts a beat only from the peer's own address), sealed for rank 0 with `key` where one is
    given. Sets `started` (an Event) just before the first."""
    seal = DatagramSeal(key) if key else None
    rng = random.Random(seed)
    schedule = sorted((0.0 if arrivals == "aligned" else rng.uniform(0, interval_s), rank)
                      for rank in range(1, peers + 1))
    started.set()
    start = time.monotonic()
    for sequence in range(1, intervals + 1):
        base = start + (sequence - 1) * interval_s
        for phase, rank in schedule:
            delay = base + phase - time.monotonic()
            if delay > 0.0005:
                time.sleep(delay)
            packet = encode_packet(_BEAT, rank, RUN_ID_BASE + rank, sequence, 0)
            sock.sendto(packet if seal is None else seal.seal(packet, 0), target)
    sock.close()


def count_datagrams(sock: socket.socket, stop, result) -> None:
    """Read `sock` until `stop` is set, then send the number of datagrams read to `result`."""
    sock.settimeout(0.05)
    count = 0
    while not stop.is_set():
        try:
            sock.recv(64)
            count += 1
        except socket.timeout:
            pass
    result.send(count)


# ----------------------------------------------------------------------------------------------
# one rank's heartbeat
# ----------------------------------------------------------------------------------------------
def _cpu_s(path: str) -> float:
    """CPU seconds from a Linux schedstat file (nanoseconds on CPU first)."""
    with open(path) as schedstat:
        return int(schedstat.read().split()[0]) / 1e9


class ThreadCpu:
    """CPU seconds of one thread of this process, read while it lives. A heartbeat thread that
    declares a peer lost ends, and its schedstat file with it: the last reading then stands (taken
    at most 0.1 s before, _busy_until_done reads it that often); a thread gone before the first
    reading counts 0."""

    def __init__(self, thread_id: int):
        self.path = f"/proc/self/task/{thread_id}/schedstat"
        self.last = 0.0

    def read(self) -> float:
        try:
            self.last = _cpu_s(self.path)
        except FileNotFoundError:
            return self.last  # the thread has ended: its last reading stands
        return self.last


def _process_cpu_s(pid: int) -> float:
    """CPU seconds of every thread of process `pid` (its own schedstat counts its first only)."""
    tasks = f"/proc/{pid}/task"
    return sum(_cpu_s(f"{tasks}/{task}/schedstat") for task in os.listdir(tasks))


def _busy_until_done(process, timeout_s: float, every_tenth_s: Callable[[], object]) -> None:
    """Run Python on this thread until `process` ends (at most timeout_s), as a training thread
    bound by its host does; call `every_tenth_s` between the busy stretches."""
    deadline = time.monotonic() + timeout_s
    while process.is_alive() and time.monotonic() < deadline:
        every_tenth_s()
        # Asking about the process releases the GIL for a moment; done every millisecond, that
        # alone would starve a thread waiting for the GIL (CPython hands it over after 5 ms
        # without such a release), so ask every 0.1 s.
        until = time.monotonic() + 0.1
        while time.monotonic() < until:
            total = 0
            for value in range(20000):
                total += value * value


def measure(ranks: int, design: str, args: argparse.Namespace) -> dict:
    peers, interval_s, intervals = ranks - 1, args.interval, args.intervals
    context = multiprocessing.get_context("spawn")
    sink = bind_udp(LOOPBACK)  # the peers' side: where this rank's beats go
    sink.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock = bind_udp(LOOPBACK)
    me = PeerAddress(0, LOOPBACK, sock.getsockname()[1], "node 0", os.getpid(), RUN_ID_BASE)
    addresses = [PeerAddress(rank, LOOPBACK, sink.getsockname()[1], "node 1", os.getpid(),
                             RUN_ID_BASE + rank) for rank in range(1, ranks)]
    timeout_s = MIN_BEATS_PER_TIMEOUT * interval_s
    key = os.urandom(32) if args.job_key else None
    lost, failed = [], []
    stop_sink = context.Event()
    sink_result, sink_end = context.Pipe(duplex=False)
    counter = context.Process(target=count_datagrams, args=(sink, stop_sink, sink_end))
    counter.start()
    if design == "thread":
        beat = Heartbeat(sock, me, addresses, interval_s, timeout_s, lost.append, key=key)
        thread_id, helper_pid = beat.native_thread_id, None
    else:
        beat = HeartbeatProcess(sock, me, addresses, interval_s, timeout_s, lost.append,
                                failed.append, key=key)
        thread_id, helper_pid = beat.native_thread_id, beat.helper_pid
    thread_cpu_s = ThreadCpu(thread_id)
    started = context.Event()
    player = context.Process(target=play_peers, args=(sink, (LOOPBACK, me.port), peers,
                                                      args.arrivals, interval_s, intervals, ranks,
                                                      started, key))
    try:
        player.start()
        sink.close()  # the counter and the player hold their own
        if not started.wait(timeout=120):
            raise RuntimeError(f"the played peers ({ranks} ranks) did not start within 120 s")
        wall_start = time.monotonic()
        thread_start = thread_cpu_s.read()
        helper_start = _process_cpu_s(helper_pid) if helper_pid else 0.0
        _busy_until_done(player, intervals * interval_s + 120, thread_cpu_s.read)
        if player.is_alive():
            raise RuntimeError(f"the played peers ({ranks} ranks) did not finish")
        wall = time.monotonic() - wall_start
        thread_cpu = thread_cpu_s.read() - thread_start
        helper_cpu = _process_cpu_s(helper_pid) - helper_start if helper_pid else None
    finally:
        if player.is_alive():
            player.kill()
        beat.close(say_bye=False)
        stop_sink.set()
    delivered = sink_result.recv() if sink_result.poll(30) else 0
    counter.join(timeout=30)
    beats_sent_for = wall / interval_s  # intervals this rank was beating, about
    return {"ranks": ranks, "design": design, "arrivals": args.arrivals, "job_key": args.job_key,
            "false_losses": len(lost), "helper_failed": failed,
            "delivered_share": min(1.0, delivered / (peers * beats_sent_for)),
            "thread_cpu_ms_per_s": 1e3 * thread_cpu / wall,
            "helper_cpu_ms_per_s": None if helper_cpu is None else 1e3 * helper_cpu / wall}


def measure_address_reading(ranks: int, repeats: int = 3) -> dict:
    """Milliseconds one rank takes to read the other ranks' addresses from a TCPStore on this
    machine: start_heartbeat's one request, and one request per key."""
    import torch.distributed as dist

    server = dist.TCPStore(LOOPBACK, 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore(LOOPBACK, server.port, is_master=False)
    prefix = "bench/heartbeat"
    for rank in range(ranks):
        address = PeerAddress(rank, "10.0.0.1", 40000 + rank, f"node {rank // 8}", 100000 + rank,
                              random.getrandbits(63))
        server.set(f"{prefix}/{rank}", address.encode())
    keys = [f"{prefix}/{rank}" for rank in range(1, ranks)]
    together, one_by_one = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        _read_peers(client, prefix, 0, ranks, timeout_s=60)
        together.append(time.perf_counter() - start)
        start = time.perf_counter()
        client.wait(keys, timedelta(seconds=60))
        for key in keys:
            PeerAddress.decode(client.get(key))
        one_by_one.append(time.perf_counter() - start)
    return {"ranks": ranks, "one_request_ms": 1e3 * statistics.median(together),
            "request_per_key_ms": 1e3 * statistics.median(one_by_one)}


def describe(row: dict) -> str:
    helper = ("" if row["helper_cpu_ms_per_s"] is None
              else f", helper process {row['helper_cpu_ms_per_s']:5.1f}")
    return (f"{row['ranks']:6d} ranks, {row['design']:6s}: false losses {row['false_losses']:4d}, "
            f"delivered {100 * row['delivered_share']:5.1f}%; CPU ms per s: training-process "
            f"thread {row['thread_cpu_ms_per_s']:5.1f}{helper}")


def main(argv=None) -> int:
    args = parse_args(argv)
    results, reading = [], []
    for ranks in args.ranks:
        for design in args.designs:
            row = measure(ranks, design, args)
            results.append(row)
            print(describe(row), flush=True)
        row = measure_address_reading(ranks)
        reading.append(row)
        print(f"{ranks:6d} ranks, addresses at start: {row['one_request_ms']:.1f} ms in one "
              f"request, {row['request_per_key_ms']:.1f} ms key by key", flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as out:
            json.dump({"settings": {"ranks": args.ranks, "interval_s": args.interval,
                                    "intervals": args.intervals, "arrivals": args.arrivals,
                                    "designs": args.designs, "quick": args.quick,
                                    "job_key": args.job_key},
                       "heartbeat": results, "address_reading": reading}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
