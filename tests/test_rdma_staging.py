"""rdma_tensor's staged sends (rdma_tensor/staging.py): a GPU tensor's send returns before its bytes
reach host memory, is posted by the context's poster thread once they are there, and keeps its
place among the sends to that peer. Two contexts in this process over loopback (UCX over TCP); the
device copy is a stand-in whose readiness the test controls, so the protocol runs on the CPU.
The real CUDA staging is the GPU test at the end."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import rdma_tensor

pytestmark = pytest.mark.skipif(bool(rdma_tensor.unavailable_reason()),
                                reason=rdma_tensor.unavailable_reason() or "available")

HERE = Path(__file__).resolve().parent
TAG = 7


class Gate:
    """A stand-in for a device copy's event: synchronize() returns once the test opens it."""

    def __init__(self, fails: BaseException | None = None) -> None:
        self.opened = threading.Event()
        self.fails = fails

    def synchronize(self) -> None:
        assert self.opened.wait(30), "the test never opened the gate"
        if self.fails is not None:
            raise self.fails


class GatedStaging:
    """Stages every tensor behind `gates` in turn (one per send); a send with no gate left is in
    host memory at once (readiness None), as a host tensor is."""

    def __init__(self, *gates: Gate) -> None:
        self.gates = list(gates)

    def to_host(self, tensor: torch.Tensor):
        if not self.gates:
            return tensor, None
        return tensor.clone(), self.gates.pop(0)


@pytest.fixture(autouse=True)
def _ucx_over_tcp(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")


def _pair(staging, timeout_s: float = 30.0):
    """Contexts of ranks 0 (sending through `staging`) and 1, connected over one store."""
    store = dist.HashStore()
    contexts, errors = {}, []

    def connect(rank):
        try:
            contexts[rank] = rdma_tensor.create_context_with_store(
                store, rank=rank, world_size=2, peers=[1 - rank], node_address="127.0.0.1",
                config=rdma_tensor.RdmaConfig(timeout_s=timeout_s), rendezvous_timeout_s=30,
                staging=staging if rank == 0 else None)
        except BaseException as error:  # re-raised below, in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=connect, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    if errors:
        raise errors[0]
    return contexts[0], contexts[1]


def _close(*contexts) -> None:
    threads = [threading.Thread(target=context.close) for context in contexts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive(), "close() did not return"


@pytest.fixture
def gated_pair():
    """(gates, sender, receiver) for `count` gated sends; gates open and contexts close after."""
    made = []

    def make(count):
        gates = [Gate() for _ in range(count)]
        made.append((gates, *_pair(GatedStaging(*gates))))
        return made[-1]

    yield make
    for gates, sender, receiver in made:
        for gate in gates:
            gate.opened.set()
        _close(sender, receiver)


def test_staged_sends_return_at_once_and_are_posted_in_order_when_ready(gated_pair):
    gates, sender, receiver = gated_pair(5)
    started = time.monotonic()
    sends = [sender.isend(torch.full((3,), float(i)), 1, TAG) for i in range(5)]
    assert time.monotonic() - started < 1.0  # nobody waited for a gate
    receives = [receiver.irecv(0, TAG) for _ in range(5)]
    time.sleep(0.2)
    assert [s.is_send and s.peer == 1 and s.tag == TAG for s in sends] == [True] * 5
    assert not any(s.test() for s in sends) and sender.test_any(sends) == -1
    assert receiver.test_any(receives) == -1  # nothing left before its copy was done
    with pytest.raises(rdma_tensor.TransportTimeout, match=r"isend\(peer=1, tag=7\).*copy from "
                                                           r"the device"):
        sends[0].wait(timeout=0.1)
    with pytest.raises(rdma_tensor.TransportTimeout, match="still waiting for their copies"):
        sender.wait_any(sends, timeout=0.1)

    # Ready out of order: the third copy completes first, yet nothing overtakes the first send.
    gates[2].opened.set()
    time.sleep(0.2)
    assert receiver.test_any(receives) == -1
    for gate in gates:
        gate.opened.set()
    assert [receive.wait(10).tolist() for receive in receives] == [[float(i)] * 3 for i in range(5)]
    assert sender.wait_any(sends, timeout=10) in range(5)
    assert [send.wait(10) for send in sends] == [None] * 5


def test_a_host_send_queues_behind_a_staged_one(gated_pair):
    gates, sender, receiver = gated_pair(1)  # the second send is in host memory at once
    first = sender.isend(torch.tensor([1.0]), 1, TAG)
    second = sender.isend(torch.tensor([2.0]), 1, TAG)
    early = receiver.irecv(0, TAG)
    time.sleep(0.2)
    assert not early.test() and not second.test()
    gates[0].opened.set()
    assert early.wait(10).tolist() == [1.0]
    assert receiver.irecv(0, TAG).wait(10).tolist() == [2.0]
    assert first.wait(10) is None and second.wait(10) is None


def test_a_failed_copy_is_raised_by_its_send_and_the_next_ones_go_on():
    failing, fine = Gate(RuntimeError("CUDA error: an illegal memory access")), Gate()
    sender, receiver = _pair(GatedStaging(failing, fine))
    try:
        lost = sender.isend(torch.tensor([1.0]), 1, TAG)
        kept = sender.isend(torch.tensor([2.0]), 1, TAG)
        failing.opened.set()
        fine.opened.set()
        with pytest.raises(RuntimeError, match="illegal memory access"):
            lost.wait(10)
        with pytest.raises(RuntimeError, match="illegal memory access"):
            sender.test_any([lost, kept])
        assert receiver.irecv(0, TAG).wait(10).tolist() == [2.0]
        assert kept.wait(10) is None
    finally:
        for gate in (failing, fine):
            gate.opened.set()
        _close(sender, receiver)


def test_close_posts_the_sends_still_queued_first():
    gate = Gate()
    sender, receiver = _pair(GatedStaging(gate))
    try:
        send = sender.isend(torch.arange(4.0), 1, TAG)
        closing = threading.Thread(target=sender.close)
        closing.start()
        closing.join(0.3)
        assert closing.is_alive()  # the queued send keeps close() from closing the link
        gate.opened.set()
        closing.join(30)
        assert not closing.is_alive()
        assert send._posted() is not None  # posted, not dropped
        with pytest.raises(RuntimeError, match="closed"):
            sender.isend(torch.arange(4.0), 1, TAG)
    finally:
        gate.opened.set()
        receiver.close()


def _gpu_sends_check() -> None:
    """Both contexts on GPU 0: bf16, non-contiguous and 16 MiB tensors go over UCX through
    page-locked memory, with no host-device synchronization on the sender's side (run in a
    subprocess that sees the GPU, by the test below)."""
    sender, receiver = _pair(None)
    receiver.device = torch.device("cuda", 0)  # received tensors move to the device in wait()
    try:
        tensors = [torch.randn(64, 32, device="cuda").to(torch.bfloat16),
                   torch.randn(32, 64, device="cuda").t(),
                   torch.randn(4 << 20, device="cuda")]
        doubled = [tensor * 2 for tensor in tensors]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            sends = [sender.isend(tensor, 1, TAG) for tensor in doubled]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        received = [receiver.irecv(0, TAG).wait(30) for _ in tensors]
        for send in sends:
            assert send.wait(30) is None
        for tensor, got in zip(tensors, received):
            assert got.device.type == "cuda" and torch.equal(got, tensor * 2)
    finally:
        _close(sender, receiver)


@pytest.mark.gpu
def test_gpu_sends_are_staged_without_synchronizing_the_host():
    from _gpu import gpu_env

    env = gpu_env(dict(os.environ, UCX_TLS="tcp", OMP_NUM_THREADS="1",
                       PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent)])))
    done = subprocess.run([sys.executable, "-c", "import test_rdma_staging as t; t._gpu_sends_check()"],
                          env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
