"""The Transport protocol between threads of one process: every rank of a job in one process, for
fast tests of the runtime (tests/_runtime_harness.py) without process groups or sockets.

Semantics are the protocol's (transport.py): tag-matched in any order, FIFO per (peer, tag), waits
with timeouts that name what they waited for. A send copies the tensor (as a real transport does),
so the sender may free or reuse its own at once. `lost(rank)` makes every wait on a message from
that rank fail as a real transport does when a peer process dies. `received_alive()` counts the
received tensors still referenced anywhere: shm_tensor lends its slots to received tensors until they
are freed, and tests use this count to check that the runtime lets go of what it received.
"""
from __future__ import annotations

import collections
import threading
import weakref
from typing import Optional, Sequence

import torch

from megatron_dpp.comm.errors import PeerLostError, TransportError
from megatron_dpp.comm.transport import (
    DEFAULT_TIMEOUT_S,
    test_any_under_lock,
    wait_any_on_condition,
)


class MemoryHandle:
    __slots__ = ("peer", "tag", "is_send", "_transport", "_tensor", "_done")

    def __init__(self, transport: "MemoryTransport", peer: int, tag: int, is_send: bool):
        self.peer, self.tag, self.is_send = peer, tag, is_send
        self._transport = transport
        self._tensor: Optional[torch.Tensor] = None
        self._done = is_send  # a send completes when it is posted: the data is copied

    def test(self) -> bool:
        with self._transport.hub.cond:
            return self._transport._done_or_raise(self)

    def wait(self, timeout: Optional[float] = None) -> Optional[torch.Tensor]:
        self._transport.wait_any([self], timeout)
        return None if self.is_send else self._tensor

    def __repr__(self) -> str:
        return f"<MemoryHandle {'send to' if self.is_send else 'recv from'} {self.peer} tag {self.tag}>"


class MemoryHub:
    """The shared mailbox of one job: `transport(rank)` is that rank's endpoint."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.cond = threading.Condition()
        self.timeout_s = timeout_s
        self._unclaimed: dict[tuple[int, int, int], collections.deque] = collections.defaultdict(
            collections.deque)  # (src, dst, tag) -> tensors
        self._posted: dict[tuple[int, int, int], collections.deque] = collections.defaultdict(
            collections.deque)  # (src, dst, tag) -> receive handles
        self._lost: set[int] = set()
        self._alive = 0  # received tensors not yet freed
        self.delivered = 0  # messages sent, over the hub's life

    def transport(self, rank: int) -> "MemoryTransport":
        return MemoryTransport(self, rank)

    def lost(self, rank: int) -> None:
        """Rank `rank` died: waits on its messages fail with PeerLostError."""
        with self.cond:
            self._lost.add(rank)
            self.cond.notify_all()

    def received_alive(self) -> int:
        with self.cond:
            return self._alive

    def _freed(self) -> None:
        with self.cond:
            self._alive -= 1

    def deliver(self, src: int, dst: int, tag: int, tensor: torch.Tensor) -> None:
        with self.cond:
            self._alive += 1
            self.delivered += 1
            weakref.finalize(tensor, self._freed)
            posted = self._posted.get((src, dst, tag))
            if posted:
                handle = posted.popleft()
                handle._tensor, handle._done = tensor, True
            else:
                self._unclaimed[(src, dst, tag)].append(tensor)
            self.cond.notify_all()


class MemoryTransport:
    def __init__(self, hub: MemoryHub, rank: int):
        self.hub = hub
        self.rank = rank
        self._closed = False

    def _check(self, call: str, peer: int, tag: int) -> None:
        if self._closed:
            raise TransportError(f"{call}(peer={peer}, tag={tag}): transport is closed")
        if peer == self.rank:
            raise ValueError(f"{call}(peer={peer}, tag={tag}): rank {peer} is this rank")

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> MemoryHandle:
        self._check("memory_transport.isend", peer, tag)
        self.hub.deliver(self.rank, peer, tag, tensor.detach().clone())
        return MemoryHandle(self, peer, tag, is_send=True)

    def irecv(self, peer: int, tag: int) -> MemoryHandle:
        self._check("memory_transport.irecv", peer, tag)
        handle = MemoryHandle(self, peer, tag, is_send=False)
        hub = self.hub
        with hub.cond:
            waiting = hub._unclaimed.get((peer, self.rank, tag))
            if waiting:
                handle._tensor, handle._done = waiting.popleft(), True
            else:
                hub._posted[(peer, self.rank, tag)].append(handle)
        return handle

    def _done_or_raise(self, handle: MemoryHandle) -> bool:
        """Hub lock held."""
        if handle._done:
            return True
        if handle.peer in self.hub._lost:
            raise PeerLostError(f"memory_transport.irecv(peer={handle.peer}, tag={handle.tag}): "
                                f"peer {handle.peer} was lost")
        return False

    def wait_any(self, handles: Sequence[MemoryHandle], timeout: Optional[float] = None) -> int:
        limit = self.hub.timeout_s if timeout is None else timeout
        return wait_any_on_condition("memory_transport", self.hub.cond, handles,
                                     self._done_or_raise, limit)

    def test_any(self, handles: Sequence[MemoryHandle]) -> int:
        return test_any_under_lock("memory_transport", self.hub.cond, handles, self._done_or_raise)

    def close(self) -> None:
        self._closed = True
