"""shm_tensor's CUDA IPC protocol on a machine without a GPU: CPU tensors take the CUDA path through
the fake CUDA runtime (csrc/fake_cudart, selected by SHM_TENSOR_CUDART; host memory stands for device
memory, process_vm_readv for the device copy). What it checks is the protocol: descriptors, the
direct path's single copy of any size, slot reuse, events instead of host waits, no per-message
opening of IPC handles, the staged fallback where memory cannot be exported, errors and lost peers.
The real-GPU tests are in test_shm_cuda.py."""
from __future__ import annotations

import ctypes
import os
import random

import pytest
import torch

import shm_tensor
from shm_tensor import ShmConfig
from shm_tensor.context import store_barrier
from _shm_util import payload, run_ranks

MiB = 1 << 20


def _fake_path() -> str:
    return shm_tensor.fake_cudart_path()


def _counts(names: tuple[str, ...]) -> dict[str, int]:
    """Calls of the fake runtime in this process (the library the transport loaded: same path)."""
    library = ctypes.CDLL(_fake_path())
    library.fake_cudart_count.restype = ctypes.c_ulonglong
    library.fake_cudart_count.argtypes = [ctypes.c_char_p]
    return {name: library.fake_cudart_count(name.encode()) for name in names}


def _context(store, rank: int, world: int, **config) -> shm_tensor.Context:
    os.environ["SHM_TENSOR_CUDART"] = _fake_path()  # read at the first (lazy) load
    settings = dict(num_slots=2, slot_bytes=MiB, timeout_s=30)
    settings.update(config)
    return shm_tensor.create_context_with_store(store, rank=rank, world_size=world, peers=[1 - rank],
                                               config=ShmConfig(**settings),
                                               host_tensors_by_cuda_ipc=True)


CASES = [
    (torch.float32, (3, 5)),
    (torch.bfloat16, (7, 2, 3)),
    (torch.int64, (4, 4)),
    (torch.bool, (9,)),
    (torch.float64, ()),
    (torch.float32, (0,)),
    (torch.float32, (3 * MiB // 4 + 5,)),   # 3 MiB: three times the slot
    (torch.bfloat16, (5 * MiB,)),           # 10 MiB
]
REUSED_TAG = 900
REPEATS = 12


def _exchange_worker(rank, world, store):
    peer = 1 - rank
    ctx = _context(store, rank, world)
    sends = [ctx.isend(payload(rank, tag, dtype, shape), peer, tag)
             for tag, (dtype, shape) in enumerate(CASES)]
    # One tensor sent again and again: its memory is opened once by the receiver.
    reused = payload(rank, REUSED_TAG, torch.float32, (1000,))
    tags = list(range(len(CASES))) + [REUSED_TAG + i for i in range(REPEATS)]
    random.Random(rank).shuffle(tags)
    receives = {ctx.irecv(peer, tag): tag for tag in tags}
    received = {}
    pending = list(receives) + sends
    next_repeat = 0
    while pending or next_repeat < REPEATS:
        # A few of the repeats in flight at a time, so the slots and their events are reused.
        if next_repeat < REPEATS and sum(handle.is_send for handle in pending) < 2:
            pending.append(ctx.isend(reused, peer, REUSED_TAG + next_repeat))
            next_repeat += 1
            continue
        done = pending.pop(ctx.wait_any(pending, timeout=30))
        if not done.is_send:
            received[receives[done]] = done.wait(timeout=0)
    problems = []
    for tag, (dtype, shape) in enumerate(CASES):
        got = received[tag]
        if got.dtype != dtype or not torch.equal(got, payload(peer, tag, dtype, shape)):
            problems.append(f"tag {tag}: {got.dtype} {tuple(got.shape)}")
    for i in range(REPEATS):
        if not torch.equal(received[REUSED_TAG + i], payload(peer, REUSED_TAG, torch.float32, (1000,))):
            problems.append(f"repeat {i}")
    store_barrier(store, "exchange/done", world, timeout_s=60)
    counts = ctx.message_counts()
    calls = _counts(("cudaIpcOpenMemHandle", "cudaIpcOpenEventHandle", "cudaEventQuery",
                     "cudaMemcpyAsync", "cudaStreamWaitEvent"))
    ctx.close()
    return problems, counts, calls


@pytest.mark.timeout(120)
def test_direct_path_any_size_any_order_slots_reused(tmp_path):
    results = run_ranks(_exchange_worker, 2, tmp_path, timeout_s=100)
    messages = len(CASES) + REPEATS
    opened_allocations = len(CASES) - 1 + 1  # not the empty tensor; the reused one once
    for rank, (problems, counts, calls) in results.items():
        assert problems == [], (rank, problems)
        # Every message went direct (memory exported), larger than the 1 MiB slot included.
        assert counts["sent_device_direct"] == messages - 1, counts  # the empty one is staged
        assert counts["received_device_direct"] == messages - 1, counts
        assert counts["sent_two_copy"] == counts["received_two_copy"] == 0, counts
        # One copy per non-empty message (the receiver's), no host waits on events.
        assert calls["cudaMemcpyAsync"] == messages - 1, calls
        assert calls["cudaEventQuery"] == 0, calls
        # Opened once per allocation and once per slot (and per slot the peer's copied event).
        assert calls["cudaIpcOpenMemHandle"] == opened_allocations, calls
        assert calls["cudaIpcOpenEventHandle"] <= 2 * 2, calls


def _staged_worker(rank, world, store):
    os.environ["FAKE_CUDART_REFUSE_EXPORT"] = "1"  # as torch's expandable segments
    peer = 1 - rank
    ctx = _context(store, rank, world)
    result = {}
    if rank == 0:
        try:
            ctx.isend(torch.zeros(MiB), peer, 1)  # 4 MiB: more than a slot, and not exportable
        except shm_tensor.MessageTooLargeError as error:
            result["refused"] = str(error)
        ctx.isend(payload(rank, 2, torch.float32, (1000,)), peer, 2).wait(timeout=30)
    else:
        got = ctx.irecv(peer, 2).wait(timeout=30)
        result["equal"] = torch.equal(got, payload(peer, 2, torch.float32, (1000,)))
    store_barrier(store, "staged/done", world, timeout_s=60)
    result["counts"] = ctx.message_counts()
    ctx.close()
    return result


@pytest.mark.timeout(120)
def test_unexportable_memory_goes_staged_and_is_capped_at_the_slot(tmp_path):
    results = run_ranks(_staged_worker, 2, tmp_path, timeout_s=100)
    assert "exceeds the slot size" in results[0]["refused"]
    assert "cudaIpcGetMemHandle failed" in results[0]["refused"]
    assert results[0]["counts"]["sent_device_staged"] == 1
    assert results[1]["equal"] and results[1]["counts"]["received_device_staged"] == 1


def _sender_dies_worker(rank, world, store):
    peer = 1 - rank
    ctx = _context(store, rank, world)
    if rank == 0:
        ctx.isend(torch.ones(1000), peer, 5)  # posted, never read: this process exits at once
        store.set("posted", "1")
        store_barrier(store, "dies/exiting", world, timeout_s=60)
        os._exit(0)
    store.wait(["posted"])
    store_barrier(store, "dies/exiting", world, timeout_s=60)
    import time
    time.sleep(1.0)  # the sender is gone by now
    try:
        ctx.irecv(peer, 5).wait(timeout=20)
    except shm_tensor.PeerLostError as error:
        return "lost", str(error)
    except Exception as error:  # reported, so the assertion shows what came instead
        return type(error).__name__, str(error)
    return "received", ""


@pytest.mark.timeout(120)
def test_a_sender_that_died_before_the_read_is_a_lost_peer(tmp_path):
    results = run_ranks(_sender_dies_worker, 2, tmp_path, timeout_s=100, expect_killed=(0,))
    kind, message = results[1]
    assert kind == "lost", message
    assert "shm_tensor.irecv(peer=0, tag=5)" in message


def _receiver_dies_worker(rank, world, store):
    peer = 1 - rank
    ctx = _context(store, rank, world, timeout_s=20)
    if rank == 1:
        store_barrier(store, "rdies/ready", world, timeout_s=60)
        os._exit(0)  # never receives
    store_barrier(store, "rdies/ready", world, timeout_s=60)
    handle = ctx.isend(torch.ones(1000), peer, 6)
    try:
        handle.wait(timeout=20)
    except shm_tensor.PeerLostError as error:
        return "lost", str(error)
    except Exception as error:
        return type(error).__name__, str(error)
    return "completed", ""


@pytest.mark.timeout(120)
def test_a_direct_send_to_a_receiver_that_died_is_a_lost_peer(tmp_path):
    results = run_ranks(_receiver_dies_worker, 2, tmp_path, timeout_s=100, expect_killed=(1,))
    kind, message = results[0]
    assert kind == "lost", message


def test_host_tensors_need_the_fake_runtime(tmp_path):
    """Refused with one clear line where the runtime is not the fake one (here: none loads)."""
    import subprocess
    import sys

    code = ("import torch, shm_tensor._C as C\n"
            "config = C.ContextConfig(); config.host_tensors_by_cuda_ipc = True\n"
            "C.Context(0, [1], 'dpp-test-hostcuda', config)\n")
    env = dict(os.environ, SHM_TENSOR_CUDART="/nonexistent/libcudart-bogus.so.99")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, env=env)
    assert result.returncode != 0
    assert "could not load the CUDA runtime" in result.stderr
