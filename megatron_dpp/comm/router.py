"""Picks a transport per peer from a table of routes. `make_transport` is collective: every rank
calls it once, in the same order.

A route table lists (which peers, which transport) rows; each peer takes the first row that serves
it and whose transport can run here. `--p2p-transport auto` (the default): peers on this node ->
shm_tensor, peers on other nodes -> rdma_tensor, torch.distributed only where neither can run.
`shm`: same node -> shm_tensor, the rest -> torch.distributed. `rdma`: every peer -> rdma_tensor.
`torch`: every peer -> torch.distributed (no compiled transport is imported). Each rank logs one
line per peer: the route it got and why.

Which node a rank is on: with --multi-node, its node rank (torchrun's GROUP_RANK) and that node's
--node-ips address; otherwise its host name. (Host names cannot tell nodes apart when they are
network namespaces of one machine, as in the tests; node ranks can.)
"""
from __future__ import annotations

import itertools
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_dpp.comm.defaults import DEFAULT_TRANSPORT_KIND, TRANSPORT_KINDS  # noqa: F401
from megatron_dpp.comm.errors import TransportTimeout
from megatron_dpp.comm.nodes import this_node_rank
from megatron_dpp.comm.torch_transport import TorchTransport
from megatron_dpp.comm.transport import DEFAULT_TIMEOUT_S, Transport, TransportHandle

_instance_counter = itertools.count()


class RouteError(ValueError):
    """No transport can serve a peer, or two ranks would reach each other differently: a setup
    problem (what is installed where, or the flags), said in one line before any message moves."""


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

    def _by_transport(self, handles: Sequence[TransportHandle],
                      call: str) -> dict[int, tuple[Transport, list[int]]]:
        """The handles' indices grouped by the transport of their peer."""
        if not handles:
            raise ValueError(f"transport.{call}: no handles given")
        groups: dict[int, tuple[Transport, list[int]]] = {}
        for index, handle in enumerate(handles):
            transport = self.route(handle.peer)
            groups.setdefault(id(transport), (transport, []))[1].append(index)
        return groups

    def test_any(self, handles: Sequence[TransportHandle]) -> int:
        groups = self._by_transport(handles, "test_any")
        if len(groups) == 1:
            (transport, indices), = groups.values()
            found = transport.test_any(handles)
            return -1 if found < 0 else indices[found]
        for transport, indices in groups.values():
            found = transport.test_any([handles[i] for i in indices])
            if found >= 0:
                return indices[found]
        return -1

    def wait_any(self, handles: Sequence[TransportHandle], timeout: Optional[float] = None) -> int:
        groups = self._by_transport(handles, "wait_any")
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


@dataclass(frozen=True)
class NodeIdentity:
    """Where a rank runs: `node` tells nodes apart, `address` is what error messages and logs show."""

    node: str
    address: str


def this_node(node_ips: Optional[Sequence[str]] = None) -> NodeIdentity:
    """This process's node: with --node-ips, node rank (torchrun's GROUP_RANK) and its address;
    otherwise the host name for both."""
    if node_ips:
        node_rank = this_node_rank()
        return NodeIdentity(f"node {node_rank}", node_ips[node_rank])
    host = socket.gethostname()
    return NodeIdentity(host, host)


def read_every_rank(store: dist.Store, prefix: str, world_size: int, timeout_s: float,
                    what: str) -> list[bytes]:
    """The value every rank wrote under `prefix`/RANK, in one request (key by key, 4096 ranks would
    make 16.8 million); TransportTimeout naming the ranks that wrote none within `timeout_s`."""
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError as error:  # the store's own says only "Wait timeout"
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        shown = ", ".join(map(str, missing[:16])) + (", ..." if len(missing) > 16 else "")
        raise TransportTimeout(f"transport: waited {timeout_s} s for {what} of ranks [{shown}] "
                               f"({len(missing)} of {world_size}); every rank builds its "
                               "transport at the same point: is one of them stuck or gone?") from error
    return store.multi_get(keys)


def _node_of_every_rank(store: dist.Store, prefix: str, rank: int, world_size: int,
                        timeout_s: float, mine: NodeIdentity) -> list[NodeIdentity]:
    store.set(f"{prefix}/node/{rank}", f"{mine.node}\n{mine.address}")
    values = read_every_rank(store, f"{prefix}/node", world_size, timeout_s, "the node")
    return [NodeIdentity(*value.decode().split("\n", 1)) for value in values]


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
    nodes: Optional[list[NodeIdentity]]  # node of every rank; None when no route asks for it
    store: Optional[dist.Store]
    prefix: str  # a key prefix unique to this make_transport call
    device: torch.device
    timeout_s: float
    shm_config: object = None
    rdma_config: object = None
    # The largest pipeline message (one activation), when known: shm_tensor needs it to fit a slot.
    max_message_bytes: Optional[int] = None
    # The gloo group the torch.distributed route moves its bytes in (None: the default group).
    host_group: Optional[dist.ProcessGroup] = None


def _same_node(setup: RouteSetup, peer: int) -> bool:
    return setup.nodes[peer].node == setup.nodes[setup.rank].node


def _other_node(setup: RouteSetup, peer: int) -> bool:
    return not _same_node(setup, peer)


def _any_peer(_setup: RouteSetup, _peer: int) -> bool:
    return True


def _shm_unavailable(setup: RouteSetup) -> str:
    """Why shm_tensor cannot carry this job's messages here; "" when it can."""
    import importlib.util

    if importlib.util.find_spec("shm_tensor._C") is None:
        return "shm_tensor._C is not built"
    from shm_tensor.config import ShmConfig

    slot_bytes = (setup.shm_config or ShmConfig()).slot_bytes
    too_large = setup.max_message_bytes is not None and setup.max_message_bytes > slot_bytes
    if setup.device.type == "cuda":
        import shm_tensor

        problem = shm_tensor.cuda_runtime_error()
        if problem:
            return "the CUDA runtime does not load for CUDA IPC: " + problem.replace("\n", " ")
        # Device messages go direct, with no slot cap, unless their memory cannot be exported.
        if too_large and _expandable_segments():
            return (f"one activation ({setup.max_message_bytes} B) exceeds a shm slot ({slot_bytes} "
                    "B) and torch's expandable segments cannot be exported by CUDA IPC (raise "
                    "--shm-slot-mb, or drop expandable_segments from PYTORCH_CUDA_ALLOC_CONF)")
        return ""
    if too_large:
        return (f"one activation ({setup.max_message_bytes} B) exceeds a shm slot ({slot_bytes} B; "
                "raise --shm-slot-mb to use shm_tensor)")
    return ""


def _expandable_segments() -> bool:
    """torch's caching allocator maps its memory with cuMemCreate (not exportable by
    cudaIpcGetMemHandle) when expandable_segments is on."""
    settings = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    return "expandable_segments:true" in settings.replace(" ", "").lower()


def _rdma_unavailable(_setup: RouteSetup) -> str:
    import rdma_tensor

    return rdma_tensor.unavailable_reason()


def _always_available(_setup: RouteSetup) -> str:
    return ""


def _build_torch(setup: RouteSetup, peers: list[int]) -> Transport:
    return TorchTransport(peers, group=setup.host_group, device=setup.device,
                          timeout_s=setup.timeout_s)


def _needs_host_group(table: Sequence[Route]) -> bool:
    """The torch.distributed route moves host memory over gloo; a job whose default group is not
    gloo (NCCL on GPUs) gets a gloo group for it, made by every rank whether or not it uses it."""
    return any(route.build is _build_torch for route in table) and (
        "gloo" not in str(dist.get_backend()))


def _build_rdma(setup: RouteSetup, peers: list[int]) -> Transport:
    import rdma_tensor  # only when a route to another node uses it

    config = setup.rdma_config if setup.rdma_config is not None else rdma_tensor.RdmaConfig(
        timeout_s=setup.timeout_s)
    return rdma_tensor.create_context_with_store(
        setup.store, rank=setup.rank, world_size=setup.world_size, peers=peers,
        node_address=setup.nodes[setup.rank].address, config=config, prefix=f"{setup.prefix}/rdma",
        rendezvous_timeout_s=setup.timeout_s, device=setup.device)


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
    transport: str  # what the log calls it
    serves: Callable[[RouteSetup, int], bool]
    build: Callable[[RouteSetup, list[int]], Transport]
    # "" when the transport can run here; else why not (the peer then takes a later row).
    unavailable: Callable[[RouteSetup], str] = _always_available
    needs_nodes: bool = False  # serves() reads RouteSetup.nodes
    # Built on every rank even when it serves no peer there: its setup is collective.
    collective: bool = False


# shm_tensor's rendezvous runs over every rank of the job, so every rank builds it.
SAME_NODE_SHM = Route("same node", "shm_tensor", _same_node, _build_shm, _shm_unavailable,
                      needs_nodes=True, collective=True)
# rdma_tensor's rendezvous runs between each rank and its peers only.
OTHER_NODE_RDMA = Route("other node", "rdma_tensor", _other_node, _build_rdma, _rdma_unavailable,
                        needs_nodes=True)
ANY_PEER_RDMA = Route("--p2p-transport rdma", "rdma_tensor", _any_peer, _build_rdma,
                      _rdma_unavailable, needs_nodes=True)
FALLBACK_TORCH = Route("fallback", "torch.distributed", _any_peer, _build_torch)

# --p2p-transport value -> its route table, first available match wins.
ROUTE_TABLES: dict[str, tuple[Route, ...]] = {
    "auto": (SAME_NODE_SHM, OTHER_NODE_RDMA, FALLBACK_TORCH),
    "torch": (FALLBACK_TORCH,),
    "shm": (SAME_NODE_SHM, FALLBACK_TORCH),
    "rdma": (ANY_PEER_RDMA,),
}
assert tuple(ROUTE_TABLES) == TRANSPORT_KINDS, "defaults.TRANSPORT_KINDS names each table once"


@dataclass(frozen=True)
class Assignment:
    """A peer's route and why: the row that took it, and the rows it skipped with their reasons."""

    route: Route
    skipped: tuple[str, ...] = ()

    def reason(self) -> str:
        why = self.route.name
        if self.skipped:
            why += "; " + "; ".join(self.skipped)
        return why


def unavailable_routes(table: Sequence[Route], setup: RouteSetup) -> dict[str, str]:
    """Route name -> why its transport cannot run here ("" when it can)."""
    return {route.name: route.unavailable(setup) for route in table}


def assign_routes(table: Sequence[Route], setup: RouteSetup, peers: Sequence[int],
                  unavailable: Optional[dict[str, str]] = None) -> dict[int, Assignment]:
    """Each peer's route: the first row of `table` that serves it and can run here."""
    if unavailable is None:
        unavailable = unavailable_routes(table, setup)
    assignment = {}
    for peer in peers:
        skipped = []
        for route in table:
            if not route.serves(setup, peer):
                continue
            if unavailable[route.name]:
                skipped.append(f"{route.transport} not used: {unavailable[route.name]}")
                continue
            assignment[peer] = Assignment(route, tuple(skipped))
            break
        else:
            raise RouteError(f"transport: no route serves rank {peer}: " + ("; ".join(skipped) or
                             "the table ends without a fallback row"))
    return assignment


def agree_on_routes(setup: RouteSetup, table: Sequence[Route], assignment: dict[int, Assignment],
                    unavailable: dict[str, str]) -> None:
    """Before any transport is built, every rank checks its routes against its peers' (through the
    store, one request): both sides of a pair must pick the same transport, and a collective route
    must run on every rank or on none. Where nodes differ in what is installed (UCX on one node
    only, the CUDA runtime loadable on some), the ranks would otherwise wait out a rendezvous
    timeout; now each rank concerned raises one line naming the peer, its node and the reason."""
    record = {"peers": {str(peer): [chosen.route.transport, chosen.reason()]
                        for peer, chosen in assignment.items()},
              "collective": {route.transport: unavailable[route.name]
                             for route in table if route.collective}}
    setup.store.set(f"{setup.prefix}/routes/{setup.rank}", json.dumps(record))
    records = [json.loads(value) for value in read_every_rank(
        setup.store, f"{setup.prefix}/routes", setup.world_size, setup.timeout_s, "the routes")]

    def where(rank: int) -> str:
        return f"rank {rank} on {setup.nodes[rank].address}" if setup.nodes else f"rank {rank}"

    for peer, chosen in sorted(assignment.items()):
        theirs = records[peer]["peers"].get(str(setup.rank))
        if theirs is None:
            raise RouteError(f"transport: {where(setup.rank)} lists rank {peer} as a peer, but "
                             f"{where(peer)} does not list rank {setup.rank}: each side of a link "
                             "must list the other")
        if theirs[0] != chosen.route.transport:
            raise RouteError(
                f"transport: {where(setup.rank)} reaches rank {peer} by {chosen.route.transport} "
                f"({chosen.reason()}), but {where(peer)} reaches rank {setup.rank} by {theirs[0]} "
                f"({theirs[1]}): install the same transports on every node, or pick one with "
                "--p2p-transport")
    for transport in record["collective"]:
        missing = [(rank, other["collective"][transport]) for rank, other in enumerate(records)
                   if other["collective"][transport]]
        if missing and len(missing) < setup.world_size:
            rank, why = missing[0]
            runs_on = next(r for r, other in enumerate(records) if not other["collective"][transport])
            raise RouteError(
                f"transport: {transport} runs on {where(runs_on)} but not on {where(rank)} ({why}; "
                f"{len(missing)} of {setup.world_size} ranks cannot run it): every rank joins its "
                "rendezvous, so it must run on all or none; install the same on every node, or "
                "pick --p2p-transport torch")


def _log_routes(setup: RouteSetup, assignment: dict[int, Assignment]) -> None:
    for peer, chosen in sorted(assignment.items()):
        where = f" on {setup.nodes[peer].address}" if setup.nodes is not None else ""
        # One write, so that the ranks' lines do not interleave.
        sys.stderr.write(f"[transport rank {setup.rank}] peer {peer}{where}: "
                         f"{chosen.route.transport} ({chosen.reason()})\n")
        sys.stderr.flush()


def make_transport(kind: str, peers: Optional[Sequence[int]] = None, *, shm_config=None,
                   rdma_config=None, timeout_s: float = DEFAULT_TIMEOUT_S,
                   device: Optional[torch.device] = None, store: Optional[dist.Store] = None,
                   node_ips: Optional[Sequence[str]] = None, max_message_bytes: Optional[int] = None,
                   log: bool = True) -> Transport:
    """A Transport for `peers` (default: this rank's pipeline neighbours), routed by the table of
    `kind` (see ROUTE_TABLES). Collective over the whole default process group.
    `node_ips`: --node-ips (nodes told apart by node rank); `max_message_bytes`: the largest message
    (shm_tensor is skipped when it exceeds a slot); `log`: one line per peer on stderr."""
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
                       device=device, timeout_s=timeout_s, shm_config=shm_config,
                       rdma_config=rdma_config, max_message_bytes=max_message_bytes)
    if _needs_host_group(table):
        setup.host_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    if any(route.needs_nodes for route in table):
        # Every rank takes part, whatever its own peers are: the exchange is collective.
        setup.store = store if store is not None else _default_store()
        setup.nodes = _node_of_every_rank(setup.store, prefix, rank, world_size, timeout_s,
                                          this_node(node_ips))
    unavailable = unavailable_routes(table, setup)
    assignment = assign_routes(table, setup, peers, unavailable)
    if setup.store is not None:
        agree_on_routes(setup, table, assignment, unavailable)
    if log:
        _log_routes(setup, assignment)
    routes: dict[int, Transport] = {}
    owned: list[Transport] = []
    for route in table:
        served = [peer for peer in peers if assignment[peer].route is route]
        # A collective route is built on every rank that can run it (all ranks of one install can).
        if not served and not (route.collective and not unavailable[route.name]):
            continue
        transport = route.build(setup, served)
        owned.append(transport)
        routes.update({peer: transport for peer in served})
    if len(owned) == 1:
        return owned[0]
    return RoutedTransport(routes, owned, timeout_s=timeout_s)
