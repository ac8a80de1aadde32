"""transport_bench.py --cross-namespace: the two ranks on two "nodes", network namespaces joined by
a veth pair (netns_nodes.py), so every byte crosses the kernel's network stack.

Transports: `rdma` (rdma_tensor, skipped with the reason while it does not import), `gloo`
(torch.distributed send/recv, GLOO_SOCKET_IFNAME = the veth) and `tcp` (one plain TCP socket with
TCP_NODELAY: the limit of the link). Both sides run with UCX_TLS=tcp and UCX_NET_DEVICES = the veth:
the namespaces share one kernel and one /dev/shm, which UCX's shared-memory transports could use.
Every round measures every size with every transport, the transports' order rotating by round, so
the load of this shared machine falls on all of them alike:
  latency   ping-pong, rank 0 first; one-way = half the round trip; the round's p50;
  bandwidth rank 1 posts its receives, says go and times until the last of 4 to 64 messages
            (--stream-bytes) has arrived; bytes / time.
Reported: the median over rounds with the min-max, and p99 of every round trip. The worker side of
this module runs as `python cross_namespace_bench.py --worker CONFIG RANK` inside a namespace.
"""
from __future__ import annotations

import importlib
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from netns_nodes import netns_skip_reason, two_node_network

REPO_ROOT = Path(__file__).resolve().parents[1]
KiB, MiB = 1 << 10, 1 << 20
TRANSPORTS = ("rdma", "gloo", "tcp")
# The namespaces are fresh, so fixed ports are free in them.
GLOO_PORT, RDMA_STORE_PORT, TCP_PORT = 29500, 29501, 29502
TARGET_LATENCY_RATIO = 0.5  # rdma one-way p50 at 4 KiB <= 0.5x gloo's
TARGET_BANDWIDTH_RATIO = 0.9  # rdma >= 0.9x the plain TCP stream at every size >= 1 MiB


def rdma_skip_reason() -> Optional[str]:
    """Why the rdma rows cannot run, or None."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.append(str(REPO_ROOT))  # rdma_tensor may be newer than the editable install
    import torch  # noqa: F401  (_C links against torch's libraries, which importing torch loads)

    try:
        importlib.import_module("rdma_tensor._C")
        rdma_tensor = importlib.import_module("rdma_tensor")
    except Exception as error:  # ImportError, or OSError from a shared library that does not load
        return f"rdma_tensor does not import ({type(error).__name__}: {error})"
    missing = [name for name in ("create_context_with_store", "RdmaConfig")
               if not hasattr(rdma_tensor, name)]
    return f"rdma_tensor has no {', '.join(missing)}" if missing else None


def round_plan(args, size: int) -> tuple[int, int]:
    """(ping-pong round trips per round, messages per stream) for one size."""
    per_round = math.ceil(args.latency_iters / args.repeats)
    round_trips = max(3, min(per_round, (64 * MiB) // size))  # big messages: a few are enough
    messages = max(4, min(64, args.stream_bytes // size))
    return round_trips, messages


# ---------------------------------------------------------------------------------------------
# worker side (inside a namespace)


class TcpOps:
    """The benchmark's send/recv/wait over one blocking TCP socket: a send is written at once, a
    receive is read when waited on (so receives posted ahead, as the stream does, cost nothing)."""

    def __init__(self, connection: socket.socket) -> None:
        self.connection = connection
        self.tag = 0

    def next_tag(self) -> int:
        self.tag += 1
        return self.tag

    def send(self, tensor, tag):
        self.connection.sendall(memoryview(tensor.numpy()))
        return None

    def recv(self, buffer, tag):
        return buffer

    def wait(self, handle):
        if handle is None:  # a send, already written
            return None
        view = memoryview(handle.numpy()).cast("B")
        received = 0
        while received < len(view):
            count = self.connection.recv_into(view[received:])
            if count == 0:
                raise ConnectionError("the peer closed the benchmark's TCP connection")
            received += count
        return handle


def _connect_tcp(listener: Optional[socket.socket], server_ip: str, timeout_s: float) -> TcpOps:
    if listener is not None:
        connection, _ = listener.accept()
        listener.close()
    else:
        connection = socket.create_connection((server_ip, TCP_PORT), timeout=timeout_s)
    connection.settimeout(timeout_s)
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return TcpOps(connection)


def _open_rdma(ips: list[str], rank: int, timeout_s: float):
    """(context, store): the caller keeps the store, whose server rank 0 hosts, until the peer is
    done with it too."""
    from datetime import timedelta

    import rdma_tensor
    import torch.distributed as dist

    store = dist.TCPStore(ips[0], RDMA_STORE_PORT, 2, rank == 0,
                          timeout=timedelta(seconds=timeout_s))
    context = rdma_tensor.create_context_with_store(
        store, rank=rank, world_size=2, peers=[1 - rank],
        config=rdma_tensor.RdmaConfig(timeout_s=timeout_s), prefix="bench",
        node_address=ips[rank])
    return context, store


def stream_at_receiver(ops, rank: int, payload, buffers, go) -> Optional[float]:
    """Rank 0 streams len(buffers) messages once rank 1 says go; rank 1 returns the seconds from its
    go to the last message's arrival (rank 0 returns None). Each message is dropped on arrival."""
    tags = [ops.next_tag() for _ in buffers]
    go_tag = ops.next_tag()
    if rank == 0:
        ops.wait(ops.recv(go, go_tag))
        for handle in [ops.send(payload, tag) for tag in tags]:
            ops.wait(handle)
        return None
    handles = [ops.recv(buffer, tag) for buffer, tag in zip(buffers, tags)]
    start = time.perf_counter()
    ops.wait(ops.send(go, go_tag))
    for i in range(len(handles)):
        ops.wait(handles[i])
        handles[i] = None
    return time.perf_counter() - start


def _measure(config: dict, rank: int, all_ops: dict) -> dict:
    import torch
    from message_ops import ping_pong

    go = torch.zeros(1, dtype=torch.uint8)
    samples = {name: {str(size): {"one_way_s": [], "stream_s": []} for size in config["sizes"]}
               for name in all_ops}
    names = list(all_ops)
    for round_index in range(-1, config["rounds"]):  # round -1 warms every path up
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for size in config["sizes"]:
            round_trips, messages = config["plan"][str(size)]
            payload = torch.ones(size, dtype=torch.uint8)
            # Receive buffers (gloo fills them; rdma and tcp allocate or reuse their own) are
            # touched here, outside the timed part.
            buffers = [torch.zeros(size, dtype=torch.uint8) for _ in range(messages)]
            for name in order:
                ops = all_ops[name]
                one_way = ping_pong(ops, rank, size, 1 if round_index < 0 else round_trips)
                seconds = stream_at_receiver(ops, rank, payload, buffers, go)
                if round_index >= 0:
                    samples[name][str(size)]["one_way_s"].append(one_way)
                    samples[name][str(size)]["stream_s"].append(seconds)
            del buffers  # before the next size's are made
    return samples


def worker_main(config_path: str, rank: int) -> None:
    sys.path.append(str(REPO_ROOT))
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from message_ops import MessageOps

    torch.set_num_threads(1)
    config = json.loads(Path(config_path).read_text())
    ips, timeout_s = config["ips"], config["timeout_s"]
    listener = None
    if rank == 0 and "tcp" in config["transports"]:
        listener = socket.create_server((ips[0], TCP_PORT))  # before the peer can hear of it
        listener.settimeout(timeout_s)
    dist.init_process_group("gloo", init_method=f"tcp://{ips[0]}:{GLOO_PORT}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=timeout_s))
    all_ops, rdma_context, rdma_store = {}, None, None
    for name in config["transports"]:
        if name == "rdma":
            rdma_context, rdma_store = _open_rdma(ips, rank, timeout_s)
            all_ops[name] = MessageOps(name, rdma_context, 1 - rank)
        elif name == "gloo":
            all_ops[name] = MessageOps(name, None, 1 - rank)
        else:
            all_ops[name] = _connect_tcp(listener, ips[0], timeout_s)
    result = {"samples": _measure(config, rank, all_ops)}
    if rdma_context is not None:  # which UCX transports and devices the rdma rows went through
        result["rdma_endpoint"] = rdma_context.endpoint_info(1 - rank)
    dist.barrier()
    if rdma_context is not None:
        rdma_context.close()
    del rdma_store  # kept until both ranks passed the barrier
    if "tcp" in all_ops:
        all_ops["tcp"].connection.close()
    dist.destroy_process_group()
    result_path = Path(config["result_dir"]) / f"rank{rank}.json"
    result_path.write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------
# driver side (the host namespace)


def _wait_for_workers(processes, logs: list[Path], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    timed_out = False
    while any(process.poll() is None for process in processes):
        if any(process.poll() not in (None, 0) for process in processes):
            break  # the other rank would only wait for its timeouts
        timed_out = time.monotonic() > deadline
        if timed_out:
            break
        time.sleep(0.1)
    codes = [process.poll() for process in processes]
    if codes != [0, 0]:
        tails = "\n".join(f"--- rank {rank} ({log.name}) ---\n{log.read_text()[-3000:]}"
                          for rank, log in enumerate(logs))
        what = (f"did not finish within {timeout_s:.0f} s" if timed_out
                else f"exited with {codes} (None: still running, killed)")
        raise RuntimeError(f"cross-namespace benchmark ranks {what}\n{tails}")


def _summarize(name: str, size: int, messages: int, rank0: dict, rank1: dict) -> dict:
    one_way_rounds = rank0["one_way_s"]  # rank 0 started each round trip
    every_round_trip = sorted(s for samples in one_way_rounds for s in samples)
    p50_rounds = [statistics.median(samples) * 1e6 for samples in one_way_rounds]
    bandwidth_rounds = [size * messages / seconds / 1e9 for seconds in rank1["stream_s"]]
    return {
        "transport": name,
        "bytes": size,
        "bandwidth_gbps": statistics.median(bandwidth_rounds),
        "bandwidth_gbps_rounds": bandwidth_rounds,
        "latency_us_p50": statistics.median(p50_rounds),
        "latency_us_p50_rounds": p50_rounds,
        "latency_us_p99": every_round_trip[min(len(every_round_trip) - 1,
                                               int(0.99 * len(every_round_trip)))] * 1e6,
        "stream_messages": messages,
    }


def run(args) -> dict:
    """Runs the two ranks in two namespaces; returns the JSON document (rows, targets, setup)."""
    transports = list(args.transport_list)
    skipped = {}
    if "rdma" in transports:
        reason = rdma_skip_reason()
        if reason:
            skipped["rdma"] = reason
            transports.remove("rdma")
    plan = {str(size): round_plan(args, size) for size in args.size_list}
    with two_node_network() as net, tempfile.TemporaryDirectory(prefix="dpp-xns-bench-") as tmp:
        config = {"ips": list(net.ips), "transports": transports, "sizes": args.size_list,
                  "rounds": args.repeats, "plan": plan, "timeout_s": 60.0, "result_dir": tmp}
        config_path = Path(tmp) / "config.json"
        config_path.write_text(json.dumps(config))
        logs = [Path(tmp) / f"rank{rank}.log" for rank in range(2)]
        processes = []
        environment = [{"UCX_TLS": "tcp", "UCX_NET_DEVICES": interface,
                        "GLOO_SOCKET_IFNAME": interface} for interface in net.interfaces]
        for rank in range(2):
            env = dict(os.environ, OMP_NUM_THREADS="1", **environment[rank])
            with open(logs[rank], "w") as log:
                processes.append(net.popen(
                    rank, [sys.executable, str(Path(__file__).resolve()), "--worker",
                           str(config_path), str(rank)],
                    env=env, stdout=log, stderr=log, cwd=str(REPO_ROOT)))
        _wait_for_workers(processes, logs, args.timeout)
        ranks = [json.loads((Path(tmp) / f"rank{rank}.json").read_text()) for rank in range(2)]
        network = {"namespaces": list(net.names), "ips": list(net.ips),
                   "interfaces": list(net.interfaces)}
    rows = [_summarize(name, size, plan[str(size)][1], ranks[0]["samples"][name][str(size)],
                       ranks[1]["samples"][name][str(size)])
            for name in transports for size in args.size_list]
    return {"mode": "cross-namespace", "results": rows, "skipped": skipped,
            "rdma_endpoint": ranks[0].get("rdma_endpoint"),
            "targets": targets(rows, skipped), "network": network,
            "environment": environment,
            "config": {"sizes": args.size_list, "rounds": args.repeats,
                       "latency_iters": args.latency_iters, "stream_bytes": args.stream_bytes,
                       "round_trips_and_stream_messages": plan}}


def targets(rows: list[dict], skipped: dict) -> dict:
    """The issue's targets against the medians: met True/False, or None with why not measured."""
    by_key = {(row["transport"], row["bytes"]): row for row in rows}

    def not_measured(missing: str) -> dict:
        why = "rdma skipped" if "rdma" in skipped else f"no {missing} row"
        return {"met": None, "why": why}

    rdma, gloo = by_key.get(("rdma", 4 * KiB)), by_key.get(("gloo", 4 * KiB))
    if rdma and gloo:
        ratio = rdma["latency_us_p50"] / gloo["latency_us_p50"]
        latency = {"ratio": ratio, "met": ratio <= TARGET_LATENCY_RATIO}
    else:
        latency = not_measured("4 KiB rdma and gloo")
    bandwidth = {}
    for size in sorted({row["bytes"] for row in rows if row["bytes"] >= MiB}):
        rdma, tcp = by_key.get(("rdma", size)), by_key.get(("tcp", size))
        if rdma and tcp:
            ratio = rdma["bandwidth_gbps"] / tcp["bandwidth_gbps"]
            bandwidth[str(size)] = {"ratio": ratio, "met": ratio >= TARGET_BANDWIDTH_RATIO}
        else:
            bandwidth[str(size)] = not_measured(f"{size} B rdma and tcp")
    return {"latency_4KiB_rdma_over_gloo": latency, "bandwidth_rdma_over_tcp": bandwidth,
            "latency_ratio_at_most": TARGET_LATENCY_RATIO,
            "bandwidth_ratio_at_least": TARGET_BANDWIDTH_RATIO}


def _size_text(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB and size % MiB == 0 else (
        f"{size // KiB} KiB" if size % KiB == 0 else f"{size} B")


def _met_text(target: dict) -> str:
    if target["met"] is None:
        return f"not measured ({target['why']})"
    return f"{target['ratio']:.2f}x, {'met' if target['met'] else 'NOT met'}"


def print_report(document: dict) -> None:
    network, rows = document["network"], document["results"]
    print(f"cross-namespace: {network['namespaces'][0]} ({network['ips'][0]} on "
          f"{network['interfaces'][0]}) <-> {network['namespaces'][1]} ({network['ips'][1]} on "
          f"{network['interfaces'][1]}), one veth pair")
    for rank, environment in enumerate(document["environment"]):
        print(f"rank {rank}: " + " ".join(f"{key}={value}" for key, value in environment.items()))
    print("(UCX_TLS=tcp keeps UCX off shared memory: the namespaces share one kernel and /dev/shm)")
    for name, reason in document["skipped"].items():
        print(f"{name}: skipped, {reason}")
    if document["rdma_endpoint"]:
        lanes = [line.strip("# ") for line in document["rdma_endpoint"].splitlines()
                 if "lane[" in line]
        print("rdma link (UCX, rank 0's endpoint): " + "; ".join(lanes))
    print(f"{document['config']['rounds']} rounds, transports interleaved round by round; "
          f"median (min-max) over rounds; p99 over every round trip")
    print(f"{'bytes':>8} {'transport':>9} {'one-way p50 us':>24} {'p99 us':>9} {'GB/s':>20}")
    order = sorted(rows, key=lambda r: (r["bytes"], TRANSPORTS.index(r["transport"])))
    for row in order:
        p50s, gbps = row["latency_us_p50_rounds"], row["bandwidth_gbps_rounds"]
        latency = f"{row['latency_us_p50']:.1f} ({min(p50s):.1f}-{max(p50s):.1f})"
        bandwidth = f"{row['bandwidth_gbps']:.3f} ({min(gbps):.2f}-{max(gbps):.2f})"
        print(f"{_size_text(row['bytes']):>8} {row['transport']:>9} {latency:>24} "
              f"{row['latency_us_p99']:>9.1f} {bandwidth:>20}")
    by_key = {(row["transport"], row["bytes"]): row for row in rows}
    names = [name for name in TRANSPORTS if any(row["transport"] == name for row in rows)]
    latency_target = document["targets"]["latency_4KiB_rdma_over_gloo"]
    bandwidth_targets = document["targets"]["bandwidth_rdma_over_tcp"]
    if any(size == 4 * KiB for _, size in by_key):
        values = ", ".join(f"{name} {by_key[(name, 4 * KiB)]['latency_us_p50']:.1f} us"
                           for name in names)
        print(f"latency at 4 KiB (one-way p50): {values}")
    print(f"  rdma/gloo {_met_text(latency_target)} (target <= {TARGET_LATENCY_RATIO}x)")
    rdma, tcp = by_key.get(("rdma", 4 * KiB)), by_key.get(("tcp", 4 * KiB))
    if rdma and tcp:
        ratio = rdma["latency_us_p50"] / tcp["latency_us_p50"]
        print(f"  rdma/tcp {ratio:.2f}x (no target; the plain socket is the link's floor)")
    if bandwidth_targets:
        print("bandwidth (GB/s, medians):")
        print(f"{'bytes':>8} " + " ".join(f"{name:>8}" for name in names) + f" {'rdma/tcp':>32}")
        for size_text, target in bandwidth_targets.items():
            size = int(size_text)
            values = " ".join(f"{by_key[(name, size)]['bandwidth_gbps']:>8.3f}" for name in names)
            print(f"{_size_text(size):>8} {values} {_met_text(target):>32}")
        print(f"  target: rdma >= {TARGET_BANDWIDTH_RATIO}x tcp at every size >= 1 MiB")


def main(args) -> int:
    reason = netns_skip_reason()
    if reason:
        print(f"transport_bench: error: --cross-namespace cannot run here: {reason}",
              file=sys.stderr)
        return 2
    document = run(args)
    print_report(document)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump(document, handle, indent=1)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "--worker":
        sys.exit("usage: cross_namespace_bench.py --worker CONFIG RANK "
                 "(run by transport_bench.py --cross-namespace)")
    worker_main(sys.argv[2], int(sys.argv[3]))
