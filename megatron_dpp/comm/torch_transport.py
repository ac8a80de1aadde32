"""The Transport protocol over torch.distributed point-to-point (gloo or nccl): the baseline and the
fallback for peers on other nodes.

Each message is the wire header (shm_tensor's 128-byte header, as a uint8 tensor) followed by the
payload viewed as bytes. torch.distributed delivers the messages of one (sender, receiver) pair in
order, so every receiver keeps one header receive posted per peer and, as headers arrive, receives
the payloads and files them by tag: receives match by (peer, tag) in any order, and shapes and
dtypes come from the header. Waiting polls the outstanding requests with sleeps that back off to
1 ms (torch.distributed has no wait-for-any), so it never spins on a CPU core.
"""
from __future__ import annotations

import collections
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

import shm_tensor

# The largest tag value is the end-of-stream marker that close() sends; user tags stay below it.
END_OF_STREAM_TAG = (1 << 63) - 1
_MAX_PAYLOAD_BYTES = 1 << 46


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (any dtype, including 0-d and empty)."""
    return tensor.reshape(-1).view(torch.uint8)


class TorchHandle:
    __slots__ = ("peer", "tag", "is_send", "_transport", "_works", "_keep_alive", "_tensor", "_done")

    def __init__(self, transport: "TorchTransport", peer: int, tag: int, is_send: bool) -> None:
        self.peer, self.tag, self.is_send = peer, tag, is_send
        self._transport = transport
        self._works: list = []
        self._keep_alive: tuple = ()
        self._tensor: Optional[torch.Tensor] = None
        self._done = False

    def test(self) -> bool:
        self._transport._progress()
        return self._transport._is_done(self)

    def wait(self, timeout: Optional[float] = None) -> Optional[torch.Tensor]:
        self._transport.wait_any([self], timeout)
        return None if self.is_send else self._tensor

    def __repr__(self) -> str:
        kind = "send to" if self.is_send else "recv from"
        return f"<TorchHandle {kind} {self.peer} tag {self.tag}>"


class _InboundStream:
    """The ordered message stream from one peer: header receive, then payload receive, repeat."""

    def __init__(self, transport: "TorchTransport", peer: int) -> None:
        self.transport = transport
        self.peer = peer
        self.ended = False
        self._payload: Optional[tuple[int, torch.Tensor]] = None
        self._header = torch.empty(shm_tensor.HEADER_BYTES, dtype=torch.uint8,
                                   device=transport.device)
        self._work = dist.irecv(self._header, src=peer, group=transport.group)

    def poll(self) -> bool:
        """Advances by one step if the outstanding receive finished; True when it did."""
        if self._work is None or not self._work.is_completed():
            return False
        self._work.wait()
        if self._payload is not None:
            tag, tensor = self._payload
            self._payload = None
            self.transport._deliver(self.peer, tag, tensor)
            self._post_header()
            return True
        tag, _src, empty = shm_tensor.decode_header(
            bytes(self._header.cpu().numpy()), _MAX_PAYLOAD_BYTES, self.peer)
        if tag == END_OF_STREAM_TAG:
            self.ended = True
            self._work = None
            return True
        tensor = torch.empty(empty.shape, dtype=empty.dtype, device=self.transport.device)
        if tensor.numel() == 0:
            self.transport._deliver(self.peer, tag, tensor)
            self._post_header()
        else:
            self._payload = (tag, tensor)
            self._work = dist.irecv(_as_bytes(tensor), src=self.peer, group=self.transport.group)
        return True

    def _post_header(self) -> None:
        self._work = dist.irecv(self._header, src=self.peer, group=self.transport.group)


class TorchTransport:
    """Collective constructor and close() over `peers` (each side lists the other)."""

    def __init__(self, peers: Sequence[int], *, group: Optional[dist.ProcessGroup] = None,
                 device: torch.device = torch.device("cpu"), timeout_s: float = 300.0) -> None:
        self.rank = dist.get_rank()
        self.group = group
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.peers = tuple(peers)
        if self.rank in self.peers:
            raise ValueError(f"TorchTransport: rank {self.rank} lists itself as a peer")
        self._streams = {peer: _InboundStream(self, peer) for peer in self.peers}
        self._unclaimed: dict[tuple[int, int], collections.deque] = collections.defaultdict(
            collections.deque)
        self._posted: dict[tuple[int, int], collections.deque] = collections.defaultdict(
            collections.deque)
        self._closed = False

    def _check_peer(self, call: str, peer: int, tag: int) -> None:
        if self._closed:
            raise RuntimeError(f"{call}(peer={peer}, tag={tag}): transport is closed")
        if peer not in self._streams:
            raise ValueError(f"{call}(peer={peer}, tag={tag}): rank {peer} is not a peer of this "
                             f"transport (peers: {list(self.peers)})")
        if not 0 <= tag < END_OF_STREAM_TAG:
            raise ValueError(f"{call}(peer={peer}, tag={tag}): tags are in [0, 2**63 - 1)")

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> TorchHandle:
        self._check_peer("torch_transport.isend", peer, tag)
        source = tensor.detach().contiguous()
        header = torch.frombuffer(bytearray(shm_tensor.encode_header(source, tag, self.rank)),
                                  dtype=torch.uint8).to(self.device)
        handle = TorchHandle(self, peer, tag, is_send=True)
        handle._works.append(dist.isend(header, dst=peer, group=self.group))
        if source.numel() > 0:
            handle._works.append(dist.isend(_as_bytes(source), dst=peer, group=self.group))
        handle._keep_alive = (header, source)
        return handle

    def irecv(self, peer: int, tag: int) -> TorchHandle:
        self._check_peer("torch_transport.irecv", peer, tag)
        handle = TorchHandle(self, peer, tag, is_send=False)
        waiting = self._unclaimed.get((peer, tag))
        if waiting:
            handle._tensor = waiting.popleft()
            handle._done = True
        else:
            self._posted[(peer, tag)].append(handle)
        return handle

    def _deliver(self, peer: int, tag: int, tensor: torch.Tensor) -> None:
        posted = self._posted.get((peer, tag))
        if posted:
            handle = posted.popleft()
            handle._tensor = tensor
            handle._done = True
        else:
            self._unclaimed[(peer, tag)].append(tensor)

    def _progress(self) -> None:
        for stream in self._streams.values():
            while stream.poll():
                pass

    def _is_done(self, handle: TorchHandle) -> bool:
        if handle._done:
            return True
        if handle.is_send and all(work.is_completed() for work in handle._works):
            for work in handle._works:
                work.wait()  # surfaces a failed send
            handle._done = True
            handle._keep_alive = ()
        return handle._done

    def wait_any(self, handles: Sequence[TorchHandle], timeout: Optional[float] = None) -> int:
        if not handles:
            raise ValueError("torch_transport.wait_any: no handles given")
        limit = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        nap = 50e-6
        while True:
            self._progress()
            for index, handle in enumerate(handles):
                if self._is_done(handle):
                    return index
            if time.monotonic() >= deadline:
                waited = ", ".join(
                    f"{'send to' if h.is_send else 'receive from'} {h.peer} tag {h.tag}"
                    for h in handles[:8])
                first = handles[0]
                raise TimeoutError(f"torch_transport.wait(peer={first.peer}, tag={first.tag}): "
                                   f"timed out after {limit} s waiting for {waited}")
            time.sleep(nap)
            nap = min(nap * 2, 1e-3)

    def close(self) -> None:
        """Sends end-of-stream to every peer and drains until every peer's arrived, so no receive
        is left posted when the process group is destroyed."""
        if self._closed:
            return
        marker = torch.zeros(0, device=self.device)
        ends = []
        for peer in self.peers:
            header = torch.frombuffer(
                bytearray(shm_tensor.encode_header(marker, END_OF_STREAM_TAG, self.rank)),
                dtype=torch.uint8).to(self.device)
            ends.append((header, dist.isend(header, dst=peer, group=self.group)))
        deadline = time.monotonic() + self.timeout_s
        while not all(stream.ended for stream in self._streams.values()):
            self._progress()
            if time.monotonic() >= deadline:
                missing = [p for p, s in self._streams.items() if not s.ended]
                raise TimeoutError(f"torch_transport.close: peers {missing} did not close within "
                                   f"{self.timeout_s} s; call close() on every rank")
            time.sleep(1e-3)
        for _header, work in ends:
            work.wait()
        self._closed = True
