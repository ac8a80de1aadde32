"""The Transport protocol over torch.distributed (gloo) and through the router (shm_tensor on one
node), between real processes: tag matching in any order, dtypes and shapes from the header,
wait_any and test_any, and the flag validation of --p2p-transport."""
from __future__ import annotations

import argparse
import random

import pytest
import torch
import torch.distributed as dist

from megatron_dpp import arguments
from megatron_dpp.comm import TorchTransport, Transport, make_transport
from _shm_util import run_ranks

CASES = [
    (torch.float32, (3, 5)),
    (torch.bfloat16, (2, 3, 4)),
    (torch.float16, (0,)),
    (torch.int64, ()),
    (torch.bool, (6,)),
    (torch.float32, (300_000,)),
]


def _payload(sender: int, tag: int) -> torch.Tensor:
    dtype, shape = CASES[tag]
    generator = torch.Generator().manual_seed(sender * 1000 + tag)
    return (torch.randn(shape, generator=generator) * 10).to(dtype)


def _transport_worker(rank, world, store, kind):
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        peer = 1 - rank
        transport = (TorchTransport([peer], timeout_s=60) if kind == "torch"
                     else make_transport("shm", [peer], timeout_s=60))
        assert isinstance(transport, Transport)
        sends = [transport.isend(_payload(rank, tag), peer, tag) for tag in range(len(CASES))]
        sends.append(transport.isend(torch.arange(12.0).view(3, 4).t(), peer, 99))  # non-contiguous
        order = list(range(len(CASES)))
        random.Random(rank + 7).shuffle(order)
        receives = {transport.irecv(peer, tag): tag for tag in order}
        receives[transport.irecv(peer, 99)] = 99
        pending = [*receives, *sends]
        never_sent = transport.irecv(peer, 12345)
        finished = []
        while pending:
            # test_any first (never waits: -1 while nothing is complete), then wait_any.
            index = transport.test_any(pending)
            assert index == -1 or pending[index].test(), index
            assert transport.test_any([never_sent]) == -1
            if index < 0:
                index = transport.wait_any(pending, timeout=60)
            handle = pending.pop(index)
            finished.append(handle)
            if handle.is_send:
                continue
            got, tag = handle.wait(timeout=0), receives[handle]
            expected = (torch.arange(12.0).view(3, 4).t().contiguous() if tag == 99
                        else _payload(peer, tag))
            assert got.dtype == expected.dtype and got.shape == expected.shape, tag
            assert torch.equal(got, expected), tag
        # A finished handle is found without waiting, beside one that never finishes (how soon
        # each finished depends on the load; that test_any finds a finished one does not).
        assert transport.test_any([never_sent, finished[0]]) == 1
        assert transport.test_any([never_sent, *finished]) == 1
        with pytest.raises(ValueError, match="test_any: no handles given"):
            transport.test_any([])
        with pytest.raises(TimeoutError, match=f"peer={peer}, tag=12345"):
            never_sent.wait(timeout=0.3)
        dist.barrier()  # a peer that closed first would turn the timeout into "peer closed"
        transport.close()
    finally:
        dist.destroy_process_group()
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["torch", "shm"])
def test_transport_any_order(kind, tmp_path):
    assert run_ranks(_transport_worker, 2, tmp_path, kind, timeout_s=100) == {0: True, 1: True}


def _validate(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    arguments.add_transport_args(parser)
    args = parser.parse_args(list(flags))
    args.seq_length, args.micro_batch_size, args.hidden_size = 4096, 4, 8192
    arguments.validate_transport_args(args)
    return args


def test_transport_flags():
    # auto (the default) validates the shm values but does not need one activation to fit a slot:
    # it routes same-node peers to torch.distributed then, and logs why.
    assert _validate().p2p_transport == "auto"
    assert _validate("--shm-slot-mb", "64").p2p_transport == "auto"
    with pytest.raises(arguments.ArgsError, match="--shm-num-slots"):
        _validate("--shm-num-slots", "65")
    with pytest.raises(arguments.ArgsError, match="raise --shm-slot-mb to 512"):
        _validate("--p2p-transport", "shm", "--shm-slot-mb", "64")
    with pytest.raises(arguments.ArgsError, match="--workload"):
        _validate("--p2p-transport", "shm", "--shm-slot-mb", "512", "--workload", "10")
    args = _validate("--p2p-transport", "shm", "--shm-slot-mb", "512", "--workload", "1048576")
    from megatron_dpp.comm import shm_config_from_args
    config = shm_config_from_args(args)
    assert config.slot_bytes == 512 << 20 and config.bytes_per_thread == 1 << 20


def _setup(nodes, **overrides):
    from megatron_dpp.comm.router import NodeIdentity, RouteSetup

    fields = dict(rank=0, world_size=len(nodes), nodes=[NodeIdentity(n, f"10.0.0.{n[-1]}") for n in nodes],
                  store=None, prefix="test", device=torch.device("cpu"), timeout_s=10.0)
    fields.update(overrides)
    return RouteSetup(**fields)


def test_auto_routes_same_node_to_shm_other_node_to_rdma():
    from megatron_dpp.comm.router import ROUTE_TABLES, assign_routes

    assignment = assign_routes(ROUTE_TABLES["auto"], _setup(["node 0", "node 0", "node 1"]), [1, 2])
    assert assignment[1].route.transport == "shm_tensor" and assignment[1].reason() == "same node"
    assert assignment[2].route.transport == "rdma_tensor" and assignment[2].reason() == "other node"


def test_auto_falls_back_to_torch_and_says_why():
    from megatron_dpp.comm.router import ROUTE_TABLES, assign_routes

    setup = _setup(["node 0", "node 0"], max_message_bytes=1 << 40)
    chosen = assign_routes(ROUTE_TABLES["auto"], setup, [1])[1]
    assert chosen.route.transport == "torch.distributed"
    assert "shm_tensor not used: one activation (1099511627776 B) exceeds a shm slot" in chosen.reason()


def test_device_activations_larger_than_a_slot_stay_on_shm_unless_unexportable(monkeypatch):
    """GPU messages go by CUDA IPC's direct path, without the slot cap; only memory CUDA IPC cannot
    export (torch's expandable segments) keeps the cap, and the reason says so."""
    import shm_tensor
    from megatron_dpp.comm.router import ROUTE_TABLES, assign_routes

    monkeypatch.setattr(shm_tensor, "cuda_runtime_error", lambda: "")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    setup = _setup(["node 0", "node 0"], max_message_bytes=1 << 40, device=torch.device("cuda", 0))
    assert assign_routes(ROUTE_TABLES["auto"], setup, [1])[1].route.transport == "shm_tensor"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    chosen = assign_routes(ROUTE_TABLES["auto"], setup, [1])[1]
    assert chosen.route.transport == "torch.distributed"
    assert "expandable segments cannot be exported by CUDA IPC" in chosen.reason()


def test_rdma_unavailable_is_a_reason_not_a_crash(monkeypatch):
    import rdma_tensor
    from megatron_dpp.comm.router import ROUTE_TABLES, assign_routes

    monkeypatch.setattr(rdma_tensor, "unavailable_reason", lambda: "rdma_tensor._C is not built")
    chosen = assign_routes(ROUTE_TABLES["auto"], _setup(["node 0", "node 1"]), [1])[1]
    assert chosen.route.transport == "torch.distributed"
    assert chosen.reason() == "fallback; rdma_tensor not used: rdma_tensor._C is not built"


class _StubHandle:
    def __init__(self, peer: int, done: bool):
        self.peer, self.tag, self.is_send, self.done = peer, 0, False, done


class _StubTransport:
    """test_any over stub handles, recording what each call was given."""

    def __init__(self):
        self.calls = []

    def test_any(self, handles):
        self.calls.append(list(handles))
        return next((i for i, handle in enumerate(handles) if handle.done), -1)


def test_router_test_any_asks_each_transport_about_its_own_handles():
    from megatron_dpp.comm.router import RoutedTransport

    near, far = _StubTransport(), _StubTransport()
    router = RoutedTransport({1: near, 2: far}, [near, far])
    handles = [_StubHandle(1, False), _StubHandle(2, False), _StubHandle(1, False),
               _StubHandle(2, True)]
    assert router.test_any(handles) == 3  # the index in the caller's list
    assert near.calls[-1] == [handles[0], handles[2]] and far.calls[-1] == [handles[1], handles[3]]
    handles[3].done = False
    assert router.test_any(handles) == -1
    one_route = [_StubHandle(2, False), _StubHandle(2, True)]
    assert router.test_any(one_route) == 1 and far.calls[-1] == one_route
    with pytest.raises(ValueError, match="test_any: no handles given"):
        router.test_any([])


# ---- the torch.distributed route with staging (CUDA) and across pauses ---------------------------
class _SlowHostStaging:
    """A stand-in for CudaStaging on the CPU: bytes reach "host memory" only when the send thread
    waits for them (after a delay), and received tensors are "moved to the device" by wait()."""

    def __init__(self):
        self.waited_in: list[str] = []
        self.moved = 0

    def to_host(self, tensor):
        staging = self

        class Ready:
            @staticmethod
            def synchronize():
                import threading
                import time

                time.sleep(0.02)
                staging.waited_in.append(threading.current_thread().name)

        return tensor.clone(), Ready

    def receive_buffer(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def to_device(self, tensor):
        self.moved += 1
        return tensor + 0


def _staged_worker(rank, world, store):
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        peer = 1 - rank
        staging = _SlowHostStaging()
        transport = TorchTransport([peer], timeout_s=60, staging=staging)
        # Five messages under one tag, then one under another: both sides send at once.
        sends = [transport.isend(torch.full((3,), float(10 * rank + i)), peer, 7) for i in range(5)]
        sends.append(transport.isend(torch.arange(6.0).view(2, 3).t(), peer, 8))
        assert staging.waited_in == [] or "MainThread" not in staging.waited_in
        got = [transport.irecv(peer, 7).wait(timeout=60) for _ in range(5)]
        odd = transport.irecv(peer, 8)
        first, again = odd.wait(timeout=60), odd.wait(timeout=60)
        for send in sends:
            send.wait(timeout=60)
        dist.barrier()
        transport.close()
        problems = []
        if [t.tolist() for t in got] != [[float(10 * peer + i)] * 3 for i in range(5)]:
            problems.append(f"same-tag order: {[t.tolist() for t in got]}")
        if first is not again or not torch.equal(first, torch.arange(6.0).view(2, 3).t()):
            problems.append("a receive's device tensor is made once")
        if staging.moved != 6:
            problems.append(f"moved to the device {staging.moved} times, not 6")
        if not staging.waited_in or any(n == "MainThread" for n in staging.waited_in):
            problems.append(f"staged bytes waited for in {staging.waited_in}")
        return problems
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_staged_sends_leave_from_the_send_thread_in_order(tmp_path):
    """CudaStaging's protocol, on the CPU: the caller never waits for the staged bytes, the send
    thread posts each message once they are there, one tag's messages keep their order, and
    wait() moves a received tensor to the device once."""
    assert run_ranks(_staged_worker, 2, tmp_path, timeout_s=100) == {0: [], 1: []}


def _pause_worker(rank, world, store, pause_s):
    from datetime import timedelta

    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        import time

        peer = 1 - rank
        # The transport's group has a timeout shorter than the pause between two messages.
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=pause_s / 2))
        transport = TorchTransport([peer], group=group, timeout_s=60)
        if rank == 1:
            time.sleep(pause_s)
            transport.isend(torch.ones(4), peer, 1).wait(timeout=30)
            got = None
        else:
            got = transport.irecv(peer, 1).wait(timeout=pause_s + 30).tolist()
        dist.barrier()
        transport.close()
        return got
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_pause_longer_than_the_group_timeout_keeps_the_link(tmp_path):
    """A gloo receive that times out closes its link for good; the receiver waits for the next
    header without that timeout, so a checkpoint save or an evaluation may pause the messages."""
    results = run_ranks(_pause_worker, 2, tmp_path, 3.0, timeout_s=100)
    assert results == {0: [1.0, 1.0, 1.0, 1.0], 1: None}


def test_torch_transport_refuses_a_group_that_is_not_gloo(monkeypatch):
    from megatron_dpp.comm import torch_transport

    monkeypatch.setattr(torch_transport.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(torch_transport.dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ValueError, match="default group's backend is nccl: pass a gloo group"):
        TorchTransport([1], device=torch.device("cuda", 0))


def test_a_job_not_on_gloo_gets_a_gloo_group_for_the_torch_route(monkeypatch):
    from megatron_dpp.comm import router

    monkeypatch.setattr(router.dist, "get_backend", lambda group=None: "nccl")
    for kind in ("auto", "shm", "torch"):
        assert router._needs_host_group(router.ROUTE_TABLES[kind]), kind
    assert not router._needs_host_group(router.ROUTE_TABLES["rdma"])
    for default_group_backend in ("gloo", "cpu:gloo,cuda:nccl"):  # gloo carries CPU tensors there
        monkeypatch.setattr(router.dist, "get_backend", lambda group=None: default_group_backend)
        assert not router._needs_host_group(router.ROUTE_TABLES["auto"]), default_group_backend


def _cuda_torch_route_worker(rank, world, store):
    """Both ranks on GPU 0 with an NCCL default group, as a GPU job has it: the torch route."""
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world)
    try:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        peer = 1 - rank
        transport = make_transport("torch", [peer], device=device, timeout_s=60, log=False)
        torch.cuda.set_sync_debug_mode("error")  # no host-device synchronization per message
        big = torch.randn(4 << 20, device=device)  # 16 MiB
        payloads = {0: torch.full((64, 32), float(rank), device=device, dtype=torch.bfloat16),
                    1: torch.arange(12.0, device=device).view(3, 4).t(),  # not contiguous
                    2: big}
        sends = [transport.isend(tensor, peer, tag) for tag, tensor in payloads.items()]
        received = {tag: transport.irecv(peer, tag).wait(timeout=60) for tag in payloads}
        for send in sends:
            send.wait(timeout=60)
        torch.cuda.set_sync_debug_mode(0)
        problems = []
        if any(t.device != device for t in received.values()):
            problems.append("received tensors are on the device")
        if not torch.equal(received[0].cpu(), torch.full((64, 32), float(peer), dtype=torch.bfloat16)):
            problems.append("bf16 message")
        if not torch.equal(received[1].cpu(), torch.arange(12.0).view(3, 4).t()):
            problems.append("transposed message")
        sums = torch.stack([big.sum(), received[2].sum()]).cpu()
        store.set(f"sum{rank}", str(float(sums[0])))
        if abs(float(store.get(f"sum{peer}")) - float(sums[1])) > 1e-3 * abs(float(sums[1])) + 1e-3:
            problems.append("16 MiB message")
        dist.barrier(group=transport.group)  # the gloo group: no NCCL collective on one GPU
        transport.close()
        return problems
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.timeout(240)
def test_torch_route_carries_gpu_tensors_over_host_memory(tmp_path):
    from _gpu import gpu_env

    results = run_ranks(_cuda_torch_route_worker, 2, tmp_path, timeout_s=200, env=gpu_env())
    assert results == {0: [], 1: []}


# ---- the ranks agree on their routes before any transport is built --------------------------------
def _agree(nodes, unavailable_per_rank, peers_per_rank):
    """agree_on_routes on every rank at once (a thread each, one store): {rank: error or None}."""
    import threading

    from megatron_dpp.comm.router import ROUTE_TABLES, agree_on_routes, assign_routes

    store = dist.HashStore()
    table = ROUTE_TABLES["auto"]
    outcome = {}

    def rank_thread(rank):
        setup = _setup(nodes, rank=rank, store=store, prefix="agree")
        unavailable = {route.name: unavailable_per_rank[rank].get(route.transport, "")
                       for route in table}
        assignment = assign_routes(table, setup, peers_per_rank[rank], unavailable)
        try:
            agree_on_routes(setup, table, assignment, unavailable)
            outcome[rank] = None
        except ValueError as error:
            outcome[rank] = str(error)

    threads = [threading.Thread(target=rank_thread, args=(r,)) for r in range(len(nodes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return outcome


def test_ranks_that_agree_on_their_routes_go_on():
    nodes = ["node 0", "node 0", "node 1", "node 1"]
    peers = {0: [1], 1: [0, 2], 2: [1, 3], 3: [2]}
    assert _agree(nodes, {r: {} for r in range(4)}, peers) == {r: None for r in range(4)}
    # rdma_tensor missing everywhere: both sides of the cross-node pair fall back alike.
    missing = {r: {"rdma_tensor": "rdma_tensor._C is not built"} for r in range(4)}
    assert _agree(nodes, missing, peers) == {r: None for r in range(4)}


def test_a_node_without_a_transport_its_peer_uses_is_named_by_both():
    nodes = ["node 0", "node 0", "node 1", "node 1"]
    peers = {0: [1], 1: [0, 2], 2: [1, 3], 3: [2]}
    unavailable = {0: {}, 1: {}, 2: {"rdma_tensor": "rdma_tensor._C is not built"}, 3: {}}
    outcome = _agree(nodes, unavailable, peers)
    assert outcome[0] is None and outcome[3] is None
    assert outcome[1] == (
        "transport: rank 1 on 10.0.0.0 reaches rank 2 by rdma_tensor (other node), but rank 2 on "
        "10.0.0.1 reaches rank 1 by torch.distributed (fallback; rdma_tensor not used: "
        "rdma_tensor._C is not built): install the same transports on every node, or pick one "
        "with --p2p-transport")
    assert outcome[2].startswith("transport: rank 2 on 10.0.0.1 reaches rank 1 by torch.distributed")


def test_a_collective_route_must_run_on_every_rank_or_none():
    nodes = ["node 0", "node 0", "node 1", "node 1"]
    peers = {0: [1], 1: [0], 2: [3], 3: [2]}
    why = "the CUDA runtime does not load for CUDA IPC: libcudart.so: cannot open"
    unavailable = {0: {}, 1: {}, 2: {"shm_tensor": why}, 3: {"shm_tensor": why}}
    outcome = _agree(nodes, unavailable, peers)
    expected = (f"transport: shm_tensor runs on rank 0 on 10.0.0.0 but not on rank 2 on 10.0.0.1 "
                f"({why}; 2 of 4 ranks cannot run it): every rank joins its rendezvous, so it must "
                "run on all or none; install the same on every node, or pick --p2p-transport torch")
    assert outcome == {r: expected for r in range(4)}


def test_a_peer_that_does_not_list_this_rank_is_named():
    outcome = _agree(["node 0", "node 0"], {0: {}, 1: {}}, {0: [1], 1: []})
    assert outcome[1] is None
    assert outcome[0] == ("transport: rank 0 on 10.0.0.0 lists rank 1 as a peer, but rank 1 on "
                          "10.0.0.0 does not list rank 0: each side of a link must list the other")


def test_a_rank_that_never_comes_is_named_by_the_route_exchange():
    from megatron_dpp.comm.errors import TransportTimeout
    from megatron_dpp.comm.router import read_every_rank

    store = dist.HashStore()
    for rank in (0, 1, 3):
        store.set(f"x/routes/{rank}", str(rank))
    assert read_every_rank(store, "x/routes", 2, 1.0, "the routes") == [b"0", b"1"]
    with pytest.raises(TransportTimeout, match=r"waited 0.2 s for the routes of ranks \[2, 4\] "
                                               r"\(2 of 5\)"):
        read_every_rank(store, "x/routes", 5, 0.2, "the routes")
