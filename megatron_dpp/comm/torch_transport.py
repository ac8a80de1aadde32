"""The Transport protocol over torch.distributed point-to-point (gloo): the baseline, and the
fallback for peers on other nodes.

Each message is the wire header (comm/codec.py's 128 bytes, as a uint8 tensor) followed by the
payload viewed as bytes. torch.distributed delivers the messages of one (sender, receiver) pair in
order, so a receiver thread per peer keeps a header receive posted, receives the payload the header
announces, and files the tensor by tag: receives match by (peer, tag) in any order, and shapes and
dtypes come from the header. gloo's Work.is_completed() stays False until someone waits on it, so
threads do the blocking `wait()`s and wake the caller through a condition variable: no polling.

The bytes always travel in host memory over a gloo group. Not over NCCL: NCCL's point-to-point
operations with one peer share one CUDA stream, and a receive holds that stream until its message
comes, so the header receive kept posted here would hold back every send to that peer (both ranks
of a pipeline pair then wait for each other at the first message). On a CUDA device the transport
stages instead (`CudaStaging`): a send copies the tensor into page-locked memory on the caller's
stream and records an event; the peer's send thread waits for that event (the caller never waits for
the device) and only then hands the bytes to gloo. A receive lands in page-locked memory, and
`wait()` copies it to the device on the caller's stream, asynchronously.
"""
from __future__ import annotations

import collections
import queue
import threading
import time
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_dpp.comm import codec
from megatron_dpp.comm.errors import PeerLostError, TransportError, TransportTimeout
from megatron_dpp.comm.transport import (
    DEFAULT_TIMEOUT_S,
    test_any_under_lock,
    wait_any_on_condition,
)

# The largest tag value is the end-of-stream marker that close() sends; user tags stay below it.
END_OF_STREAM_TAG = (1 << 63) - 1
_MAX_PAYLOAD_BYTES = 1 << 46
# How long the receiver waits for a peer's next header. Not the group's timeout: a gloo receive that
# times out closes the link for good, and the next message may come after any pause (a checkpoint
# save, an evaluation). A lost peer still ends the wait at once (gloo sees its connection close);
# a silent one is the heartbeats' to name, and callers' waits have their own timeouts.
_NEXT_HEADER_WAIT = timedelta(days=365)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (any dtype, including 0-d and empty)."""
    return tensor.reshape(-1).view(torch.uint8)


class HostStaging:
    """How tensors of the transport's device cross host memory, the only memory gloo moves. On the
    CPU there is nothing to stage: a send is handed to gloo by its caller, at once."""

    def to_host(self, tensor: torch.Tensor):
        """(the tensor's bytes in host memory, an object whose `synchronize()` returns once they are
        there; None: they are there now and the caller may post the send itself)."""
        return tensor, None

    def receive_buffer(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


class _AlreadyThere:
    """The readiness of bytes already in host memory."""

    @staticmethod
    def synchronize() -> None:
        pass


class CudaStaging(HostStaging):
    """Device tensors go through page-locked host memory, without the caller waiting for the device:
    the copies are queued on the caller's stream (torch's pinned allocator keeps a buffer until the
    copy that uses it has run)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def to_host(self, tensor: torch.Tensor):
        if not tensor.is_cuda or tensor.numel() == 0:
            # Posted by the send thread all the same: messages to a peer leave in the order sent.
            return (tensor if not tensor.is_cuda else torch.empty(tensor.shape, dtype=tensor.dtype),
                    _AlreadyThere)
        staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        stream = torch.cuda.current_stream(tensor.device)
        staged.copy_(tensor, non_blocking=True)  # after the kernels that produced the tensor
        copied = torch.cuda.Event()
        copied.record(stream)
        return staged, copied

    def receive_buffer(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device, non_blocking=True)


def staging_for(device: torch.device) -> HostStaging:
    return CudaStaging(device) if device.type == "cuda" else HostStaging()


class TorchHandle:
    __slots__ = ("peer", "tag", "is_send", "_transport", "_tensor", "_done", "_on_device")

    def __init__(self, transport: "TorchTransport", peer: int, tag: int, is_send: bool) -> None:
        self.peer, self.tag, self.is_send = peer, tag, is_send
        self._transport = transport
        self._tensor: Optional[torch.Tensor] = None
        self._done = False
        self._on_device = False  # a received tensor, once moved from host memory to the device

    def test(self) -> bool:
        with self._transport._cond:
            return self._transport._done_or_raise(self)

    def wait(self, timeout: Optional[float] = None) -> Optional[torch.Tensor]:
        self._transport.wait_any([self], timeout)
        if self.is_send:
            return None
        if not self._on_device:  # on the caller's stream: the caller's next kernels see it
            self._tensor = self._transport.staging.to_device(self._tensor)
            self._on_device = True
        return self._tensor

    def __repr__(self) -> str:
        kind = "send to" if self.is_send else "recv from"
        return f"<TorchHandle {kind} {self.peer} tag {self.tag}>"


class _PeerLink:
    """The threads that wait on torch.distributed requests with one peer: the receiver, and the
    sender, which waits for each send to complete (and, with staging, first posts it)."""

    def __init__(self, transport: "TorchTransport", peer: int) -> None:
        self.transport = transport
        self.peer = peer
        self.error: Optional[BaseException] = None
        self.ended = False  # the peer's end-of-stream arrived
        self.sends: queue.Queue = queue.Queue()
        self.receiver = threading.Thread(target=self._receive_loop, daemon=True,
                                         name=f"torch_transport-recv-{peer}")
        self.completer = threading.Thread(target=self._complete_sends, daemon=True,
                                          name=f"torch_transport-send-{peer}")
        self.receiver.start()
        self.completer.start()

    def _fail(self, error: BaseException) -> None:
        with self.transport._cond:
            self.error = error
            self.transport._cond.notify_all()

    def _receive_loop(self) -> None:
        group, staging = self.transport.group, self.transport.staging
        header = torch.empty(codec.HEADER_BYTES, dtype=torch.uint8)
        try:
            self.transport.use_device_in_this_thread()
            while True:
                dist.irecv(header, src=self.peer, group=group).wait(timeout=_NEXT_HEADER_WAIT)
                announced = codec.decode_header(bytes(header.numpy()), _MAX_PAYLOAD_BYTES,
                                                self.peer)
                tag = announced.tag
                if tag == END_OF_STREAM_TAG:
                    with self.transport._cond:
                        self.ended = True
                        self.transport._cond.notify_all()
                    return
                tensor = staging.receive_buffer(announced.shape, announced.dtype)
                if tensor.numel() > 0:
                    dist.irecv(_as_bytes(tensor), src=self.peer, group=group).wait()
                self.transport._deliver(self.peer, tag, tensor)
        except BaseException as error:  # reported to whoever waits on this peer
            self._fail(error)

    def _complete_sends(self) -> None:
        try:
            self.transport.use_device_in_this_thread()
        except BaseException as error:
            self._fail(error)
            return
        while True:
            item = self.sends.get()
            if item is None:
                return
            handle, works, (header, payload, in_host_memory) = item
            try:
                if works is None:  # staged: post it once its bytes are in host memory
                    in_host_memory.synchronize()
                    works = self.transport._post(header, payload, self.peer)
                for work in works:
                    work.wait()
            except BaseException as error:
                self._fail(error)
                return
            with self.transport._cond:
                handle._done = True
                self.transport._cond.notify_all()


class TorchTransport:
    """Collective constructor and close() over `peers` (each side lists the other).

    `group`: a gloo group that holds this rank and its peers (default: the default group, which
    must then be gloo); `device`: where received tensors go (CUDA: staged, see the module's
    docstring); `staging`: how tensors cross host memory (default: the device's)."""

    def __init__(self, peers: Sequence[int], *, group: Optional[dist.ProcessGroup] = None,
                 device: torch.device = torch.device("cpu"),
                 timeout_s: float = DEFAULT_TIMEOUT_S,
                 staging: Optional[HostStaging] = None) -> None:
        self.rank = dist.get_rank()
        self.group = group
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # the threads set it as theirs
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.staging = staging if staging is not None else staging_for(self.device)
        self.timeout_s = timeout_s
        self.peers = tuple(peers)
        if self.rank in self.peers:
            raise ValueError(f"TorchTransport: rank {self.rank} lists itself as a peer")
        backend = str(dist.get_backend(group))
        if "gloo" not in backend:
            raise ValueError(
                f"TorchTransport: its messages go over gloo in host memory, but the "
                f"{'given' if group is not None else 'default'} group's backend is {backend}: pass "
                "a gloo group (dist.new_group(backend='gloo')); NCCL point-to-point with one peer "
                "shares one stream, where the receive this transport keeps posted would hold back "
                "every send")
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()  # a header and its payload go out back to back
        self._unclaimed: dict[tuple[int, int], collections.deque] = collections.defaultdict(
            collections.deque)
        self._posted: dict[tuple[int, int], collections.deque] = collections.defaultdict(
            collections.deque)
        self._closed = False
        self._links = {peer: _PeerLink(self, peer) for peer in self.peers}

    def _check_peer(self, call: str, peer: int, tag: int) -> None:
        if self._closed:
            raise TransportError(f"{call}(peer={peer}, tag={tag}): transport is closed")
        if peer not in self._links:
            raise ValueError(f"{call}(peer={peer}, tag={tag}): rank {peer} is not a peer of this "
                             f"transport (peers: {list(self.peers)})")
        if not 0 <= tag < END_OF_STREAM_TAG:
            raise ValueError(f"{call}(peer={peer}, tag={tag}): tags are in [0, 2**63 - 1)")

    def use_device_in_this_thread(self) -> None:
        """A new thread's current CUDA device is 0: pinned buffers and events are made for ours."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def _post(self, header: torch.Tensor, payload: torch.Tensor, peer: int) -> list:
        with self._send_lock:  # a header and its payload go out back to back
            works = [dist.isend(header, dst=peer, group=self.group)]
            if payload.numel() > 0:
                works.append(dist.isend(_as_bytes(payload), dst=peer, group=self.group))
        return works

    def _post_send(self, source: torch.Tensor, peer: int, tag: int) -> TorchHandle:
        header = torch.frombuffer(bytearray(codec.encode_header(source, tag, self.rank)),
                                  dtype=torch.uint8)
        handle = TorchHandle(self, peer, tag, is_send=True)
        payload, in_host_memory = self.staging.to_host(source)
        # Staged sends are posted by the peer's send thread, in the order they were made.
        works = self._post(header, payload, peer) if in_host_memory is None else None
        self._links[peer].sends.put((handle, works, (header, payload, in_host_memory)))
        return handle

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> TorchHandle:
        self._check_peer("torch_transport.isend", peer, tag)
        return self._post_send(tensor.detach().contiguous(), peer, tag)

    def irecv(self, peer: int, tag: int) -> TorchHandle:
        self._check_peer("torch_transport.irecv", peer, tag)
        handle = TorchHandle(self, peer, tag, is_send=False)
        with self._cond:
            waiting = self._unclaimed.get((peer, tag))
            if waiting:
                handle._tensor = waiting.popleft()
                handle._done = True
            else:
                self._posted[(peer, tag)].append(handle)
        return handle

    def _deliver(self, peer: int, tag: int, tensor: torch.Tensor) -> None:
        with self._cond:
            posted = self._posted.get((peer, tag))
            if posted:
                handle = posted.popleft()
                handle._tensor = tensor
                handle._done = True
            else:
                self._unclaimed[(peer, tag)].append(tensor)
            self._cond.notify_all()

    def _done_or_raise(self, handle: TorchHandle) -> bool:
        """Lock held."""
        if handle._done:
            return True
        link = self._links[handle.peer]
        call = "torch_transport.isend" if handle.is_send else "torch_transport.irecv"
        if link.error is not None:
            raise PeerLostError(f"{call}(peer={handle.peer}, tag={handle.tag}): the link to peer "
                                f"{handle.peer} failed: {link.error}") from link.error
        if link.ended and not handle.is_send:
            raise PeerLostError(f"{call}(peer={handle.peer}, tag={handle.tag}): peer closed its "
                                "transport without sending this message")
        return False

    def wait_any(self, handles: Sequence[TorchHandle], timeout: Optional[float] = None) -> int:
        limit = self.timeout_s if timeout is None else timeout
        return wait_any_on_condition("torch_transport", self._cond, handles, self._done_or_raise,
                                     limit)

    def test_any(self, handles: Sequence[TorchHandle]) -> int:
        return test_any_under_lock("torch_transport", self._cond, handles, self._done_or_raise)

    def close(self) -> None:
        """Collective with the peers: sends end-of-stream to each, waits for theirs and joins the
        threads, so no receive is left posted when the process group is destroyed."""
        if self._closed:
            return
        marker = torch.zeros(0)
        ends = [self._post_send(marker, peer, END_OF_STREAM_TAG) for peer in self.peers]
        deadline = time.monotonic() + self.timeout_s
        for link in self._links.values():
            link.receiver.join(max(0.0, deadline - time.monotonic()))
            if link.receiver.is_alive():
                raise TransportTimeout(f"torch_transport.close: peer {link.peer} did not close within "
                                       f"{self.timeout_s} s; call close() on every rank")
        for handle in ends:
            handle.wait(max(0.0, deadline - time.monotonic()))
        for link in self._links.values():
            link.sends.put(None)
            link.completer.join(max(0.0, deadline - time.monotonic()))
        self._closed = True
