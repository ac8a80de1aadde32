"""The typed API over rdma_tensor._C: Context, Handle, and the rendezvous over a torch Store."""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Optional, Sequence

import torch

from rdma_tensor import _C
from rdma_tensor.config import RdmaConfig
from rdma_tensor.staging import DeviceStaging, PendingSend, SendPoster

HEADER_BYTES = _C.HEADER_BYTES
ucx_version = _C.ucx_version
# How long wait_any sleeps at a time while some of its sends are not posted yet.
_SLICE_S = 1e-3


def _to_c(settings: RdmaConfig) -> "_C.ContextConfig":
    settings.validate()
    config = _C.ContextConfig()
    config.timeout_s = float(settings.timeout_s)
    config.pool_cache_bytes = int(settings.pool_cache_bytes)
    config.close_timeout_s = float(settings.close_timeout_s)
    config.spin_us = float(settings.spin_us)
    return config


def _timeout_arg(timeout: Optional[float]) -> float:
    return -1.0 if timeout is None else float(timeout)


class Handle:
    """One outstanding isend or irecv. Received tensors arrive in host memory; a context made for a
    CUDA device moves them there in wait(). A GPU tensor's send waits in the context's poster
    (rdma_tensor.staging) until its bytes are in host memory, then is posted like any other."""

    __slots__ = ("_handle", "_device", "_pending", "_poster", "_timeout_s")

    def __init__(self, handle: Optional["_C.Handle"], device: Optional[torch.device],
                 pending: Optional[PendingSend] = None, poster: Optional[SendPoster] = None,
                 timeout_s: float = 0.0) -> None:
        self._handle = handle
        self._device = device
        self._pending = pending  # a staged send, until the poster has posted it
        self._poster = poster
        self._timeout_s = timeout_s  # the context's, for a staged send's wait without a timeout

    @property
    def peer(self) -> int:
        return self._pending.peer if self._pending is not None else self._handle.peer

    @property
    def tag(self) -> int:
        return self._pending.tag if self._pending is not None else self._handle.tag

    @property
    def is_send(self) -> bool:
        return self._pending is not None or self._handle.is_send

    def _posted(self) -> Optional["_C.Handle"]:
        """The compiled handle; None while the send waits in the poster. Raises what posting it
        raised."""
        if self._pending is not None:
            with self._poster.changed:
                if not self._pending.settled:
                    return None
                if self._pending.error is not None:
                    raise self._pending.error
                self._handle, self._pending = self._pending.handle, None
        return self._handle

    def _wait_posted(self, deadline: float, limit_s: float) -> "_C.Handle":
        with self._poster.changed:
            while not self._pending.settled:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise _C.TransportTimeout(
                        f"rdma_tensor.isend(peer={self.peer}, tag={self.tag}): timed out after "
                        f"{limit_s} s waiting for the tensor's copy from the device to host memory")
                self._poster.changed.wait(remaining)
        return self._posted()

    def test(self) -> bool:
        """True once complete (the progress thread completes handles); raises on a lost peer."""
        handle = self._posted()
        return handle is not None and handle.test()

    def wait(self, timeout: Optional[float] = None) -> Optional[torch.Tensor]:
        """The received tensor, or None for a send. TransportTimeout after `timeout` seconds (None:
        the context's timeout_s), naming the peer rank, its node address and the tag."""
        if self._pending is not None:
            limit = self._timeout_s if timeout is None else timeout
            deadline = time.monotonic() + limit
            posted = self._wait_posted(deadline, limit)
            posted.wait(max(deadline - time.monotonic(), 1e-6))
            return None
        tensor = self._handle.wait(_timeout_arg(timeout))
        if tensor is None or self._handle.is_send:
            return None
        if self._device is not None and self._device.type == "cuda":
            # Pinned host staging: the host-to-device copy goes by DMA from page-locked memory
            # (torch's cached pinned allocator keeps the buffer until the copy has run).
            return tensor.pin_memory().to(self._device, non_blocking=True)
        return tensor

    def __repr__(self) -> str:
        kind = "send to" if self.is_send else "recv from"
        return f"<rdma_tensor.Handle {kind} {self.peer} tag {self.tag}>"


class Context:
    """The UCX endpoints of one process towards its peers on other nodes."""

    def __init__(self, context: "_C.Context", peers: Sequence[int], config: RdmaConfig,
                 device: Optional[torch.device], staging: Optional[DeviceStaging] = None) -> None:
        self._context = context
        self.peers = tuple(peers)
        self.config = config
        self.device = device
        self._staging = staging if staging is not None else DeviceStaging()
        self._poster: Optional[SendPoster] = None  # started by the first staged send

    @property
    def rank(self) -> int:
        return self._context.rank

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle:
        """Returns at once; the caller may reuse the tensor then (a host tensor is copied into a
        registered buffer before isend returns; a GPU tensor's copy to page-locked memory is queued
        on its stream, ahead of whatever the caller queues next). The handle completes when UCX is
        done with the message."""
        staged, ready = self._staging.to_host(tensor)
        if ready is None and (self._poster is None or not self._poster.busy()):
            return Handle(self._context.isend(staged, peer, tag), self.device)
        if self._poster is None:
            self._poster = SendPoster(self._context.isend, f"rdma_tensor poster {self.rank}")
        pending = PendingSend(peer, tag, staged, ready)
        self._poster.queue(pending)
        return Handle(None, self.device, pending, self._poster, self.config.timeout_s)

    def irecv(self, peer: int, tag: int) -> Handle:
        return Handle(self._context.irecv(peer, tag), self.device)

    def _posted(self, handles: Sequence[Handle]) -> tuple[list[int], list["_C.Handle"]]:
        """(indices, compiled handles) of the handles posted so far."""
        indices, posted = [], []
        for index, handle in enumerate(handles):
            compiled = handle._posted()
            if compiled is not None:
                indices.append(index)
                posted.append(compiled)
        return indices, posted

    def wait_any(self, handles: Sequence[Handle], timeout: Optional[float] = None) -> int:
        if not handles:
            raise ValueError("rdma_tensor.wait_any: no handles given")
        if self._poster is None:  # no staged send ever: every handle is a compiled one
            return self._context.wait_any([h._handle for h in handles], _timeout_arg(timeout))
        indices, posted = self._posted(handles)
        if len(posted) == len(handles):
            return self._context.wait_any(posted, _timeout_arg(timeout))
        # Some sends still wait for their device copies: wait in slices, so that a send posted
        # meanwhile (or one that completes) ends the wait.
        limit = self.config.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                first = handles[0]
                raise _C.TransportTimeout(
                    f"rdma_tensor.wait(peer={first.peer}, tag={first.tag}): timed out after "
                    f"{limit} s waiting for {len(handles)} handles (sends among them still "
                    f"waiting for their copies from the device)")
            if posted:
                try:
                    return indices[self._context.wait_any(posted, min(remaining, _SLICE_S))]
                except _C.TransportTimeout:
                    pass
            else:
                with self._poster.changed:
                    self._poster.changed.wait(min(remaining, _SLICE_S))
            indices, posted = self._posted(handles)

    def test_any(self, handles: Sequence[Handle]) -> int:
        """Index of a completed handle, or -1; never waits. Raises on a lost peer, as test() does."""
        if not handles:
            raise ValueError("rdma_tensor.test_any: no handles given")
        if self._poster is None:  # the runtime's poll, every turn: no per-handle Python on CPU jobs
            return self._context.test_any([h._handle for h in handles])
        indices, posted = self._posted(handles)
        if not posted:
            return -1
        found = self._context.test_any(posted)
        return -1 if found < 0 else indices[found]

    def endpoint_info(self, peer: int) -> str:
        """UCX's description of the link to `peer`: lanes, transports and devices (ucp_ep_print_info)."""
        return self._context.endpoint_info(peer)

    def peer_description(self, peer: int) -> str:
        return self._context.peer_description(peer)

    def buffer_registrations(self) -> int:
        """Host buffers registered with UCX so far (each one once; they are recycled)."""
        return self._context.buffer_registrations()

    def _send_raw(self, payload: bytes, peer: int, tag: int = 0) -> Handle:
        """Sends `payload` verbatim as one message (tests of the receiver's header checks)."""
        return Handle(self._context.send_raw(payload, peer, tag), self.device)

    def close(self) -> None:
        """Posts the staged sends still queued, cancels receives under way, flushes and closes the
        links (force mode for failed peers), joins the threads. Call it on every rank after the
        last message."""
        try:
            if self._poster is not None:
                self._poster.close()
        finally:
            self._context.close()

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _wait_keys(store: torch.distributed.Store, keys: list[str], timeout_s: float, what: str) -> None:
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError as error:
        raise TimeoutError(f"rdma_tensor rendezvous: waited {timeout_s} s for {what}: {error}") from error


def create_context_with_store(
    store: torch.distributed.Store,
    *,
    rank: int,
    world_size: int,
    peers: Sequence[int],
    node_address: str,
    config: RdmaConfig = RdmaConfig(),
    prefix: str = "rdma_tensor",
    rendezvous_timeout_s: float = 120.0,
    device: Optional[torch.device] = None,
    staging: Optional[DeviceStaging] = None,
) -> Context:
    """Collective over `rank` and its `peers` (only they wait for each other): publishes this
    worker's UCX address and `node_address` (this node's address, for error messages) in `store`,
    connects an endpoint to each peer, and waits until every peer has done the same.
    `device`: where received tensors go (None or CPU: they stay in host memory). `staging`: how
    sends reach host memory (rdma_tensor.staging.DeviceStaging; tests give a stand-in)."""
    peers = sorted(set(int(p) for p in peers))
    if rank in peers or any(not 0 <= p < world_size for p in peers):
        raise ValueError(f"rdma_tensor: peers {peers} must be ranks of 0..{world_size - 1} other than {rank}")
    context = _C.Context(rank, node_address, _to_c(config))
    try:
        store.set(f"{prefix}/address/{rank}", context.worker_address)
        store.set(f"{prefix}/node/{rank}", node_address)
        _wait_keys(store, [f"{prefix}/address/{p}" for p in peers] + [f"{prefix}/node/{p}" for p in peers],
                   rendezvous_timeout_s, f"the UCX addresses of ranks {peers}")
        addresses = {p: (store.get(f"{prefix}/address/{p}"), store.get(f"{prefix}/node/{p}").decode())
                     for p in peers}
        context.connect(addresses)
        store.set(f"{prefix}/connected/{rank}", "1")
        _wait_keys(store, [f"{prefix}/connected/{p}" for p in peers], rendezvous_timeout_s,
                   f"ranks {peers} to connect")
    except BaseException:
        context.close()
        raise
    return Context(context, peers, config, device, staging)
