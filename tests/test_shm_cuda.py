"""shm_tensor's CUDA IPC path. On any machine: the libcudart loader's errors, the wire header's
device flag, and a receiver's rejection of a device message it cannot take. On a machine with a
GPU (marked `gpu`, skipped otherwise; their processes see the GPUs through _gpu.gpu_env()): GPU
tensors between two real processes, several dtypes and sizes, out-of-order tags, slot reuse under
back-pressure, non-default streams, mixed with CPU tensors."""
from __future__ import annotations

import os
import random
import struct
import subprocess
import sys

import pytest
import torch

import shm_tensor
from shm_tensor import ShmConfig
from shm_tensor.context import store_barrier
from _gpu import gpu_env
from _shm_util import payload, run_ranks

MiB = 1 << 20
FLAGS_OFFSET = 100  # of WireHeader.flags: after magic..src_rank (csrc/common/wire_header.h)
CHECKSUM_OFFSET = 120


def _fnv1a(data: bytes) -> int:
    value = 1469598103934665603
    for byte in data:
        value = ((value ^ byte) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return value


def _with_flags(header: bytes, flags: int, fix_checksum: bool) -> bytes:
    raw = bytearray(header)
    struct.pack_into("<I", raw, FLAGS_OFFSET, flags)
    if fix_checksum:
        struct.pack_into("<Q", raw, CHECKSUM_OFFSET, _fnv1a(bytes(raw[:CHECKSUM_OFFSET])))
    return bytes(raw)


def _python(code: str, gpu: bool = False, **env: str) -> subprocess.CompletedProcess:
    """Runs `code` pinned to the CPU as the suite is (conftest.py), or with the GPUs (gpu=True)."""
    base = gpu_env() if gpu else dict(os.environ)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**base, "OMP_NUM_THREADS": "1", **env})


# ---------------------------------------------------------------------------------------------
# Loader

@pytest.mark.timeout(90)
def test_loader_names_every_failed_attempt_when_libcudart_is_absent():
    code = ("import torch, shm_tensor, shm_tensor._C as C\n"
            "print(repr(shm_tensor.cuda_runtime_error())); print(repr(C.cuda_runtime_library()))\n")
    result = _python(code, SHM_TENSOR_CUDART="/nonexistent/libcudart-bogus.so.99")
    assert result.returncode == 0, result.stderr
    error, library = result.stdout.splitlines()
    assert "could not load the CUDA runtime" in error
    assert "dlopen(/nonexistent/libcudart-bogus.so.99)" in error
    assert library == "''"


@pytest.mark.timeout(90)
def test_loader_rejects_a_library_without_the_cuda_symbols():
    result = _python("import shm_tensor; print(shm_tensor.cuda_runtime_error())",
                     SHM_TENSOR_CUDART="libm.so.6")
    assert result.returncode == 0, result.stderr
    assert "libm.so.6: missing symbols cudaGetDevice" in result.stdout


@pytest.mark.gpu
@pytest.mark.timeout(90)
def test_cuda_send_without_runtime_is_a_clear_value_error():
    code = ("import torch, shm_tensor._C as C\n"
            "ctx = C.Context(0, [1], 'dpp-test-nocudart', C.ContextConfig())\n"
            "try:\n"
            "    ctx.isend(torch.ones(4, device='cuda'), 1, 7)\n"
            "except ValueError as error:\n"
            "    print('ValueError:', error)\n"
            "ctx.close()\n")
    result = _python(code, gpu=True, SHM_TENSOR_CUDART="/nonexistent/libcudart-bogus.so.99")
    assert result.returncode == 0, result.stderr
    assert "shm_tensor.isend(peer=1, tag=7)" in result.stdout
    assert "--p2p-transport torch" in result.stdout


# ---------------------------------------------------------------------------------------------
# Wire header device flag

def test_header_device_flag_round_trips():
    tensor = torch.zeros(2, 3, dtype=torch.bfloat16)
    plain = shm_tensor.encode_header(tensor, 5, 1)
    device = shm_tensor.encode_header(tensor, 5, 1, shm_tensor.FLAG_CUDA_IPC)
    assert shm_tensor.header_flags(plain, 1) == 0
    assert shm_tensor.header_flags(device, 1) == shm_tensor.FLAG_CUDA_IPC
    tag, src, like = shm_tensor.decode_header(device, 1 << 20, 1)
    assert (tag, src, tuple(like.shape), like.dtype) == (5, 1, (2, 3), torch.bfloat16)
    # The flag is covered by the checksum, and unknown flags are refused.
    assert _with_flags(plain, shm_tensor.FLAG_CUDA_IPC, fix_checksum=True) == device
    with pytest.raises(shm_tensor.ProtocolError, match="checksum"):
        shm_tensor.header_flags(_with_flags(plain, shm_tensor.FLAG_CUDA_IPC, False), 1)
    with pytest.raises(shm_tensor.ProtocolError, match="unknown header flags 0x4"):
        shm_tensor.decode_header(_with_flags(plain, 4, True), 1 << 20, 1)


# ---------------------------------------------------------------------------------------------
# A device message the receiver cannot take breaks that peer's channel with a named reason.

def _bogus_device_message_worker(rank, world, store, cudart):
    if cudart:
        os.environ["SHM_TENSOR_CUDART"] = cudart  # read at the first (lazy) load
    peer = 1 - rank
    ctx = shm_tensor.create_context_with_store(store, rank=rank, world_size=world, peers=[peer],
                                               config=ShmConfig(slot_bytes=MiB, timeout_s=30))
    try:
        if rank == 0:
            header = shm_tensor.encode_header(torch.zeros(4), 3, 0, shm_tensor.FLAG_CUDA_IPC)
            ctx._send_raw_header(header, peer).wait(timeout=10)  # no descriptor follows
            return None
        try:
            ctx.irecv(peer, 3).wait(timeout=10)
        except shm_tensor.ProtocolError as error:
            return str(error), shm_tensor.cuda_runtime_error()
        return "no error", ""
    finally:
        store_barrier(store, "bogus/done", world, timeout_s=60)
        ctx.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cudart", ["", "/nonexistent/libcudart-bogus.so.99"])
def test_receiver_rejects_a_device_message_it_cannot_take(tmp_path, cudart):
    results = run_ranks(_bogus_device_message_worker, 2, tmp_path, cudart, timeout_s=90)
    error, runtime_problem = results[1]
    assert "shm_tensor.irecv(peer=0, tag=3)" in error
    if runtime_problem:
        assert "could not load the CUDA runtime" in error
    else:
        assert "invalid CUDA IPC descriptor" in error


# ---------------------------------------------------------------------------------------------
# Real CUDA IPC between two processes (GPU machines only)

GPU_CASES = [
    (torch.float32, (3, 5)),
    (torch.bfloat16, (7, 2, 3)),
    (torch.float16, (11,)),
    (torch.int64, (4, 4)),
    (torch.bool, (9,)),
    (torch.uint8, (1,)),
    (torch.float64, ()),
    (torch.float32, (0,)),
    (torch.float32, (MiB // 4 + 3,)),
    (torch.bfloat16, (8 * MiB // 2,)),
]
CPU_TAG, OVERWRITTEN_TAG, TRANSPOSED_TAG = 500, 501, 502


def _gpu_exchange_worker(rank, world, store):
    device = rank % torch.cuda.device_count()  # two GPUs when there are, one shared otherwise
    torch.cuda.set_device(device)
    peer = 1 - rank
    # Two slots for a dozen messages each way: slots (and their events) are reused many times.
    ctx = shm_tensor.create_context_with_store(
        store, rank=rank, world_size=world, peers=[peer],
        config=ShmConfig(num_slots=2, slot_bytes=16 * MiB, timeout_s=60))
    side_stream = torch.cuda.Stream()
    sends = []
    with torch.cuda.stream(side_stream):  # produced and sent on a non-default stream
        for tag, (dtype, shape) in enumerate(GPU_CASES):
            sends.append(ctx.isend(payload(rank, tag, dtype, shape).cuda(), peer, tag))
    sends.append(ctx.isend(payload(rank, CPU_TAG, torch.float32, (6,)), peer, CPU_TAG))
    base = payload(rank, TRANSPOSED_TAG, torch.float32, (4, 6)).cuda()
    sends.append(ctx.isend(base.t(), peer, TRANSPOSED_TAG))
    overwritten = payload(rank, OVERWRITTEN_TAG, torch.float32, (1 << 20,)).cuda()
    handle = ctx.isend(overwritten, peer, OVERWRITTEN_TAG)
    sends.append(handle)

    tags = list(range(len(GPU_CASES))) + [CPU_TAG, TRANSPOSED_TAG, OVERWRITTEN_TAG]
    random.Random(rank).shuffle(tags)
    receives = {ctx.irecv(peer, tag): tag for tag in tags}
    received = {}
    pending = list(receives) + sends
    while pending:
        done = pending.pop(ctx.wait_any(pending, timeout=60))
        if done is handle:
            overwritten.fill_(-1.0)  # after completion the sender may overwrite its tensor
        if not done.is_send:
            received[receives[done]] = done.wait(timeout=0)

    problems = []
    for tag, (dtype, shape) in enumerate(GPU_CASES):
        got = received[tag]
        if got.device != torch.device("cuda", device) or got.dtype != dtype:
            problems.append(f"tag {tag}: {got.device} {got.dtype}")
        elif not torch.equal(got.cpu(), payload(peer, tag, dtype, shape)):
            problems.append(f"tag {tag}: wrong values")
    if received[CPU_TAG].device.type != "cpu" or not torch.equal(
            received[CPU_TAG], payload(peer, CPU_TAG, torch.float32, (6,))):
        problems.append("CPU message")
    if not torch.equal(received[TRANSPOSED_TAG].cpu(),
                       payload(peer, TRANSPOSED_TAG, torch.float32, (4, 6)).t()):
        problems.append("transposed message")
    if not torch.equal(received[OVERWRITTEN_TAG].cpu(),
                       payload(peer, OVERWRITTEN_TAG, torch.float32, (1 << 20,))):
        problems.append("overwritten-after-send message")
    store_barrier(store, "gpu/done", world, timeout_s=60)  # the peer's pool outlives its reads
    ctx.close()
    return problems


@pytest.mark.gpu
@pytest.mark.timeout(240)
def test_gpu_tensors_by_cuda_ipc_between_two_processes(tmp_path):
    results = run_ranks(_gpu_exchange_worker, 2, tmp_path, timeout_s=200, env=gpu_env())
    assert results == {0: [], 1: []}
