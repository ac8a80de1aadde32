"""Point-to-point transport benchmark: shm_tensor vs torch.distributed gloo vs an in-process memcpy.

Two processes on this node. `shm` is shm_tensor as configured by default: the sender copies a
message into a slot and the receiver lends that slot to the received tensor (messages of at least
256 KiB while it has a loan left), else pulls messages of at least --single-copy-min-bytes in one
copy where the probe allows it, else copies out. `shm-1copy` turns lending off (single copy from
--single-copy-min-bytes, two copies below), `shm-2copy` turns both off (every message copied into a
slot and out of it): what a receiver that holds on to every large received tensor gets, with and
without single copy. For every message size:
  latency   ping-pong (rank 0 sends, rank 1 sends the same size back); one-way latency = half the
            round trip; p50 and p99 over --latency-iters round trips;
  bandwidth a stream of 4 to 64 messages (rank 0 sends, rank 1 has posted every receive and
            drops each message once it has arrived, then acknowledges); bytes / time, median over
            --repeats streams.
  memcpy    one copy of the same size into a preallocated tensor in one process: the limit here.
Prints a table and writes {"results": [{"transport", "bytes", "bandwidth_gbps", "latency_us_p50",
"latency_us_p99"}]} to --json. bandwidth_gbps is in gigabytes per second (1e9 B/s).

--device cuda instead measures GPU tensors (transport_bench_cuda.py): shm_tensor's CUDA IPC between
two processes on one GPU beside one device-to-device copy, and NCCL where there are 2 GPUs; without
a GPU it says so in one line and exits 0.

--cross-namespace instead runs the two ranks in two network namespaces joined by a veth pair (root
and iproute2 needed) with the transports rdma (rdma_tensor), gloo and tcp (a plain socket), rounds
interleaved; see cross_namespace_bench.py.

    python benchmarks/transport_bench.py --json runs/transport.json
    python benchmarks/transport_bench.py --quick
    python benchmarks/transport_bench.py --cross-namespace --json runs/transport_xns.json
    python benchmarks/transport_bench.py --device cuda --json runs/transport_cuda.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from message_ops import MessageOps, ping_pong  # benchmarks/ (this script's directory)
from two_ranks import run_two_ranks

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB]
QUICK_SIZES = [4 * KiB, 1 * MiB]
TRANSPORTS = ("shm", "shm-1copy", "shm-2copy", "gloo", "memcpy")
CROSS_NAMESPACE_TRANSPORTS = ("rdma", "gloo", "tcp")  # cross_namespace_bench.TRANSPORTS
CUDA_TRANSPORTS = ("shm", "shm-host", "d2d", "events", "nccl")  # transport_bench_cuda.TRANSPORTS
FAKE_CUDA_TRANSPORTS = ("shm", "shm-host", "d2d")  # transport_bench_cuda.FAKE_TRANSPORTS
CUDA_SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
# ShmConfig of each shm row: lending (zero_copy_receive) and single copy on or off.
SHM_TRANSPORTS = {
    "shm": dict(zero_copy_receive=True, single_copy=True),
    "shm-1copy": dict(zero_copy_receive=False, single_copy=True),
    "shm-2copy": dict(zero_copy_receive=False, single_copy=False),
}


def parse_size(text: str) -> int:
    units = {"k": KiB, "m": MiB, "g": 1 << 30}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda", "fake-cuda"), default="cpu",
                        help="cpu (default): CPU tensors; cuda: GPU tensors (shm_tensor's CUDA IPC, "
                             "a device copy, NCCL), see transport_bench_cuda.py; fake-cuda: the CUDA "
                             "IPC protocol on CPU through the fake CUDA runtime (its signalling cost)")
    parser.add_argument("--sizes", type=str, default=None,
                        help="comma-separated message sizes, e.g. 4KiB,1MiB,64MiB "
                             "(default 4KiB,64KiB,1MiB,4MiB,16MiB,64MiB; --device cuda: "
                             "4KiB,64KiB,1MiB,16MiB,64MiB,256MiB)")
    parser.add_argument("--transports", type=str, default=None,
                        help=f"comma-separated subset of {','.join(TRANSPORTS)} (default all; with "
                             f"--cross-namespace of {','.join(CROSS_NAMESPACE_TRANSPORTS)}; with "
                             f"--device cuda of {','.join(CUDA_TRANSPORTS)})")
    parser.add_argument("--latency-iters", type=int, default=200,
                        help="round trips per size for latency (fewer for large sizes)")
    parser.add_argument("--stream-bytes", type=parse_size, default=256 * MiB,
                        help="bytes per bandwidth stream (4 to 64 messages)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="bandwidth streams per size (--cross-namespace: rounds)")
    parser.add_argument("--workload", type=parse_size, default=8 * MiB,
                        help="shm: bytes per copy thread")
    parser.add_argument("--copy-threads", type=int, default=2, help="shm: most threads per copy")
    parser.add_argument("--num-slots", type=int, default=4, help="shm: slots per directed pair")
    parser.add_argument("--slot-bytes", type=parse_size, default=None,
                        help="shm --device cuda: bytes per slot; larger messages are refused "
                             "(default ShmConfig's, 64MiB; on CPU: the largest size)")
    parser.add_argument("--spin-us", type=float, default=20.0,
                        help="shm: microseconds a waiter watches its doorbell before sleeping")
    parser.add_argument("--single-copy-min-bytes", type=parse_size, default=None,
                        help="shm: smallest message the receiver pulls in one copy "
                             "(default: ShmConfig's)")
    parser.add_argument("--quick", action="store_true",
                        help="sizes 4KiB and 1MiB, few iterations (for tests)")
    parser.add_argument("--cross-namespace", action="store_true",
                        help="the two ranks in two network namespaces over a veth pair: rdma, gloo "
                             "and plain tcp, UCX_TLS=tcp")
    parser.add_argument("--json", type=str, default=None, help="write the results here")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run")
    return parser


def _fail(message: str) -> None:
    print(f"transport_bench: error: {message}", file=sys.stderr)
    sys.exit(2)


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    on_device = args.device in ("cuda", "fake-cuda")  # transport_bench_cuda.py measures it
    if args.cross_namespace and on_device:
        _fail("--cross-namespace measures CPU tensors; drop --device cuda")
    if args.slot_bytes is not None and (not on_device or args.slot_bytes < 4096):
        _fail("--slot-bytes is for --device cuda, at least 4096")
    full_sizes = CUDA_SIZES if on_device else DEFAULT_SIZES
    try:
        args.size_list = ([parse_size(s) for s in args.sizes.split(",")] if args.sizes
                          else (QUICK_SIZES if args.quick else full_sizes))
    except ValueError:
        _fail(f"--sizes {args.sizes!r}: use sizes like 4KiB,1MiB,65536")
    known = (CROSS_NAMESPACE_TRANSPORTS if args.cross_namespace
             else CUDA_TRANSPORTS if args.device == "cuda"
             else FAKE_CUDA_TRANSPORTS if args.device == "fake-cuda" else TRANSPORTS)
    args.transport_list = ([t.strip() for t in args.transports.split(",") if t.strip()]
                           if args.transports else list(known))
    unknown = set(args.transport_list) - set(known)
    if unknown:
        _fail(f"--transports: unknown {sorted(unknown)}; pick from {','.join(known)}")
    if args.single_copy_min_bytes is None or args.slot_bytes is None:
        from shm_tensor import ShmConfig

        if args.single_copy_min_bytes is None:
            args.single_copy_min_bytes = ShmConfig().single_copy_min_bytes
        if args.slot_bytes is None and on_device:
            args.slot_bytes = ShmConfig().slot_bytes
    if args.single_copy_min_bytes < 4096:
        _fail("--single-copy-min-bytes must be at least 4096")
    if any(size <= 0 for size in args.size_list):
        _fail("--sizes must be positive")
    if args.quick:
        args.latency_iters = min(args.latency_iters, 50)
        args.repeats = min(args.repeats, 2)
        args.stream_bytes = min(args.stream_bytes, 16 * MiB)
    if args.latency_iters < 1 or args.repeats < 1:
        _fail("--latency-iters and --repeats must be at least 1")
    return args


def latency_iters(args, size: int) -> int:
    return max(5, min(args.latency_iters, (256 * MiB) // size))


def stream_count(args, size: int) -> int:
    return max(4, min(64, args.stream_bytes // size))


def summarize(name: str, size: int, bandwidth_s: list[float], one_way_s: list[float]) -> dict:
    ordered = sorted(one_way_s)
    return {
        "transport": name,
        "bytes": size,
        "bandwidth_gbps": size / statistics.median(bandwidth_s) / 1e9,
        "latency_us_p50": statistics.median(ordered) * 1e6,
        "latency_us_p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e6,
    }


def bench_memcpy(args, size: int) -> dict:
    src = torch.randint(0, 255, (size,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages once
    times = []
    for _ in range(max(args.repeats * 4, latency_iters(args, size) // 4)):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return summarize("memcpy", size, times, times)


# ---------------------------------------------------------------------------------------------
# two-process part


def _stream(ops: MessageOps, rank: int, size: int, count: int, repeats: int) -> list[float]:
    payload = torch.ones(size, dtype=torch.uint8)
    buffers = [torch.empty(size, dtype=torch.uint8) for _ in range(count)] if ops.ctx is None \
        else [None] * count
    ack = torch.zeros(1, dtype=torch.uint8)
    per_message = []
    for repeat in range(repeats + 1):  # the first warms up
        tags = [ops.next_tag() for _ in range(count)]
        ack_tag = ops.next_tag()
        start = time.perf_counter()
        if rank == 0:
            for handle in [ops.send(payload, tag) for tag in tags]:
                ops.wait(handle)
            ops.wait(ops.recv(ack, ack_tag))
        else:
            # Every receive posted up front; each message is dropped once it has arrived, as a
            # consumer that is done with it would (gloo's receive buffers are reused instead).
            handles = [ops.recv(buffer, tag) for buffer, tag in zip(buffers, tags)]
            for i in range(count):
                ops.wait(handles[i])
                handles[i] = None
            ops.wait(ops.send(ack, ack_tag))
        if repeat:
            per_message.append((time.perf_counter() - start) / count)
    return per_message


def _worker(rank: int, args, store_path: str, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import shm_tensor

    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    peer = 1 - rank
    contexts = {}
    for name in [t for t in args.transport_list if t in SHM_TRANSPORTS]:
        config = shm_tensor.ShmConfig(num_slots=args.num_slots, slot_bytes=max(args.size_list),
                                      copy_threads=args.copy_threads,
                                      bytes_per_thread=args.workload, spin_us=args.spin_us,
                                      timeout_s=60, single_copy_min_bytes=args.single_copy_min_bytes,
                                      **SHM_TRANSPORTS[name])
        contexts[name] = shm_tensor.create_context_with_store(
            store, rank=rank, world_size=2, peers=[peer], config=config,
            prefix=f"transport_bench/{name}")
    rows = []
    for name in [t for t in args.transport_list if t != "memcpy"]:
        ops = MessageOps(name, contexts.get(name), peer)
        for size in args.size_list:
            dist.barrier()
            one_way = ping_pong(ops, rank, size, latency_iters(args, size))
            per_message = _stream(ops, rank, size, stream_count(args, size), args.repeats)
            rows.append(summarize(name, size, per_message, one_way))
    dist.barrier()
    # Which path the shm rows took (rank 1's probe and counts: it receives the streams).
    paths = {name: {"single_copy_peers": list(ctx.single_copy_peers()),
                    "fallbacks": {str(k): v for k, v in ctx.single_copy_fallbacks().items()},
                    "message_counts": ctx.message_counts()}
             for name, ctx in contexts.items()}
    for ctx in contexts.values():
        ctx.close()
    dist.destroy_process_group()
    # Rank 0's clock times the streams it sends.
    results.put(("rows", rows) if rank == 0 else ("paths", paths))


def run(args: argparse.Namespace) -> list[dict]:
    rows = []
    if "memcpy" in args.transport_list:
        torch.set_num_threads(1)
        rows += [bench_memcpy(args, size) for size in args.size_list]
    if set(args.transport_list) - {"memcpy"}:
        reports = dict(run_two_ranks(_worker, args, args.timeout))
        rows += reports["rows"]
        args.shm_paths = reports["paths"]
    return rows


def print_table(rows: list[dict]) -> None:
    by_key = {(row["transport"], row["bytes"]): row for row in rows}
    print(f"{'transport':>9} {'bytes':>10} {'GB/s':>8} {'p50 us':>9} {'p99 us':>9} "
          f"{'x memcpy':>9} {'x gloo':>7}")
    for row in sorted(rows, key=lambda r: (TRANSPORTS.index(r["transport"]), r["bytes"])):
        memcpy = by_key.get(("memcpy", row["bytes"]))
        gloo = by_key.get(("gloo", row["bytes"]))
        vs_memcpy = f"{row['bandwidth_gbps'] / memcpy['bandwidth_gbps']:.2f}" if memcpy else "-"
        vs_gloo = f"{row['bandwidth_gbps'] / gloo['bandwidth_gbps']:.1f}" if gloo else "-"
        print(f"{row['transport']:>9} {row['bytes']:>10} {row['bandwidth_gbps']:>8.2f} "
              f"{row['latency_us_p50']:>9.1f} {row['latency_us_p99']:>9.1f} {vs_memcpy:>9} "
              f"{vs_gloo:>7}")


def describe_paths(args) -> None:
    """One line per shm transport: did the receiver pull in one copy, and how many messages did."""
    for name, path in getattr(args, "shm_paths", {}).items():
        counts = path["message_counts"]
        how = "slots lent from 256 KiB, " if SHM_TRANSPORTS[name]["zero_copy_receive"] else ""
        if path["single_copy_peers"]:
            how += f"single copy from {args.single_copy_min_bytes} B"
        else:
            how += "two copies (" + "; ".join(path["fallbacks"].values()) + ")"
        print(f"{name}: {how}; receiver took {counts['received_zero_copy']} messages in a lent slot, "
              f"{counts['received_single_copy']} in one copy, {counts['received_two_copy']} in two")


def main(argv=None) -> int:
    args = resolve(build_parser().parse_args(argv))
    if args.cross_namespace:
        import cross_namespace_bench

        return cross_namespace_bench.main(args)
    if args.device in ("cuda", "fake-cuda"):
        import transport_bench_cuda

        return transport_bench_cuda.main(args)
    rows = run(args)
    print_table(rows)
    describe_paths(args)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump({"results": rows, "config": {
                "sizes": args.size_list, "workload": args.workload,
                "copy_threads": args.copy_threads, "num_slots": args.num_slots,
                "spin_us": args.spin_us, "single_copy_min_bytes": args.single_copy_min_bytes},
                "shm_paths": getattr(args, "shm_paths", {})}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
