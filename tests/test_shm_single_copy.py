"""shm_tensor's single-copy path (the receiver pulls large CPU payloads from the sender's memory with
process_vm_readv) between real processes: values around the threshold and up to 64 MiB in several
dtypes, the probe's decision and its fallbacks, the source storage a send holds, bad descriptors,
and what a killed or closing peer does to an unpulled message."""
from __future__ import annotations

import os
import platform
import random
import signal
import struct
import time

import pytest
import torch

import shm_tensor
from shm_tensor import ShmConfig
from _shm_util import block_process_vm_readv, payload, run_ranks, wait_until_dead

KiB, MiB = 1 << 10, 1 << 20
THRESHOLD = 256 * KiB
SINGLE_COPY_MAGIC = 0x59504F43454C4753  # csrc/shm_tensor/single_copy.h


def _context(rank, world, store, peer, prefix="shm_tensor", **config):
    config.setdefault("timeout_s", 60)
    # Below the default (16 MiB, tuned for bandwidth) so that small test messages take the path.
    config.setdefault("single_copy_min_bytes", THRESHOLD)
    # A slot the receiver lends is preferred over single copy; these tests are about single copy.
    config.setdefault("zero_copy_receive", False)
    return shm_tensor.create_context_with_store(
        store, rank=rank, world_size=world, peers=[peer], config=ShmConfig(**config), prefix=prefix)


def _wait_key(store, key: str) -> None:
    from datetime import timedelta

    store.wait([key], timedelta(seconds=60))


# ---------------------------------------------------------------------------------------------
# Values: sizes around the threshold and up to 64 MiB, several dtypes, both directions at once.

# (dtype, shape): payloads of THRESHOLD - 4 B up to 64 MiB, some not a multiple of a page.
CASES = [
    (torch.float32, (THRESHOLD // 4 - 1,)),          # 4 B below: two copies
    (torch.uint8, (THRESHOLD - 1,)),                 # 1 B below: two copies
    (torch.uint8, (THRESHOLD,)),                     # exactly the threshold
    (torch.bfloat16, (THRESHOLD // 2 + 1,)),
    (torch.float64, (3, THRESHOLD // 8 + 5)),
    (torch.int64, (MiB // 8 + 3,)),
    (torch.float16, (1536, 1025)),                   # 3 MiB + 3 KiB: pulled by two threads
    (torch.complex64, (MiB // 8 * 5 + 1,)),
    (torch.bool, (5 * MiB + 7,)),
    (torch.int32, (4 * MiB + 1,)),                   # 16 MiB + 4 B
    (torch.float32, (64 * MiB // 4,)),               # 64 MiB: the slot size
]


def _nbytes(dtype, shape) -> int:
    return torch.empty(shape, dtype=dtype).nbytes


LARGE = sum(_nbytes(*case) >= THRESHOLD for case in CASES)


def _values_worker(rank, world, store):
    peer = 1 - rank
    ctx = _context(rank, world, store, peer, slot_bytes=64 * MiB, copy_threads=2,
                   bytes_per_thread=MiB, single_copy_min_bytes=THRESHOLD)
    sends = [ctx.isend(payload(rank, tag, dtype, shape), peer, tag)
             for tag, (dtype, shape) in enumerate(CASES)]
    order = list(range(len(CASES)))
    random.Random(rank).shuffle(order)
    receives = {ctx.irecv(peer, tag): tag for tag in order}
    pending = list(receives) + sends
    while pending:
        done = pending.pop(ctx.wait_any(pending, timeout=60))
        if done.is_send:
            assert done.wait(timeout=0) is None
            continue
        tag = receives[done]
        got, expected = done.wait(timeout=0), payload(peer, tag, *CASES[tag])
        assert got.dtype == expected.dtype and got.shape == expected.shape, (tag, got.dtype, got.shape)
        assert torch.equal(got, expected), f"payload of tag {tag} differs"
    report = {"peers": ctx.single_copy_peers(), "fallbacks": ctx.single_copy_fallbacks(),
              "counts": ctx.message_counts()}
    ctx.close()
    return report


@pytest.mark.timeout(180)
def test_single_copy_values_around_threshold_and_dtypes(tmp_path):
    reports = run_ranks(_values_worker, 2, tmp_path, timeout_s=150)
    for rank, report in reports.items():
        assert report["peers"] == (1 - rank,) and report["fallbacks"] == {}, report
        assert report["counts"] == {"sent_single_copy": LARGE, "sent_two_copy": len(CASES) - LARGE,
                                    "received_single_copy": LARGE,
                                    "received_two_copy": len(CASES) - LARGE,
                                    "received_zero_copy": 0, "sent_device_direct": 0,
                                    "sent_device_staged": 0, "received_device_direct": 0,
                                    "received_device_staged": 0}, report


# ---------------------------------------------------------------------------------------------
# Who decides: the receiver's probe and both sides' ShmConfig.single_copy.

def _mixed_config_worker(rank, world, store):
    peer = 1 - rank
    ctx = _context(rank, world, store, peer, slot_bytes=4 * MiB, single_copy=rank == 0)
    ctx.isend(payload(rank, 1, torch.float32, (MiB // 4,)), peer, 1).wait(timeout=60)
    assert torch.equal(ctx.irecv(peer, 1).wait(timeout=60), payload(peer, 1, torch.float32, (MiB // 4,)))
    report = {"peers": ctx.single_copy_peers(), "fallbacks": ctx.single_copy_fallbacks(),
              "counts": ctx.message_counts()}
    # A single-copy message to a receiver that refused single copy breaks the channel.
    if rank == 0:
        header = shm_tensor.encode_header(torch.zeros(MiB // 4), 2, 0, shm_tensor.FLAG_SINGLE_COPY)
        source = torch.zeros(MiB // 4)
        descriptor = struct.pack("<QQQiI", SINGLE_COPY_MAGIC, source.data_ptr(), MiB, os.getpid(), 0)
        ctx._send_raw_header(header, peer, descriptor).wait(timeout=10)
        _wait_key(store, "mixed/checked")
    else:
        with pytest.raises(shm_tensor.ProtocolError, match=r"peer=0, tag=2\b.*refused single copy"):
            ctx.irecv(peer, 2).wait(timeout=10)
        store.set("mixed/checked", "1")
    ctx.close()
    return report


@pytest.mark.timeout(180)
def test_single_copy_needs_both_sides_and_refusal_is_enforced(tmp_path):
    reports = run_ranks(_mixed_config_worker, 2, tmp_path, timeout_s=150)
    # Rank 0 may pull from rank 1, but rank 1 (single_copy=False) never sends that way, and it
    # refused to pull, so rank 0 sends in two copies too.
    assert reports[0]["peers"] == (1,), reports
    assert reports[1]["peers"] == () and "single_copy=False" in reports[1]["fallbacks"][0], reports
    for report in reports.values():
        assert report["counts"]["sent_single_copy"] == 0, report
        assert report["counts"]["received_two_copy"] == 1, report


def _blocked_probe_worker(rank, world, store):
    peer = 1 - rank
    if rank == 1:
        block_process_vm_readv()  # as a seccomp profile would: rank 1 cannot pull, rank 0 can
    ctx = _context(rank, world, store, peer, slot_bytes=4 * MiB)
    sends = [ctx.isend(payload(rank, tag, torch.bfloat16, (MiB,)), peer, tag) for tag in (1, 2)]
    for tag in (2, 1):
        got = ctx.irecv(peer, tag).wait(timeout=60)
        assert torch.equal(got, payload(peer, tag, torch.bfloat16, (MiB,))), tag
    for handle in sends:
        handle.wait(timeout=60)
    report = {"peers": ctx.single_copy_peers(), "fallbacks": ctx.single_copy_fallbacks(),
              "counts": ctx.message_counts()}
    ctx.close()
    return report


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the seccomp filter is for x86_64")
@pytest.mark.timeout(180)
def test_probe_failure_falls_back_to_two_copies(tmp_path):
    reports = run_ranks(_blocked_probe_worker, 2, tmp_path, timeout_s=150)
    assert reports[0]["peers"] == (1,), reports
    assert reports[1]["peers"] == (), reports
    reason = reports[1]["fallbacks"][0]
    assert "process_vm_readv" in reason and "errno 38" in reason, reason  # ENOSYS
    assert reports[0]["counts"]["received_single_copy"] == 2, reports
    assert reports[1]["counts"]["received_two_copy"] == 2, reports
    assert reports[1]["counts"]["received_single_copy"] == 0, reports


# ---------------------------------------------------------------------------------------------
# The send holds its own alias of the source storage until the receiver pulled it.

def _data_replaced_worker(rank, world, store):
    peer = 1 - rank
    # One slot: the second (two-copy) message waits in the queue while the first is unread.
    ctx = _context(rank, world, store, peer, num_slots=1, slot_bytes=8 * MiB)
    shapes = {1: (2 * MiB,), 2: (16 * KiB,)}  # 8 MiB in one copy, 64 KiB in two
    report = {}
    if rank == 0:
        handles = []
        for tag, shape in shapes.items():
            tensor = payload(rank, tag, torch.float32, shape)
            handles.append(ctx.isend(tensor, peer, tag))
            tensor.data = torch.empty(1)  # what Megatron's deallocate_output_tensor does
            del tensor
        # Freed memory would be reused by allocations like these.
        clobber = [torch.full(shape, -1.0) for shape in shapes.values()]
        report["done_before_pull"] = [handle.test() for handle in handles]
        store.set("replaced/sent", "1")
        for handle in handles:
            handle.wait(timeout=60)
        report["counts"] = ctx.message_counts()
        del clobber
    else:
        _wait_key(store, "replaced/sent")
        time.sleep(0.3)
        for tag, shape in shapes.items():
            got = ctx.irecv(peer, tag).wait(timeout=60)
            assert torch.equal(got, payload(peer, tag, torch.float32, shape)), f"tag {tag} changed"
    ctx.close()
    return report


@pytest.mark.timeout(180)
def test_source_data_replaced_right_after_isend(tmp_path):
    report = run_ranks(_data_replaced_worker, 2, tmp_path, timeout_s=150)[0]
    assert report["done_before_pull"] == [False, False], report  # complete only once pulled
    assert report["counts"]["sent_single_copy"] == 1 and report["counts"]["sent_two_copy"] == 1


# ---------------------------------------------------------------------------------------------
# Killed peers: nothing hangs, nothing returns garbage.

def _killed_sender_worker(rank, world, store):
    peer = 1 - rank
    ctx = _context(rank, world, store, peer, slot_bytes=8 * MiB)
    if rank == 1:
        ctx.isend(payload(rank, 5, torch.float32, (MiB,)), peer, 5)  # in the slot, unread
        store.set("killed_sender/pid", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    _wait_key(store, "killed_sender/pid")
    wait_until_dead(int(store.get("killed_sender/pid")), timeout_s=30)
    started = time.monotonic()
    with pytest.raises(shm_tensor.PeerLostError,
                       match=r"peer=1, tag=5\): peer process \(pid \d+\) exited before its single-copy"):
        ctx.irecv(peer, 5).wait(timeout=30)
    report = {"detect_s": time.monotonic() - started}
    with pytest.raises(shm_tensor.PeerLostError, match=r"peer=1, tag=6\b"):
        ctx.irecv(peer, 6).wait(timeout=30)
    report["counts"] = ctx.message_counts()
    ctx.close()
    return report


@pytest.mark.timeout(120)
def test_sender_killed_before_its_message_was_pulled(tmp_path):
    report = run_ranks(_killed_sender_worker, 2, tmp_path, timeout_s=100, expect_killed=(1,))[0]
    assert report["detect_s"] < 5, report
    assert report["counts"]["received_single_copy"] == 0, report


def _killed_receiver_worker(rank, world, store):
    peer = 1 - rank
    ctx = _context(rank, world, store, peer, slot_bytes=8 * MiB)
    if rank == 1:
        _wait_key(store, "killed_receiver/sent")
        os.kill(os.getpid(), signal.SIGKILL)  # without ever pulling
    handle = ctx.isend(payload(rank, 9, torch.float32, (MiB,)), peer, 9)
    report = {"done_at_isend": handle.test()}
    store.set("killed_receiver/sent", "1")
    started = time.monotonic()
    with pytest.raises(shm_tensor.PeerLostError,
                       match=r"peer=1, tag=9\): peer process .* exited before the message was pulled"):
        handle.wait(timeout=30)
    report["detect_s"] = time.monotonic() - started
    ctx.close()
    return report


@pytest.mark.timeout(120)
def test_receiver_killed_while_a_single_copy_send_waits(tmp_path):
    report = run_ranks(_killed_receiver_worker, 2, tmp_path, timeout_s=100, expect_killed=(1,))[0]
    assert report["done_at_isend"] is False, report
    assert report["detect_s"] < 5, report


# ---------------------------------------------------------------------------------------------
# close() with messages still unpulled: errors that say so, at once.

def _closing_worker(rank, world, store):
    peer = 1 - rank
    shape = (MiB,)
    # The sender closes before its message was pulled: the receiver must not deliver it.
    sender_closes = _context(rank, world, store, peer, prefix="sender_closes", slot_bytes=8 * MiB)
    # The receiver closes without taking a message: the waiting send fails, it does not time out.
    receiver_closes = _context(rank, world, store, peer, prefix="receiver_closes", slot_bytes=8 * MiB)
    report = {}
    if rank == 0:
        handle = sender_closes.isend(payload(rank, 3, torch.float32, shape), peer, 3)
        sender_closes.close()
        del handle
        receiver_closes.close()
        store.set("closing/closed", "1")
        _wait_key(store, "closing/checked")  # alive: an exited sender would be a lost peer instead
    else:
        send = receiver_closes.isend(payload(rank, 4, torch.float32, shape), peer, 4)
        _wait_key(store, "closing/closed")
        started = time.monotonic()
        with pytest.raises(shm_tensor.TransportError,
                           match=r"peer=0, tag=3\): peer 0 closed its shm_tensor context before its "
                                 r"single-copy message"):
            sender_closes.irecv(peer, 3).wait(timeout=30)
        with pytest.raises(shm_tensor.TransportError,
                           match=r"peer=0, tag=4\): peer 0 closed its shm_tensor context before "
                                 r"taking the message"):
            send.wait(timeout=30)
        report["detect_s"] = time.monotonic() - started
        store.set("closing/checked", "1")
        sender_closes.close()
        receiver_closes.close()
    return report


@pytest.mark.timeout(120)
def test_close_with_unpulled_messages_fails_fast(tmp_path):
    report = run_ranks(_closing_worker, 2, tmp_path, timeout_s=100)[1]
    assert report["detect_s"] < 5, report


# ---------------------------------------------------------------------------------------------
# Descriptors the receiver must refuse, and a pull that fails.

def _bad_descriptor_worker(rank, world, store):
    peer = 1 - rank
    nbytes = 4096
    contexts = {name: _context(rank, world, store, peer, prefix=f"bad/{name}", slot_bytes=MiB)
                for name in ("unmapped", "bad_magic")}
    if rank == 0:
        header = shm_tensor.encode_header(torch.zeros(nbytes // 4), 11, 0, shm_tensor.FLAG_SINGLE_COPY)
        descriptors = {
            # our pid, an address we do not map: the receiver's process_vm_readv fails (EFAULT)
            "unmapped": struct.pack("<QQQiI", SINGLE_COPY_MAGIC, 0x10, nbytes, os.getpid(), 0),
            "bad_magic": struct.pack("<QQQiI", 0x1234, 0x10, nbytes, os.getpid(), 0),
        }
        for name, descriptor in descriptors.items():
            contexts[name]._send_raw_header(header, peer, descriptor).wait(timeout=10)
        _wait_key(store, "bad/checked")  # alive until the receiver has tried to pull
    else:
        with pytest.raises(shm_tensor.TransportError,
                           match=r"peer=0, tag=11\): pulling single-copy message from peer 0 \(header "
                                 r"tag 11\) failed: process_vm_readv\(pid \d+, 4096 B at 0x10\) "
                                 r"failed: Bad address \(errno 14\)") as caught:
            contexts["unmapped"].irecv(peer, 11).wait(timeout=10)
        assert not isinstance(caught.value, (shm_tensor.PeerLostError, shm_tensor.ProtocolError))
        with pytest.raises(shm_tensor.ProtocolError, match=r"peer=0, tag=11\).*bad descriptor"):
            contexts["bad_magic"].irecv(peer, 11).wait(timeout=10)
        store.set("bad/checked", "1")
    for ctx in contexts.values():
        ctx.close()


@pytest.mark.timeout(120)
def test_bad_descriptor_and_failed_pull_are_named(tmp_path):
    run_ranks(_bad_descriptor_worker, 2, tmp_path, timeout_s=100)


def test_single_copy_flag_in_the_header():
    tensor = torch.zeros(8)
    header = shm_tensor.encode_header(tensor, 7, 0, shm_tensor.FLAG_SINGLE_COPY)
    assert shm_tensor.header_flags(header, peer=0) == shm_tensor.FLAG_SINGLE_COPY
    both = shm_tensor.encode_header(tensor, 7, 0, shm_tensor.FLAG_SINGLE_COPY | shm_tensor.FLAG_CUDA_IPC)
    with pytest.raises(shm_tensor.ProtocolError, match="exclude each other"):
        shm_tensor.header_flags(both, peer=0)
    unknown = shm_tensor.encode_header(tensor, 7, 0, shm_tensor.FLAG_SINGLE_COPY << 1)
    with pytest.raises(shm_tensor.ProtocolError, match="unknown header flags"):
        shm_tensor.header_flags(unknown, peer=0)
    # The flag is covered by the checksum.
    corrupted = bytearray(header)
    corrupted[100] ^= shm_tensor.FLAG_SINGLE_COPY  # WireHeader.flags
    with pytest.raises(shm_tensor.ProtocolError, match="checksum"):
        shm_tensor.header_flags(bytes(corrupted), peer=0)


def test_config_rejects_a_tiny_threshold():
    with pytest.raises(ValueError, match="single_copy_min_bytes"):
        ShmConfig(single_copy_min_bytes=100).validate()
