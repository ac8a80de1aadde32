"""The typed API over rdma_tensor._C: Context, Handle, and the rendezvous over a torch Store."""
from __future__ import annotations

from datetime import timedelta
from typing import Optional, Sequence

import torch

from rdma_tensor import _C
from rdma_tensor.config import RdmaConfig

HEADER_BYTES = _C.HEADER_BYTES
ucx_version = _C.ucx_version


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
    CUDA device moves them there in wait()."""

    __slots__ = ("_handle", "_device")

    def __init__(self, handle: "_C.Handle", device: Optional[torch.device]) -> None:
        self._handle = handle
        self._device = device

    @property
    def peer(self) -> int:
        return self._handle.peer

    @property
    def tag(self) -> int:
        return self._handle.tag

    @property
    def is_send(self) -> bool:
        return self._handle.is_send

    def test(self) -> bool:
        """True once complete (the progress thread completes handles); raises on a lost peer."""
        return self._handle.test()

    def wait(self, timeout: Optional[float] = None) -> Optional[torch.Tensor]:
        """The received tensor, or None for a send. TransportTimeout after `timeout` seconds (None:
        the context's timeout_s), naming the peer rank, its node address and the tag."""
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
                 device: Optional[torch.device]) -> None:
        self._context = context
        self.peers = tuple(peers)
        self.config = config
        self.device = device

    @property
    def rank(self) -> int:
        return self._context.rank

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle:
        """Copies `tensor` (any device, any layout) into a registered host buffer before it returns:
        the caller may reuse the tensor at once. The handle completes when UCX is done with it.
        A GPU tensor is first copied to pinned host memory (UCX here has no CUDA support)."""
        if tensor.is_cuda:
            staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            staged.copy_(tensor)  # waits for the current stream: the tensor is complete
            tensor = staged
        return Handle(self._context.isend(tensor, peer, tag), self.device)

    def irecv(self, peer: int, tag: int) -> Handle:
        return Handle(self._context.irecv(peer, tag), self.device)

    def wait_any(self, handles: Sequence[Handle], timeout: Optional[float] = None) -> int:
        return self._context.wait_any([h._handle for h in handles], _timeout_arg(timeout))

    def test_any(self, handles: Sequence[Handle]) -> int:
        """Index of a completed handle, or -1; never waits. Raises on a lost peer, as test() does."""
        return self._context.test_any([h._handle for h in handles])

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
        """Cancels receives under way, flushes and closes the links (force mode for failed peers),
        joins the progress thread. Call it on every rank after the last message."""
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
) -> Context:
    """Collective over `rank` and its `peers` (only they wait for each other): publishes this
    worker's UCX address and `node_address` (this node's address, for error messages) in `store`,
    connects an endpoint to each peer, and waits until every peer has done the same.
    `device`: where received tensors go (None or CPU: they stay in host memory)."""
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
    return Context(context, peers, config, device)
