"""Picks a transport per peer: same node -> shm_tensor, other node (or --p2p-transport torch) ->
torch.distributed. `make_transport` is collective: every rank calls it once, in the same order."""
from __future__ import annotations

import itertools
import socket
import time
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_dpp.comm.torch_transport import TorchTransport
from megatron_dpp.comm.transport import Transport, TransportHandle

TRANSPORT_KINDS = ("torch", "shm")
_instance_counter = itertools.count()


class RoutedTransport:
    """One Transport over several: every message to or from a peer goes through that peer's route."""

    def __init__(self, routes: dict[int, Transport], owned: Sequence[Transport],
                 timeout_s: float = 300.0) -> None:
        self._routes = dict(routes)
        self._transports = list(owned)  # closed by close(), even those no peer routes to
        self.timeout_s = timeout_s

    def route(self, peer: int) -> Transport:
        try:
            return self._routes[peer]
        except KeyError:
            raise ValueError(f"transport: rank {peer} is not a peer (peers: {sorted(self._routes)})"
                             ) from None

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> TransportHandle:
        return self.route(peer).isend(tensor, peer, tag)

    def irecv(self, peer: int, tag: int) -> TransportHandle:
        return self.route(peer).irecv(peer, tag)

    def wait_any(self, handles: Sequence[TransportHandle], timeout: Optional[float] = None) -> int:
        if not handles:
            raise ValueError("transport.wait_any: no handles given")
        groups: dict[int, tuple[Transport, list[int]]] = {}
        for index, handle in enumerate(handles):
            transport = self.route(handle.peer)
            groups.setdefault(id(transport), (transport, []))[1].append(index)
        if len(groups) == 1:
            (transport, indices), = groups.values()
            return indices[transport.wait_any(handles, timeout)]
        # Handles of several transports: each transport blocks in turn for a short slice.
        limit = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            for transport, indices in groups.values():
                try:
                    found = transport.wait_any([handles[i] for i in indices], timeout=1e-3)
                except TimeoutError:
                    continue
                return indices[found]
            if time.monotonic() >= deadline:
                first = handles[0]
                raise TimeoutError(f"transport.wait(peer={first.peer}, tag={first.tag}): timed out "
                                   f"after {limit} s waiting for {len(handles)} handles")

    def close(self) -> None:
        for transport in self._transports:
            transport.close()


def _default_store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def _node_of_every_rank(store: dist.Store, prefix: str, rank: int, world_size: int,
                        timeout_s: float) -> list[str]:
    store.set(f"{prefix}/host/{rank}", socket.gethostname())
    keys = [f"{prefix}/host/{r}" for r in range(world_size)]
    store.wait(keys, timedelta(seconds=timeout_s))
    return [store.get(key).decode() for key in keys]


def pipeline_neighbors() -> list[int]:
    """Global ranks of the previous and next pipeline stage (Megatron's ring), without self."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() <= 1:
        return []
    rank = dist.get_rank()
    neighbors = {parallel_state.get_pipeline_model_parallel_prev_rank(),
                 parallel_state.get_pipeline_model_parallel_next_rank()}
    neighbors.discard(rank)
    return sorted(neighbors)


def make_transport(kind: str, peers: Optional[Sequence[int]] = None, *, shm_config=None,
                   timeout_s: float = 300.0, device: Optional[torch.device] = None,
                   store: Optional[dist.Store] = None) -> Transport:
    """A Transport for `peers` (default: this rank's pipeline neighbours).

    kind "torch": torch.distributed for every peer. kind "shm": shm_tensor for peers on this node,
    torch.distributed for the others. Collective over the whole default process group.
    """
    if kind not in TRANSPORT_KINDS:
        raise ValueError(f"unknown transport kind {kind!r}; pick one of {TRANSPORT_KINDS}")
    if peers is None:
        peers = pipeline_neighbors()
    peers = sorted(set(peers))
    if device is None:
        # The torch.distributed route (every peer, or the other nodes' under "shm") moves its bytes
        # on the backend's device; shm_tensor takes CPU and CUDA tensors as they come.
        device = torch.device("cuda", torch.cuda.current_device()) if (
            dist.get_backend() == "nccl") else torch.device("cpu")
    if kind == "torch":
        return TorchTransport(peers, device=device, timeout_s=timeout_s)

    import shm_tensor

    store = store if store is not None else _default_store()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    prefix = f"megatron_dpp/transport{next(_instance_counter)}"
    nodes = _node_of_every_rank(store, prefix, rank, world_size, timeout_s)
    local = [p for p in peers if nodes[p] == nodes[rank]]
    remote = [p for p in peers if nodes[p] != nodes[rank]]
    config = shm_config if shm_config is not None else shm_tensor.ShmConfig(timeout_s=timeout_s)
    context = shm_tensor.create_context_with_store(store, rank=rank, world_size=world_size,
                                                   peers=local, config=config,
                                                   prefix=f"{prefix}/shm",
                                                   rendezvous_timeout_s=timeout_s)
    routes: dict[int, Transport] = {peer: context for peer in local}
    owned: list[Transport] = [context]
    if remote:
        fallback = TorchTransport(remote, device=device, timeout_s=timeout_s)
        routes.update({peer: fallback for peer in remote})
        owned.append(fallback)
    return RoutedTransport(routes, owned, timeout_s=timeout_s)
