"""Heartbeats between every pair of ranks, beside the transports: a peer that stops answering is
named on every other rank within --heartbeat-timeout, whatever that rank was doing.

The transports notice at once a peer whose process died (its connections reset), but not one that
stops answering while it stays alive: the link between two nodes down, a node frozen, a process
stopped (SIGSTOP, a debugger). Their own timeouts must outlast the slowest healthy step, so they
are minutes long. Heartbeats tell a lost peer from a slow one in seconds: a busy rank still beats,
because its heartbeat thread runs while the main thread computes or waits (torch ops and the
transports release the GIL, and Python code gives it up every 5 ms).

Each rank binds one UDP socket on its node's address (its --node-ips entry; 127.0.0.1 on a
single node), publishes it in the torch.distributed store and reads every peer's. Then a thread
sends every peer one datagram per interval and reads theirs. A beat carries the sender's rank, a
random run id (datagrams of another job are ignored), a sequence number, and how long ago the
sender last heard from the receiver, so a rank sees both directions of each link:
- inbound: no beat from a peer for `timeout_s` (its process stopped, its node frozen, or the
  link down);
- outbound: the peer's beats arrive, but say that ours have not reached it for `timeout_s`.
Silence is counted only while this rank listens: if its own thread could not run for a while
(the process was stopped, or C code held the GIL), the clock of every peer starts again.

A lost peer ends in one call of `on_lost(LostPeer)`; training reports it (rank, node, address,
direction) and exits with exit_codes.LOST_PEER. A rank that leaves on purpose (training finished,
or every rank stops together) sends a few "bye" datagrams, and its peers stop watching it; a rank
that crashes sends none, and its peers name it once the timeout passes.

Cost: each rank sends world_size - 1 datagrams of 32 bytes per interval. Standard library only.
"""
from __future__ import annotations

import ipaddress
import json
import math
import os
import random
import select
import socket
import struct
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Callable, MutableMapping, Optional, Sequence

from megatron_dpp.comm.nodes import NODE_RANK_VARIABLE, NUM_NODES_VARIABLE, this_node_rank

DEFAULT_INTERVAL_S = 1.0
DEFAULT_TIMEOUT_S = 15.0
HEARTBEAT_OFF = 0.0
"""--heartbeat-timeout 0: no heartbeats (where the network between the nodes drops UDP)."""
MIN_BEATS_PER_TIMEOUT = 4
"""The timeout spans at least this many intervals: a few lost datagrams never end a job."""
BYE_REPEATS = 3  # UDP may drop one
LOOPBACK = "127.0.0.1"

INBOUND = "inbound"
OUTBOUND = "outbound"

_MAGIC = b"DPHB"
_BEAT = 1
_BYE = 2
# magic, kind, sender's rank, sender's run id, sequence number, milliseconds since the sender
# last heard from the receiver.
_PACKET = struct.Struct("!4sBxxxIQQI")
_MAX_MS = 0xFFFFFFFF
STORE_PREFIX = "megatron_dpp/heartbeat"


class HeartbeatError(RuntimeError):
    """Heartbeats could not start; the message is one line that says why."""


def check_heartbeat_settings(interval_s: float, timeout_s: float) -> None:
    """Raises ValueError (one line, in flag names) unless the interval is positive and the timeout
    is HEARTBEAT_OFF or spans at least MIN_BEATS_PER_TIMEOUT intervals."""
    if not (math.isfinite(interval_s) and interval_s > 0):
        raise ValueError(f"--heartbeat-interval must be positive seconds, got {interval_s:g}")
    if timeout_s == HEARTBEAT_OFF:
        return
    least = MIN_BEATS_PER_TIMEOUT * interval_s
    if not (math.isfinite(timeout_s) and timeout_s >= least):
        raise ValueError(f"--heartbeat-timeout must be at least {MIN_BEATS_PER_TIMEOUT} x "
                         f"--heartbeat-interval ({least:g} s), so that a few lost datagrams do not "
                         f"end the job, or 0 to turn heartbeats off; got {timeout_s:g}")


# ----------------------------------------------------------------------------------------------
# who is where
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PeerAddress:
    """Where a rank's heartbeats come from and go to, as it published them."""

    rank: int
    host: str
    port: int
    node: str  # "node 1" (torchrun's node rank), for reports
    pid: int
    run_id: int  # random per start: datagrams of another job or an earlier run are ignored

    def describe(self) -> str:
        return f"rank {self.rank} ({self.node}, {self.host})"

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @staticmethod
    def decode(data: bytes) -> "PeerAddress":
        return PeerAddress(**json.loads(data.decode()))


def heartbeat_host(node_ips: Optional[Sequence[str]],
                   environ: MutableMapping[str, str] = os.environ) -> str:
    """The address this rank's heartbeats use: its node's --node-ips entry; 127.0.0.1 when the job
    has one node; otherwise this machine's address on the route to MASTER_ADDR."""
    if node_ips:
        return node_ips[this_node_rank(environ)]
    if _single_node(environ):
        return LOOPBACK
    master = environ.get("MASTER_ADDR", "")
    try:
        return _address_towards(master)
    except OSError as error:
        raise HeartbeatError(f"heartbeat: no route to MASTER_ADDR={master!r} to pick this node's "
                             f"address ({error}); pass --multi-node --node-ips") from None


def node_label(environ: MutableMapping[str, str] = os.environ) -> str:
    """'node N' (torchrun's node rank), or the host name outside torchrun."""
    node_rank = environ.get(NODE_RANK_VARIABLE)
    return f"node {node_rank}" if node_rank is not None else socket.gethostname()


def _single_node(environ: MutableMapping[str, str]) -> bool:
    if environ.get(NUM_NODES_VARIABLE) is not None:
        return environ[NUM_NODES_VARIABLE] == "1"
    return environ.get("LOCAL_WORLD_SIZE") == environ.get("WORLD_SIZE")


def _address_towards(host: str) -> str:
    """This machine's source address for packets to `host` (connect() on a UDP socket picks the
    route and sends nothing)."""
    family, _type, _proto, _name, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return probe.getsockname()[0]


def bind_udp(host: str) -> socket.socket:
    """A UDP socket on `host`, at a port the kernel picks."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.bind((host, 0))
    except OSError as error:
        sock.close()
        raise HeartbeatError(f"heartbeat: cannot bind a UDP socket on {host}: {error}") from None
    return sock


# ----------------------------------------------------------------------------------------------
# what a lost peer looks like
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LostPeer:
    """A peer declared lost, and which direction of the link went silent."""

    peer: PeerAddress
    direction: str  # INBOUND or OUTBOUND
    silent_s: float
    beats_received: int
    send_error: Optional[str]  # the last error sending it a beat, if any
    interval_s: float
    timeout_s: float

    def reason(self) -> str:
        who = self.peer.describe()
        if self.direction == OUTBOUND:
            return (f"lost {who}: it hears us no longer (outbound: none of our heartbeats reached "
                    f"it for {self.silent_s:.1f} s)")
        return f"lost {who}: no heartbeat from it for {self.silent_s:.1f} s (inbound)"

    def state_lines(self) -> list[str]:
        peer = self.peer
        process = f"its process (pid {peer.pid} on {peer.node})"
        if self.direction == OUTBOUND:
            lines = [f"its heartbeats still arrive, so it runs; ours to {peer.host}:{peer.port} "
                     f"are lost on the way: the path towards {peer.node} drops packets (a "
                     f"firewall rule, a route, a half-broken link)"]
        elif self.beats_received == 0:
            lines = [f"none of its heartbeats ever arrived: the network between the nodes may "
                     f"drop UDP (to {peer.host}:{peer.port}); --heartbeat-timeout 0 turns "
                     f"heartbeats off"]
        elif ipaddress.ip_address(peer.host).is_loopback:  # on this node: no link to lose
            lines = [f"{process} is stopped or frozen (SIGSTOP, a debugger, or native code "
                     f"holding Python's GIL)"]
        else:
            lines = [f"{process} is stopped or frozen, {peer.node} hangs, or the link to "
                     f"{peer.host} is down"]
        if self.send_error:
            lines.append(f"sending it a heartbeat fails: {self.send_error}")
        lines.append(f"heartbeats every {self.interval_s:g} s; a peer is lost after "
                     f"{self.timeout_s:g} s without one (--heartbeat-interval, "
                     f"--heartbeat-timeout)")
        return lines


# ----------------------------------------------------------------------------------------------
# the heartbeat
# ----------------------------------------------------------------------------------------------
class _PeerState:
    """What this rank knows of one peer (touched by the heartbeat thread only)."""

    def __init__(self, now: float):
        self.last_heard = now  # when its last beat arrived (start counts as heard)
        self.beats = 0
        self.last_sequence = -1
        self.heard_us_ago_s = 0.0  # as its last beat said
        self.left = False  # it said bye
        self.send_error: Optional[str] = None


class Heartbeat:
    """Beats to `peers` every `interval_s` from its own thread, and calls `on_lost` once (from that
    thread) when one is silent for `timeout_s` in either direction. `close()` stops and joins the
    thread and says bye."""

    def __init__(self, sock: socket.socket, me: PeerAddress, peers: Sequence[PeerAddress],
                 interval_s: float, timeout_s: float, on_lost: Callable[[LostPeer], None]):
        check_heartbeat_settings(interval_s, timeout_s)
        if timeout_s == HEARTBEAT_OFF:
            raise ValueError("a Heartbeat needs a timeout; with heartbeats off, make none")
        self.me = me
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.lost: Optional[LostPeer] = None
        self._sock = sock
        self._sock.setblocking(False)
        self._peers = {peer.rank: peer for peer in peers}
        now = time.monotonic()
        self._state = {peer.rank: _PeerState(now) for peer in peers}
        self._on_lost = on_lost
        self._sequence = 0
        self._listening_since = now  # the end of this thread's last stall
        # The thread wakes every interval; a gap of two means it could not run (stopped, or
        # starved of the GIL), which is below the timeout (at least MIN_BEATS_PER_TIMEOUT).
        self._stall_s = 2 * interval_s
        self._stop = threading.Event()
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="dpp-heartbeat")
        self._thread.start()

    def close(self, say_bye: bool = True) -> None:
        """Stop and join the thread, then (say_bye) tell every peer that this rank leaves on
        purpose. A rank that fails closes without a bye: its peers then name it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake_writer.send(b"x")
        if threading.current_thread() is not self._thread:
            self._thread.join()
        if say_bye:
            for repeat in range(BYE_REPEATS):
                if repeat:
                    time.sleep(0.01)  # spread out: a burst is lost together
                self._send_all(_BYE, time.monotonic())
        self._sock.close()
        self._wake_reader.close()
        self._wake_writer.close()

    # ---- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        last_turn = time.monotonic()
        next_beat = last_turn
        while not self._stop.is_set():
            readable, _, _ = select.select([self._sock, self._wake_reader], [], [],
                                           max(0.0, next_beat - time.monotonic()))
            now = time.monotonic()
            if now - last_turn > self._stall_s:
                self._forgive_stall(now)
            last_turn = now
            if self._sock in readable:
                self._read_all(now)
            if now < next_beat:
                continue
            # Beat first: a peer whose beats stopped reaching us learns it from this one (outbound)
            # even when we now declare it lost and exit.
            self._send_all(_BEAT, now)
            next_beat = now + self.interval_s
            lost = self._first_lost(now)
            if lost is not None:
                self.lost = lost
                self._on_lost(lost)
                return

    def _forgive_stall(self, now: float) -> None:
        """This thread did not run for a while: what its peers did then is unknown, so their
        silence counts from now."""
        self._listening_since = now
        for state in self._state.values():
            state.last_heard = max(state.last_heard, now)

    def _read_all(self, now: float) -> None:
        while True:
            try:
                data = self._sock.recv(_PACKET.size + 1)
            except BlockingIOError:
                return
            except OSError:  # an ICMP error reported on the socket: nothing to read
                return
            self._receive(data, now)

    def _receive(self, data: bytes, now: float) -> None:
        if len(data) != _PACKET.size:
            return
        magic, kind, rank, run_id, sequence, heard_us_ago_ms = _PACKET.unpack(data)
        peer = self._peers.get(rank)
        if magic != _MAGIC or peer is None or run_id != peer.run_id:
            return  # not ours: another job, an earlier run, noise
        state = self._state[rank]
        if kind == _BYE:
            state.left = True
        elif kind == _BEAT and sequence > state.last_sequence:
            state.last_sequence = sequence
            state.last_heard = now
            state.beats += 1
            state.heard_us_ago_s = heard_us_ago_ms / 1000.0

    def _first_lost(self, now: float) -> Optional[LostPeer]:
        for rank in sorted(self._state):
            state = self._state[rank]
            if state.left:
                continue
            inbound_silence = now - state.last_heard
            if inbound_silence >= self.timeout_s:
                return self._lost(rank, INBOUND, inbound_silence)
            # Its last beat is recent; what it said counts once this rank has beaten for a
            # whole timeout (after a stall, the peer's old complaints are about the stall).
            if state.heard_us_ago_s >= self.timeout_s and \
                    now - self._listening_since >= self.timeout_s:
                return self._lost(rank, OUTBOUND, state.heard_us_ago_s)
        return None

    def _lost(self, rank: int, direction: str, silent_s: float) -> LostPeer:
        state = self._state[rank]
        return LostPeer(self._peers[rank], direction, silent_s, state.beats, state.send_error,
                        self.interval_s, self.timeout_s)

    def _send_all(self, kind: int, now: float) -> None:
        self._sequence += 1
        for rank, state in self._state.items():
            if state.left:
                continue
            heard_ms = min(_MAX_MS, int((now - state.last_heard) * 1000))
            packet = _PACKET.pack(_MAGIC, kind, self.me.rank, self.me.run_id, self._sequence,
                                  heard_ms)
            peer = self._peers[rank]
            try:
                self._sock.sendto(packet, (peer.host, peer.port))
                state.send_error = None
            except OSError as error:  # the route is gone (interface down): silence will tell
                state.send_error = f"{error.strerror or error} (to {peer.host}:{peer.port})"


# ----------------------------------------------------------------------------------------------
# starting one over the torch.distributed store
# ----------------------------------------------------------------------------------------------
def start_heartbeat(store, rank: int, world_size: int, host: str, node: str,
                    interval_s: float, timeout_s: float, on_lost: Callable[[LostPeer], None],
                    rendezvous_timeout_s: float, prefix: str = STORE_PREFIX) -> Heartbeat:
    """Bind on `host`, publish the address in `store` (a torch.distributed Store) under `prefix`,
    read every other rank's, start beating. Collective: every rank of the job calls it once per
    store. Raises HeartbeatError."""
    check_heartbeat_settings(interval_s, timeout_s)
    sock = bind_udp(host)
    try:
        me = PeerAddress(rank, host, sock.getsockname()[1], node, os.getpid(),
                         random.getrandbits(63))
        store.set(f"{prefix}/{rank}", me.encode())
        peers = _read_peers(store, prefix, rank, world_size, rendezvous_timeout_s)
        return Heartbeat(sock, me, peers, interval_s, timeout_s, on_lost)
    except BaseException:
        sock.close()
        raise


def _read_peers(store, prefix: str, rank: int, world_size: int,
                timeout_s: float) -> list[PeerAddress]:
    others = [other for other in range(world_size) if other != rank]
    keys = [f"{prefix}/{other}" for other in others]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError:  # torch's DistStoreError says only "wait timeout"
        missing = [other for other, key in zip(others, keys) if not store.check([key])]
        raise HeartbeatError(f"heartbeat: rank(s) {', '.join(map(str, missing))} did not publish "
                             f"their heartbeat address within {timeout_s:g} s; their logs say "
                             f"why they stopped") from None
    return [PeerAddress.decode(store.get(key)) for key in keys]
