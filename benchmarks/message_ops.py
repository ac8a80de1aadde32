"""One transport's send and receive in the transport benchmarks' terms, and the ping-pong they
time (transport_bench.py on one node, cross_namespace_bench.py across two network namespaces)."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist


class MessageOps:
    """send/recv of one transport in the benchmark's terms."""

    def __init__(self, name, ctx, peer):
        self.name, self.ctx, self.peer = name, ctx, peer
        self.tag = 0

    def next_tag(self) -> int:
        self.tag += 1
        return self.tag

    def send(self, tensor, tag):
        if self.ctx is not None:
            return self.ctx.isend(tensor, self.peer, tag)
        return dist.isend(tensor, dst=self.peer)

    def recv(self, buffer, tag):
        if self.ctx is not None:
            return self.ctx.irecv(self.peer, tag)
        return dist.irecv(buffer, src=self.peer)

    def wait(self, handle):
        return handle.wait(timeout=60) if self.ctx is not None else handle.wait()


def ping_pong(ops: MessageOps, rank: int, size: int, iters: int) -> list[float]:
    payload = torch.ones(size, dtype=torch.uint8)
    buffer = torch.empty(size, dtype=torch.uint8)
    one_way = []
    for _ in range(iters + 2):  # the first two warm up
        tag = ops.next_tag()
        start = time.perf_counter()
        if rank == 0:
            ops.wait(ops.send(payload, tag))
            ops.wait(ops.recv(buffer, tag))
        else:
            ops.wait(ops.recv(buffer, tag))
            ops.wait(ops.send(payload, tag))
        one_way.append((time.perf_counter() - start) / 2)
    return one_way[2:]
