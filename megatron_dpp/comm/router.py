"""Picks a transport per peer from a table of routes. `make_transport` is collective: every rank
calls it once, in the same order.

A route table lists (which peers, which transport) rows; each peer takes the first row that
serves it. `--p2p-transport shm`: peers on this node -> shm_tensor, every other peer ->
torch.distributed. `--p2p-transport torch`: every peer -> torch.distributed (and shm_tensor is
never imported). A cross-node transport is one more row, before the fallback.
"""
from __future__ import annotations

import itertools
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_dpp.comm.errors import TransportTimeout
from megatron_dpp.comm.torch_transport import TorchTransport
from megatron_dpp.comm.transport import DEFAULT_TIMEOUT_S, Transport, TransportHandle

_instance_counter = itertools.count()


class RoutedTransport:
    """One Transport over several: every message to or from a peer goes through that peer's route."""

    def __init__(self, routes: dict[int, Transport], owned: Sequence[Transport],
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
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
                raise TransportTimeout(f"transport.wait(peer={first.peer}, tag={first.tag}): timed "
                                       f"out after {limit} s waiting for {len(handles)} handles")

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


@dataclass
class RouteSetup:
    """What building a route's transport needs: this rank, where every rank runs, the options."""

    rank: int
    world_size: int
    nodes: Optional[list[str]]  # host name of every rank; None when no route asks for it
    store: Optional[dist.Store]
    prefix: str  # a key prefix unique to this make_transport call
    device: torch.device
    timeout_s: float
    shm_config: object = None


def _same_node(setup: RouteSetup, peer: int) -> bool:
    return setup.nodes[peer] == setup.nodes[setup.rank]


def _any_peer(_setup: RouteSetup, _peer: int) -> bool:
    return True


def _build_torch(setup: RouteSetup, peers: list[int]) -> Transport:
    return TorchTransport(peers, device=setup.device, timeout_s=setup.timeout_s)


def _build_shm(setup: RouteSetup, peers: list[int]) -> Transport:
    import shm_tensor  # only when a route to a same-node peer uses it

    config = setup.shm_config if setup.shm_config is not None else shm_tensor.ShmConfig(
        timeout_s=setup.timeout_s)
    return shm_tensor.create_context_with_store(
        setup.store, rank=setup.rank, world_size=setup.world_size, peers=peers, config=config,
        prefix=f"{setup.prefix}/shm", rendezvous_timeout_s=setup.timeout_s)


@dataclass(frozen=True)
class Route:
    """One row of a route table: the peers it serves, and the transport they get."""

    name: str
    serves: Callable[[RouteSetup, int], bool]
    build: Callable[[RouteSetup, list[int]], Transport]
    needs_nodes: bool = False  # serves() reads RouteSetup.nodes
    # Built on every rank even when it serves no peer there: its setup is collective.
    collective: bool = False


# shm_tensor's rendezvous runs over every rank of the job, so every rank builds it.
SAME_NODE_SHM = Route("same node: shm_tensor", _same_node, _build_shm, needs_nodes=True,
                      collective=True)
FALLBACK_TORCH = Route("fallback: torch.distributed", _any_peer, _build_torch)

# --p2p-transport value -> its route table, first match wins.
ROUTE_TABLES: dict[str, tuple[Route, ...]] = {
    "torch": (FALLBACK_TORCH,),
    "shm": (SAME_NODE_SHM, FALLBACK_TORCH),
}
TRANSPORT_KINDS = tuple(ROUTE_TABLES)


def assign_routes(table: Sequence[Route], setup: RouteSetup, peers: Sequence[int]) -> dict[int, Route]:
    """Each peer's route: the first row of `table` that serves it."""
    assignment = {}
    for peer in peers:
        for route in table:
            if route.serves(setup, peer):
                assignment[peer] = route
                break
        else:
            raise ValueError(f"transport: no route serves rank {peer}; the table ends without a "
                             "fallback row")
    return assignment


def make_transport(kind: str, peers: Optional[Sequence[int]] = None, *, shm_config=None,
                   timeout_s: float = DEFAULT_TIMEOUT_S, device: Optional[torch.device] = None,
                   store: Optional[dist.Store] = None) -> Transport:
    """A Transport for `peers` (default: this rank's pipeline neighbours), routed by the table of
    `kind` (see ROUTE_TABLES). Collective over the whole default process group."""
    if kind not in ROUTE_TABLES:
        raise ValueError(f"unknown transport kind {kind!r}; pick one of {TRANSPORT_KINDS}")
    table = ROUTE_TABLES[kind]
    if peers is None:
        peers = pipeline_neighbors()
    peers = sorted(set(peers))
    if device is None:
        # The torch.distributed route moves its bytes on the backend's device; shm_tensor takes
        # CPU and CUDA tensors as they come.
        device = torch.device("cuda", torch.cuda.current_device()) if (
            dist.get_backend() == "nccl") else torch.device("cpu")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    prefix = f"megatron_dpp/transport{next(_instance_counter)}"
    setup = RouteSetup(rank=rank, world_size=world_size, nodes=None, store=None, prefix=prefix,
                       device=device, timeout_s=timeout_s, shm_config=shm_config)
    if any(route.needs_nodes for route in table):
        # Every rank takes part, whatever its own peers are: the exchange is collective.
        setup.store = store if store is not None else _default_store()
        setup.nodes = _node_of_every_rank(setup.store, prefix, rank, world_size, timeout_s)
    assignment = assign_routes(table, setup, peers)
    routes: dict[int, Transport] = {}
    owned: list[Transport] = []
    for route in table:
        served = [peer for peer in peers if assignment[peer] is route]
        if not served and not route.collective:
            continue
        transport = route.build(setup, served)
        owned.append(transport)
        routes.update({peer: transport for peer in served})
    if len(owned) == 1:
        return owned[0]
    return RoutedTransport(routes, owned, timeout_s=timeout_s)
