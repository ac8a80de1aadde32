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
"""
from __future__ import annotations

from typing import Optional, Protocol, Sequence, runtime_checkable

import torch


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

    def close(self) -> None: ...
