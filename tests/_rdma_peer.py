"""One side of an rdma_tensor test between two processes over loopback:
`python _rdma_peer.py SCENARIO RANK PORT`. Prints one JSON line with what it saw, exits 0."""
from __future__ import annotations

import json
import sys
import time
from datetime import timedelta

import torch

import rdma_tensor

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128]


def pattern(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    """A deterministic tensor both sides can build."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 100, shape, generator=generator)
    return values.to(dtype)


def scenario_dtypes(ctx, rank, _store):
    """Every dtype, a non-contiguous tensor, zero-size and 64 MiB tensors, received in reverse order."""
    messages = [(pattern(dtype, (3, 5), i), i) for i, dtype in enumerate(DTYPES)]
    messages.append((pattern(torch.float32, (6, 4), 50).t(), 50))  # non-contiguous
    messages.append((torch.empty(0, 7), 51))
    messages.append((pattern(torch.float32, (16 << 20,), 52), 52))  # 64 MiB
    if rank == 0:
        handles = [ctx.isend(tensor, 1, tag) for tensor, tag in messages]
        for handle in handles:
            handle.wait(60)
        return {"sent": len(handles)}
    handles = [(ctx.irecv(0, tag), tensor) for tensor, tag in reversed(messages)]
    wrong = []
    for handle, want in handles:
        got = handle.wait(60)
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            wrong.append(handle.tag)
    return {"wrong": wrong, "received": len(handles)}


def scenario_any_order(ctx, rank, store):
    """Both sides send and receive 40 messages of varying length, receives posted before and after
    the sends arrive, in shuffled order; buffers are reused, not registered per message."""
    order = list(range(40))
    torch.manual_seed(7)
    shuffled = [order[i] for i in torch.randperm(40).tolist()]
    peer = 1 - rank
    early = [ctx.irecv(peer, tag) for tag in shuffled[:20]]
    sends = [ctx.isend(torch.full((tag + 1, 64), float(rank * 1000 + tag)), peer, tag) for tag in order]
    time.sleep(0.2)
    late = [ctx.irecv(peer, tag) for tag in shuffled[20:]]
    wrong = []
    for handle in early + late:
        tensor = handle.wait(60)
        if tensor.shape != (handle.tag + 1, 64) or not bool((tensor == peer * 1000 + handle.tag).all()):
            wrong.append(handle.tag)
    while sends:
        sends.pop(ctx.wait_any(sends, 60)).wait(0)
    # A handle keeps its received tensor, which keeps its buffer: drop them, the buffers return.
    del early, late, handle, tensor
    # Both sides have given their buffers back before either sends again (else a message of the
    # second round could arrive while the receiver still holds the first round's buffers).
    store.set(f"round1-freed/{rank}", "1")
    store.wait([f"round1-freed/{peer}"])
    # The same 40 lengths again, one message each way at a time (round one had them all in flight
    # at once, so the pool holds every size): every buffer comes from the pool.
    before = ctx.buffer_registrations()
    for tag in order:
        send = ctx.isend(torch.full((tag + 1, 64), 1.0), peer, tag)
        received = ctx.irecv(peer, tag).wait(60)
        send.wait(60)
        del received
    return {"wrong": wrong, "registered_again": ctx.buffer_registrations() - before,
            "registered": before}


def scenario_timeout(ctx, rank, store):
    """A receive nobody sends: TransportTimeout naming the peer, its address and the tag."""
    result = {}
    if rank == 0:
        started = time.monotonic()
        try:
            ctx.irecv(1, 12345).wait(timeout=0.5)
        except rdma_tensor.TransportTimeout as error:
            result = {"error": str(error), "is_timeout_error": isinstance(error, TimeoutError),
                      "seconds": time.monotonic() - started}
    store.set(f"timeout-done/{rank}", "1")
    store.wait([f"timeout-done/{1 - rank}"])
    return result


def scenario_bad_header(ctx, rank, store):
    """Messages that are not valid wire messages: the receiver fails the pending receive from that
    peer with ProtocolError naming the problem."""
    result = {}
    if rank == 0:
        header = bytearray(_header_of(torch.zeros(4), tag=3, src=0))
        header[0] ^= 0xFF  # bad magic
        ctx._send_raw(bytes(header) + bytes(16), 1, 0).wait(30)
    else:
        try:
            ctx.irecv(0, 3).wait(timeout=30)
        except rdma_tensor.ProtocolError as error:
            result = {"error": str(error)}
    store.set(f"bad-done/{rank}", "1")
    store.wait([f"bad-done/{1 - rank}"])
    return result


def scenario_short_payload(ctx, rank, store):
    """A header announcing 16 bytes followed by 8: a shape/size mismatch, refused."""
    result = {}
    if rank == 0:
        header = _header_of(torch.zeros(4), tag=3, src=0)
        ctx._send_raw(header + bytes(8), 1, 0).wait(30)
    else:
        try:
            ctx.irecv(0, 3).wait(timeout=30)
        except rdma_tensor.ProtocolError as error:
            result = {"error": str(error)}
    store.set(f"short-done/{rank}", "1")
    store.wait([f"short-done/{1 - rank}"])
    return result


def scenario_short_payload_late_recv(ctx, rank, store):
    """The same bad message, the receive posted only after it has arrived: the same error
    (a stream broken by a bad message stays a protocol error, not a lost peer)."""
    result = {}
    if rank == 0:
        header = _header_of(torch.zeros(4), tag=3, src=0)
        ctx._send_raw(header + bytes(8), 1, 0).wait(30)
        store.set("late-sent", "1")
    else:
        store.wait(["late-sent"])
        time.sleep(0.5)  # the progress thread takes the message in
        try:
            ctx.irecv(0, 3).wait(timeout=30)
        except rdma_tensor.ProtocolError as error:
            result = {"error": str(error)}
        except rdma_tensor.TransportError as error:
            result = {"other": f"{type(error).__name__}: {error}"}
    store.set(f"late-done/{rank}", "1")
    store.wait([f"late-done/{1 - rank}"])
    return result


def scenario_peer_killed(ctx, rank, store):
    """Rank 1 exits hard while rank 0 waits for a message from it: PeerLostError, long before the
    receive's own timeout."""
    if rank == 1:
        store.set("victim-ready", "1")
        time.sleep(0.3)
        import os

        os._exit(9)
    store.wait(["victim-ready"])
    started = time.monotonic()
    try:
        ctx.irecv(1, 1).wait(timeout=60)
    except rdma_tensor.PeerLostError as error:
        return {"error": str(error), "seconds": time.monotonic() - started}
    except rdma_tensor.TransportTimeout as error:
        return {"timeout": str(error), "seconds": time.monotonic() - started}
    return {}


def _header_of(tensor: torch.Tensor, tag: int, src: int) -> bytes:
    from megatron_dpp.comm.codec import encode_header

    return encode_header(tensor, tag, src)


SCENARIOS = {name[len("scenario_"):]: fn for name, fn in globals().items() if name.startswith("scenario_")}


def main() -> int:
    scenario, rank, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=60))
    ctx = rdma_tensor.create_context_with_store(store, rank=rank, world_size=2, peers=[1 - rank],
                                                node_address="127.0.0.1",
                                                config=rdma_tensor.RdmaConfig(timeout_s=60))
    result = SCENARIOS[scenario](ctx, rank, store)
    # Keep the store (hosted by rank 0) alive until both are done, then close together.
    store.set(f"finished/{rank}", "1")
    if scenario != "peer_killed":
        store.wait([f"finished/{1 - rank}"], timedelta(seconds=60))
        # Rank 0 hosts the store: it leaves only after rank 1's last store call has been answered,
        # or rank 1's wait above can meet a closed socket ("Connection reset by peer").
        if rank == 1:
            store.set("left/1", "1")
        else:
            store.wait(["left/1"], timedelta(seconds=60))
    ctx.close()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
