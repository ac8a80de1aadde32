"""The Transport protocol: tag-matched, non-blocking point-to-point tensor messages.

Semantics shared by every implementation (shm_tensor, torch.distributed, the router):
- `isend(tensor, peer, tag)` and `irecv(peer, tag)` return handles at once; peers are global
  torch.distributed ranks, tags non-negative 63-bit ints (see tags.py).
- A receive matches a send by (peer, tag), whatever the order in which either side posts; two
  messages with the same (peer, tag) are delivered in the order they were sent.
- A receive's tensor (shape and dtype from the wire header) comes from `handle.wait()`; a send's
  `wait()` returns None once the caller may reuse its tensor.
- Every wait has a timeout (None: the transport's default) and raises TimeoutError naming what it
  waited for; a lost peer or a corrupted message raises naming peer and tag.
- `close()` is collective with the peers: call it on every rank after the last message.

Errors: comm/errors.py (TransportError, a RuntimeError; TransportTimeout, also a TimeoutError;
PeerLostError; ProtocolError); the compiled transports raise classes of the same shape.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional, Protocol, Sequence, runtime_checkable

import torch

from megatron_dpp.comm.defaults import DEFAULT_TIMEOUT_S  # noqa: F401 (re-exported)
from megatron_dpp.comm.errors import TransportTimeout


@runtime_checkable
class TransportHandle(Protocol):
    @property
    def peer(self) -> int: ...

    @property
    def tag(self) -> int: ...

    @property
    def is_send(self) -> bool: ...

    def test(self) -> bool: ...

    def wait(self, timeout: Optional[float] = None) -> Optional[torch.Tensor]: ...


@runtime_checkable
class Transport(Protocol):
    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> TransportHandle: ...

    def irecv(self, peer: int, tag: int) -> TransportHandle: ...

    def wait_any(self, handles: Sequence[TransportHandle], timeout: Optional[float] = None) -> int: ...

    # Index of a completed handle, or -1, without waiting; errors as `test()` raises them. One
    # call for many handles: the DPP runtime polls its outstanding receives every turn.
    def test_any(self, handles: Sequence[TransportHandle]) -> int: ...

    def close(self) -> None: ...


def test_any_under_lock(name: str, cond: threading.Condition, handles: Sequence[TransportHandle],
                        done_or_raise: Callable[[TransportHandle], bool]) -> int:
    """test_any for transports written in Python: the first of `handles` for which
    `done_or_raise(handle)`, called with `cond`'s lock held, is true; -1 if none."""
    if not handles:
        raise ValueError(f"{name}.test_any: no handles given")
    with cond:
        for index, handle in enumerate(handles):
            if done_or_raise(handle):
                return index
    return -1


def wait_any_on_condition(name: str, cond: threading.Condition, handles: Sequence[TransportHandle],
                          done_or_raise: Callable[[TransportHandle], bool], limit_s: float) -> int:
    """wait_any for transports written in Python: sleep on `cond` (notified whenever a handle may
    have completed) until `done_or_raise(handle)`, called with the lock held, is true for one of
    `handles`; TransportTimeout naming them after `limit_s` seconds."""
    if not handles:
        raise ValueError(f"{name}.wait_any: no handles given")
    deadline = time.monotonic() + limit_s
    with cond:
        while True:
            for index, handle in enumerate(handles):
                if done_or_raise(handle):
                    return index
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                waited = ", ".join(
                    f"{'send to' if h.is_send else 'receive from'} {h.peer} tag {h.tag}"
                    for h in handles[:8])
                first = handles[0]
                raise TransportTimeout(f"{name}.wait(peer={first.peer}, tag={first.tag}): timed out "
                                       f"after {limit_s} s waiting for {waited}")
            cond.wait(remaining)
