"""transport_bench.py --device cuda: GPU tensors between two processes.

  shm       shm_tensor's CUDA IPC: both processes on GPU 0, bf16 tensors, ping-pong (rank 0 sends,
            rank 1 sends what it received back); rank 0 synchronizes its device after each round
            trip, so the time includes the copies on the device, not only the signalling. One-way
            time = half the round trip, p50 and mean over --latency-iters round trips after 3
            warm-up ones. A message shm_tensor refuses (MessageTooLargeError: only where the
            tensor's memory cannot be exported and it exceeds --slot-bytes) says "refused".
  shm-host  the same ping-pong without the per-round-trip device synchronization: the host side
            (descriptor through shared memory, doorbell, event calls) alone, since no shm_tensor
            call waits for the device. The device work trails behind and is checked at the end.
  d2d       one device-to-device copy of the same bytes in one process (torch copy_, CUDA events):
            the limit of any transport on this GPU.
  events    the floor of any design that hands a GPU tensor to another process through events, with
            no shm_tensor in it: per hop, the sender copies the bytes on its own device (the one copy a
            message needs), records an interprocess CUDA event and bumps a counter in shared memory;
            the peer spins on the counter, makes its stream wait on the event (opened once) and does
            the same back. Rank 0 synchronizes its device after each round trip, as "shm" does. On
            one GPU this is the cost of handing work between two processes' CUDA contexts.
  nccl      torch.distributed NCCL send/recv ping-pong, rank r on GPU r: only with 2 or more GPUs
            (NCCL does not run two ranks on one GPU); skipped with the reason otherwise.

--device fake-cuda runs shm and shm-host on a machine without a GPU: CPU tensors take the CUDA IPC
protocol through the fake CUDA runtime (csrc/fake_cudart: host memory, process_vm_readv for the
"device" copy), which measures the protocol's signalling cost; d2d is then one CPU copy_ of the bytes.

Prints a table and writes {"device", "gpu", "gpus", "results": [{"transport", "bytes",
"one_way_us_p50", "one_way_us_mean", "gbps", "refused"}], "skipped": {transport: reason},
"config"} to --json. With --device cuda and no GPU it prints one line saying so and exits 0 (as
gpu_check.sh).
"""
from __future__ import annotations

import json
import mmap
import os
import statistics
import time
from typing import Optional

import torch
import torch.distributed as dist

from two_ranks import run_two_ranks  # benchmarks/ (this script's directory)

KiB, MiB = 1 << 10, 1 << 20
TRANSPORTS = ("shm", "shm-host", "d2d", "events", "nccl")
FAKE_TRANSPORTS = ("shm", "shm-host", "d2d")
DEFAULT_SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
QUICK_SIZES = [4 * KiB, 1 * MiB]
WARMUP = 3
WAIT_S = 60.0


def no_gpu_reason() -> Optional[str]:
    if not torch.cuda.is_available():
        return "no CUDA GPU here (torch.cuda.is_available() is False)"
    return None


def _row(transport: str, size: int, one_way: list[float]) -> dict:
    p50 = statistics.median(one_way)
    return {"transport": transport, "bytes": size, "one_way_us_p50": p50 * 1e6,
            "one_way_us_mean": statistics.fmean(one_way) * 1e6, "gbps": size / p50 / 1e9,
            "refused": None}


def _bf16(size: int, device) -> torch.Tensor:
    return torch.randn(max(1, size // 2), device=device, dtype=torch.bfloat16)


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _shm_size(ctx, store, rank: int, size: int, iters: int, tag: int, device: str,
              sync_each: bool) -> Optional[dict]:
    """Rank 0's row of one size (None on rank 1). Rank 0's first send says whether shm_tensor
    takes the size; rank 1 learns the verdict through the store before it receives. `device`
    "cpu": CPU tensors (the fake CUDA runtime's path). `sync_each`: rank 0 synchronizes its device
    after every round trip ("shm"); otherwise only at the end ("shm-host")."""
    import shm_tensor

    name = "shm" if sync_each else "shm-host"
    peer = 1 - rank
    tensor = None
    key = f"verdict/{name}/{size}"
    if rank == 0:
        tensor = _bf16(size, device)
        _synchronize(device)
        try:
            first = ctx.isend(tensor, peer, tag)
        except shm_tensor.MessageTooLargeError as error:
            store.set(key, "refused")
            return {"transport": name, "bytes": size, "one_way_us_p50": None,
                    "one_way_us_mean": None, "gbps": None, "refused": str(error)}
        store.set(key, "ok")
    elif store.get(key) != b"ok":
        return None
    round_trips, back = [], None
    for i in range(WARMUP + iters):
        start = time.perf_counter()
        if rank == 0:
            send = first if i == 0 else ctx.isend(tensor, peer, tag)
            back = ctx.irecv(peer, tag + 1).wait(timeout=WAIT_S)
            send.wait(timeout=WAIT_S)  # complete by now: the peer's copy was queued before its reply
            if sync_each:
                _synchronize(device)
        else:
            got = ctx.irecv(peer, tag).wait(timeout=WAIT_S)
            ctx.isend(got, peer, tag + 1).wait(timeout=WAIT_S)
        round_trips.append(time.perf_counter() - start)
        tag += 2
    _synchronize(device)
    if rank == 1:
        return None
    if not torch.equal(back, tensor):
        raise RuntimeError(f"{name}: the {size} B message came back changed")
    return _row(name, size, [seconds / 2 for seconds in round_trips[WARMUP:]])


def _host_copy_size(size: int, iters: int) -> dict:
    """--device fake-cuda's d2d row: one CPU copy_ of the bytes."""
    source = _bf16(size, "cpu")
    target = torch.empty_like(source)
    times = []
    for i in range(WARMUP + iters):
        start = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - start)
    return _row("d2d", size, times[WARMUP:])


def _d2d_size(size: int, iters: int) -> dict:
    source = _bf16(size, "cuda")
    target = torch.empty_like(source)
    for _ in range(WARMUP):
        target.copy_(source)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    for start, end in events:
        start.record()
        target.copy_(source)
        end.record()
    torch.cuda.synchronize()
    return _row("d2d", size, [start.elapsed_time(end) / 1e3 for start, end in events])


def _events_size(rank: int, store, size: int, iters: int, tag: int) -> Optional[dict]:
    """The "events" row of one size on rank 0 (None on rank 1), see the module docstring."""
    import numpy as np
    from multiprocessing import shared_memory

    peer = 1 - rank
    source, target = _bf16(size, "cuda"), torch.empty(max(1, size // 2), device="cuda",
                                                      dtype=torch.bfloat16)
    mine = torch.cuda.Event(interprocess=True)
    mine.record()  # an event must have been recorded once before its handle is shared
    store.set(f"events/{tag}/{rank}", bytes(mine.ipc_handle()))
    theirs = torch.cuda.Event.from_ipc_handle(torch.cuda.current_device(),
                                              store.get(f"events/{tag}/{peer}"))
    name = f"dpp_events_{os.getppid()}_{tag}"
    memory = (shared_memory.SharedMemory(name, create=True, size=16) if rank == 0 else None)
    store.set(f"events/{tag}/memory", "ready") if rank == 0 else store.get(f"events/{tag}/memory")
    if memory is None:
        # Rank 0 owns and unlinks it. Rank 1 maps the file itself: through SharedMemory it would
        # register the name with the resource tracker both ranks share, which then complains when
        # the name is unregistered twice.
        with open(f"/dev/shm/{name}", "r+b") as file:
            memory = mmap.mmap(file.fileno(), 16)
    buffer = memory.buf if rank == 0 else memory
    counters = np.ndarray((2,), dtype=np.int64, buffer=buffer)  # counters[r]: hops rank r sent
    if rank == 0:
        counters[:] = 0
    torch.cuda.synchronize()
    store.set(f"events/{tag}/go/{rank}", "1")
    store.get(f"events/{tag}/go/{peer}")
    deadline = time.monotonic() + WAIT_S

    def hand_over(count: int) -> None:
        target.copy_(source)
        mine.record()
        counters[rank] = count

    def wait_for(count: int) -> None:
        while counters[peer] < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"events: waited {WAIT_S} s for hop {count} of rank {peer}")
        torch.cuda.current_stream().wait_event(theirs)

    round_trips = []
    for i in range(1, WARMUP + iters + 1):
        start = time.perf_counter()
        if rank == 0:
            hand_over(i)
            wait_for(i)
            torch.cuda.synchronize()
        else:
            wait_for(i)
            hand_over(i)
        round_trips.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    store.set(f"events/{tag}/done/{rank}", "1")
    store.get(f"events/{tag}/done/{peer}")
    del counters
    memory.close()
    if rank == 0:
        memory.unlink()
        return _row("events", size, [seconds / 2 for seconds in round_trips[WARMUP:]])
    return None


def _nccl_size(rank: int, size: int, iters: int) -> Optional[dict]:
    peer = 1 - rank
    tensor = _bf16(size, torch.device("cuda", rank))
    buffer = torch.empty_like(tensor)
    round_trips = []
    for _ in range(WARMUP + iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        if rank == 0:
            dist.send(tensor, peer)
            dist.recv(buffer, peer)
        else:
            dist.recv(buffer, peer)
            dist.send(buffer, peer)
        torch.cuda.synchronize()
        round_trips.append(time.perf_counter() - start)
    if rank == 1:
        return None
    return _row("nccl", size, [seconds / 2 for seconds in round_trips[WARMUP:]])


def _iters(args, size: int) -> int:
    return max(5, min(args.latency_iters, (1 << 30) // size))


def _worker(rank: int, args, store_path: str, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import shm_tensor
    from shm_tensor.context import store_barrier

    store = dist.FileStore(store_path, 2)
    rows = []
    fake = args.device == "fake-cuda"
    device = "cpu" if fake else "cuda"
    try:
        if fake:
            os.environ["SHM_TENSOR_CUDART"] = shm_tensor.fake_cudart_path()  # before the first load
        else:
            torch.cuda.set_device(0)
        shm_kinds = [kind for kind in ("shm", "shm-host") if kind in args.transport_list]
        if shm_kinds:
            config = shm_tensor.ShmConfig(num_slots=args.num_slots, slot_bytes=args.slot_bytes,
                                          timeout_s=WAIT_S, spin_us=args.spin_us)
            ctx = shm_tensor.create_context_with_store(store, rank=rank, world_size=2,
                                                       peers=[1 - rank], config=config,
                                                       prefix="transport_bench_cuda",
                                                       host_tensors_by_cuda_ipc=fake)
            tag = 0
            for kind in shm_kinds:
                for size in args.size_list:
                    row = _shm_size(ctx, store, rank, size, _iters(args, size), tag, device,
                                    sync_each=kind == "shm")
                    rows += [row] if row else []
                    tag += 1 << 20
            if rank == 0:
                rows.append({"transport": "paths", "counts": ctx.message_counts()})
            store_barrier(store, "shm/done", 2, timeout_s=WAIT_S)  # the peer's reads are queued
            _synchronize(device)
            store_barrier(store, "shm/synced", 2, timeout_s=WAIT_S)  # ...and done on the device
            ctx.close()
        if "d2d" in args.transport_list and rank == 0:
            measure = _host_copy_size if fake else _d2d_size
            rows += [measure(size, _iters(args, size)) for size in args.size_list]
        if "events" in args.transport_list:
            for index, size in enumerate(args.size_list):
                row = _events_size(rank, store, size, _iters(args, size), index)
                rows += [row] if row else []
        if "nccl" in args.transport_list and torch.cuda.device_count() >= 2:
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", store=dist.PrefixStore("nccl", store), rank=rank,
                                    world_size=2, device_id=torch.device("cuda", rank))
            for size in args.size_list:
                row = _nccl_size(rank, size, _iters(args, size))
                rows += [row] if row else []
            dist.destroy_process_group()
        results.put((rank, "ok", rows))
    except BaseException as error:  # reported by the parent
        results.put((rank, "error", f"{type(error).__name__}: {error}"))
        raise


def run(args) -> dict:
    fake = args.device == "fake-cuda"
    gpus = 0 if fake else torch.cuda.device_count()
    skipped = {}
    if "nccl" in args.transport_list and gpus < 2:
        skipped["nccl"] = f"needs 2 GPUs (NCCL runs one rank per GPU); {gpus} here"
    reports = run_two_ranks(_worker, args, args.timeout)
    errors = [f"rank {rank}: {value}" for rank, status, value in reports if status != "ok"]
    if errors:
        raise RuntimeError("; ".join(errors))
    rows = [row for _, _, rank_rows in sorted(reports) for row in rank_rows]
    paths = [row["counts"] for row in rows if row["transport"] == "paths"]
    rows = [row for row in rows if row["transport"] != "paths"]
    gpu = "fake CUDA runtime on CPU" if fake else torch.cuda.get_device_name(0)
    return {"device": args.device, "gpu": gpu, "gpus": gpus, "results": rows, "skipped": skipped,
            "message_counts": paths[0] if paths else {},
            "config": {"sizes": args.size_list, "latency_iters": args.latency_iters,
                       "num_slots": args.num_slots, "slot_bytes": args.slot_bytes,
                       "dtype": "bfloat16"}}


def _us(row: Optional[dict]) -> str:
    if row is None:
        return "-"
    return "refused" if row["refused"] else f"{row['one_way_us_p50']:.1f}"


def print_table(document: dict) -> None:
    by_key = {(row["transport"], row["bytes"]): row for row in document["results"]}
    print(f"one-way time (p50, us), bf16, {document['gpu']} x {document['gpus']}")
    print(f"{'bytes':>10} {'shm':>10} {'shm-host':>10} {'d2d copy':>10} {'shm/d2d':>8} {'events':>10} "
          f"{'nccl':>10}")
    for size in document["config"]["sizes"]:
        shm, host, d2d, events, nccl = (by_key.get((name, size))
                                        for name in ("shm", "shm-host", "d2d", "events", "nccl"))
        ratio = "-"
        if shm and d2d and not shm["refused"]:
            ratio = f"{shm['one_way_us_p50'] / d2d['one_way_us_p50']:.1f}"
        print(f"{size:>10} {_us(shm):>10} {_us(host):>10} {_us(d2d):>10} {ratio:>8} {_us(events):>10} "
              f"{_us(nccl):>10}")
    counts = document.get("message_counts") or {}
    if counts:
        print(f"paths (rank 0): sent {counts.get('sent_device_direct', 0)} direct, "
              f"{counts.get('sent_device_staged', 0)} staged; received "
              f"{counts.get('received_device_direct', 0)} direct, "
              f"{counts.get('received_device_staged', 0)} staged")
    for row in document["results"]:
        if row["refused"]:
            print(f"shm refused {row['bytes']} B: {row['refused']}")
    for name, reason in document["skipped"].items():
        print(f"{name}: skipped: {reason}")


def main(args) -> int:
    reason = None if args.device == "fake-cuda" else no_gpu_reason()
    if reason:
        print(f"transport_bench: --device cuda: {reason}; nothing measured")
        return 0
    document = run(args)
    print_table(document)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump(document, handle, indent=1)
    return 0
