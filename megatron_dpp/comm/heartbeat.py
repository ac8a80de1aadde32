"""Heartbeats between every pair of ranks, beside the transports: a peer that stops answering is
named on every other rank within --heartbeat-timeout, whatever that rank was doing.

The transports notice at once a peer whose process died (its connections reset), but not one that
stops answering while it stays alive: the link between two nodes down, a node frozen, a process
stopped (SIGSTOP, a debugger). Their own timeouts must outlast the slowest healthy step, so they
are minutes long. Heartbeats tell a lost peer from a slow one in seconds: a busy rank still beats,
because its beats come from a helper process, which a thread of the rank tells once per interval
that the rank runs (a tick needs the GIL for microseconds, and Python code gives it up every 5 ms).

Each rank binds one UDP socket on its node's address (its --node-ips entry; 127.0.0.1 on a
single node), publishes it in the torch.distributed store and reads every peer's. Then a helper
process (heartbeat_helper.py, started by HeartbeatProcess) sends every peer one datagram per
interval and reads theirs, while the training process's own thread tells it once per interval
that the training process still runs. Not a thread of the training process: a Python thread that
makes a system call hands the GIL to a busy training thread and waits up to 5 ms to get it back,
so beside a training loop bound by its host it manages about 200 datagrams a second and, from a
few hundred ranks on, falls behind: its peers would name a healthy rank lost
(benchmarks/heartbeat_scale.py, docs/multinode.md "Heartbeats at scale").

A beat carries the sender's rank, a random run id (datagrams of another job are ignored), a
sequence number, and how long ago the sender last heard from the receiver, so a rank sees both
directions of each link:
- inbound: no beat from a peer for `timeout_s` (its process stopped, its node frozen, or the
  link down);
- outbound: the peer's beats arrive, but say that ours have not reached it for `timeout_s`.
Silence is counted only while this rank listens: if its helper could not run for a while, or its
training process stopped telling it that it runs (the process was stopped, or C code held the
GIL), the clock of every peer starts again, and the helper stops beating, so that the peers name
the stopped training process.

A lost peer ends in one call of `on_lost(LostPeer)` in the training process; training reports it
(rank, node, address, direction) and exits with exit_codes.LOST_PEER. A rank that leaves on
purpose (training finished, or every rank stops together) sends a few "bye" datagrams, and its
peers stop watching it; a rank that crashes sends none, and its peers name it once the timeout
passes.

Each rank beats at its own phase of the interval, drawn at random: the ranks of a job start
together, and beats sent at one moment by hundreds of ranks would arrive at every receiver as one
burst, more than its socket holds (a Linux UDP socket holds 256 small datagrams by default), and
the rest would be lost. The receive buffer is also sized for one datagram per peer (as far as the
kernel allows).

Cost: each rank sends and reads world_size - 1 datagrams of 32 bytes per interval, and reads the
world_size - 1 addresses in one store request at start (benchmarks/heartbeat_scale.py measures
both against the job's size). Standard library only.
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
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Callable, MutableMapping, Optional, Sequence

from megatron_dpp.comm.job_key import JOB_KEY_ENV, MAC_BYTES, DatagramSeal, key_check
from megatron_dpp.comm.nodes import NODE_RANK_VARIABLE, NUM_NODES_VARIABLE, this_node_rank
from megatron_dpp.one_write import say

DEFAULT_INTERVAL_S = 1.0
DEFAULT_TIMEOUT_S = 15.0
HEARTBEAT_OFF = 0.0
"""--heartbeat-timeout 0: no heartbeats (where the network between the nodes drops UDP)."""
MIN_BEATS_PER_TIMEOUT = 4
"""The timeout spans at least this many intervals: a few lost datagrams never end a job."""
BYE_REPEATS = 3  # UDP may drop one
TICKS_MISSED_AS_STOPPED = 2
"""The helper beats only while the training process told it, within this many intervals, that it
runs; a stopped training process is then named by its peers at most this many intervals after
--heartbeat-timeout."""
RECEIVE_BUFFER_BYTES_PER_PEER = 2048
"""What one queued datagram costs a socket's receive buffer (the kernel counts its whole buffer:
about 0.8 KiB on loopback, up to a few KiB from a NIC)."""
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
# How far above the last sequence number a beat or bye may be and still be believed: beats lost on
# the way leave gaps of a few (one per interval, 18 h of them at 1 s), a forged or corrupt number
# (2**64 - 1) would make every real beat after it look old.
SEQUENCE_WINDOW = 1 << 16
STORE_PREFIX = "megatron_dpp/heartbeat"


def encode_packet(kind: int, rank: int, run_id: int, sequence: int, heard_ms: int) -> bytes:
    """One heartbeat datagram: `kind` (_BEAT or _BYE) from `rank` of run `run_id`, saying it last
    heard from the receiver `heard_ms` milliseconds ago."""
    return _PACKET.pack(_MAGIC, kind, rank, run_id, sequence, min(_MAX_MS, heard_ms))


class HeartbeatError(RuntimeError):
    """Heartbeats could not start; the message is one line that says why."""


class JobKeyMismatch(HeartbeatError):
    """Ranks of one job hold different job keys (DPP_JOB_KEY), or some none: bad input."""


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
    key_check: str = ""  # job_key.key_check of the rank's job key: equal on every rank, or none

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


def size_receive_buffer(sock: socket.socket, peers: int) -> int:
    """Ask for a receive buffer that holds one datagram from every peer (never less than the
    kernel's default; Linux caps the request at net.core.rmem_max). Returns the size granted."""
    wanted = RECEIVE_BUFFER_BYTES_PER_PEER * peers
    if wanted > sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, wanted)
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)


def _same_address(source: tuple, peer: "PeerAddress") -> bool:
    """Does recvfrom's `source` (host, port[, flow, scope]) name the peer's published socket?"""
    try:
        return (source[1] == peer.port
                and ipaddress.ip_address(source[0]) == ipaddress.ip_address(peer.host))
    except (ValueError, IndexError):
        return False


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
def _process_alive(pid: int) -> bool:
    """Whether process `pid` of this node still runs (a zombie, dead but not yet reaped by its
    parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc here: it exists, as far as we can tell
        return True


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

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @staticmethod
    def decode(data: bytes) -> "LostPeer":
        fields = json.loads(data.decode())
        fields["peer"] = PeerAddress(**fields["peer"])
        return LostPeer(**fields)

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
            if not _process_alive(peer.pid):
                lines = [f"{process} has exited (killed, or ended without saying goodbye); the "
                         f"launcher's report says how"]
            else:
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


class _WakeableThread:
    """The thread of a Heartbeat or a HeartbeatProcess, which each define its body, `_run`: it
    selects on `_wake_reader` besides its own files, so that `_stop_thread()` wakes it at once,
    then joins it."""

    def _start_thread(self) -> None:
        self._stop = threading.Event()
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="dpp-heartbeat")
        self._thread.start()

    @property
    def native_thread_id(self) -> int:
        """The operating system's id of the thread (for CPU accounting)."""
        return self._thread.native_id

    def _stop_thread(self) -> bool:
        """Stop and join the thread (unless called from it); False if it was stopped before."""
        if self._closed:
            return False
        self._closed = True
        self._stop.set()
        self._wake_writer.send(b"x")
        if threading.current_thread() is not self._thread:
            self._thread.join()
        return True

    def _close_wake(self) -> None:
        self._wake_reader.close()
        self._wake_writer.close()


class Heartbeat(_WakeableThread):
    """Beats to `peers` every `interval_s` from its own thread, and calls `on_lost` once (from that
    thread) when one is silent for `timeout_s` in either direction. `close()` stops and joins the
    thread and says bye. `first_beat_s`: when the first beat goes, in seconds from now (default: a
    random point of the first interval, which sets this rank's phase). `alive`: asked before each
    beat; while it says False (the training process is stopped), no beat goes and silence is not
    counted. It runs in the helper process (heartbeat_helper.py); tests run it in theirs."""

    def __init__(self, sock: socket.socket, me: PeerAddress, peers: Sequence[PeerAddress],
                 interval_s: float, timeout_s: float, on_lost: Callable[[LostPeer], None],
                 first_beat_s: Optional[float] = None,
                 alive: Optional[Callable[[], bool]] = None, key: Optional[bytes] = None):
        check_heartbeat_settings(interval_s, timeout_s)
        if timeout_s == HEARTBEAT_OFF:
            raise ValueError("a Heartbeat needs a timeout; with heartbeats off, make none")
        if first_beat_s is not None and not 0.0 <= first_beat_s <= interval_s:
            raise ValueError(f"the first beat must come within the first interval "
                             f"(0-{interval_s:g} s), got {first_beat_s:g} s")
        self.me = me
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.lost: Optional[LostPeer] = None
        self._sock = sock
        self._sock.setblocking(False)
        self.receive_buffer_bytes = size_receive_buffer(sock, len(peers))
        self._first_beat_s = (random.uniform(0.0, interval_s) if first_beat_s is None
                              else first_beat_s)
        self._peers = {peer.rank: peer for peer in peers}
        now = time.monotonic()
        self._state = {peer.rank: _PeerState(now) for peer in peers}
        self._on_lost = on_lost
        self._alive = alive
        # With the job's key every datagram carries a MAC over its bytes and its receiver's rank.
        self._seal = DatagramSeal(key) if key else None
        self._datagram_bytes = _PACKET.size + (MAC_BYTES if self._seal else 0)
        self._sequence = 0
        self._listening_since = now  # the end of this thread's last stall
        # The thread wakes every interval; a gap of two means it could not run (stopped, or
        # starved of the GIL), which is below the timeout (at least MIN_BEATS_PER_TIMEOUT).
        self._stall_s = 2 * interval_s
        self._start_thread()

    def beats_received(self) -> dict[int, int]:
        """Beats counted so far from each peer, by rank (for reports and benchmarks)."""
        return {rank: state.beats for rank, state in self._state.items()}

    def close(self, say_bye: bool = True) -> None:
        """Stop and join the thread, then (say_bye) tell every peer that this rank leaves on
        purpose. A rank that fails closes without a bye: its peers then name it. Idempotent."""
        if not self._stop_thread():
            return
        if say_bye:
            for repeat in range(BYE_REPEATS):
                if repeat:
                    time.sleep(0.01)  # spread out: a burst is lost together
                self._send_all(_BYE, time.monotonic())
        self._sock.close()
        self._close_wake()

    # ---- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        last_turn = time.monotonic()
        next_beat = last_turn + self._first_beat_s
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
            next_beat = now + self.interval_s
            if self._alive is not None and not self._alive():
                self._forgive_stall(now)  # the training process is stopped: its peers name it
                continue
            # Beat first: a peer whose beats stopped reaching us learns it from this one (outbound)
            # even when we now declare it lost and exit.
            self._send_all(_BEAT, now)
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
                data, source = self._sock.recvfrom(self._datagram_bytes + 1)
            except BlockingIOError:
                return
            except OSError:  # an ICMP error reported on the socket: nothing to read
                return
            self._receive(data, source, now)

    def _receive(self, data: bytes, source: tuple, now: float) -> None:
        """One datagram from `source` (recvfrom's address). Believed only from the peer's own
        socket, as it published it, of its run, and in sequence: a beat or bye numbered above
        the last one, by at most SEQUENCE_WINDOW, and, with the job's key, sealed with it for this
        rank; a replayed or forged one changes nothing."""
        if len(data) != self._datagram_bytes:
            return
        if self._seal is not None:
            data = self._seal.opened(data, self.me.rank)
            if data is None:
                return  # not sealed with the job's key: forged, or another job's
        magic, kind, rank, run_id, sequence, heard_us_ago_ms = _PACKET.unpack(data)
        peer = self._peers.get(rank)
        if magic != _MAGIC or peer is None or run_id != peer.run_id:
            return  # not ours: another job, an earlier run, noise
        if not _same_address(source, peer):
            return  # another process claiming to be the peer
        state = self._state[rank]
        if not state.last_sequence < sequence <= state.last_sequence + SEQUENCE_WINDOW:
            return  # a replay, or a number no sender reaches
        state.last_sequence = sequence
        if kind == _BYE:
            state.left = True
        elif kind == _BEAT:
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
            packet = encode_packet(kind, self.me.rank, self.me.run_id, self._sequence,
                                   int((now - state.last_heard) * 1000))
            if self._seal is not None:
                packet = self._seal.seal(packet, rank)
            peer = self._peers[rank]
            try:
                self._sock.sendto(packet, (peer.host, peer.port))
                state.send_error = None
            except OSError as error:  # the route is gone (interface down): silence will tell
                state.send_error = f"{error.strerror or error} (to {peer.host}:{peer.port})"


# ----------------------------------------------------------------------------------------------
# the helper process, seen from the training process
# ----------------------------------------------------------------------------------------------
HELPER_MODULE = "megatron_dpp.comm.heartbeat_helper"
TICK = b"t"
BYE = b"B"  # say bye, then exit
QUIT = b"Q"  # exit without a bye (the peers will name this rank)
READY = b"ready\n"  # the helper's first report: it beats, and ignores SIGINT and SIGTERM
HELPER_START_S = 60.0  # how long the training process waits for READY
HELPER_EXIT_S = 5.0  # how long close() waits for the helper before killing it


class HeartbeatProcess(_WakeableThread):
    """A Heartbeat run by a helper process (heartbeat_helper.py) on `sock`, with this process's
    own thread telling it every interval that this process runs, and calling `on_lost(LostPeer)`
    when the helper reports a lost peer, or `on_helper_failed(reason)` if the helper ends on its
    own. `close()` stops both, like Heartbeat.close."""

    def __init__(self, sock: socket.socket, me: PeerAddress, peers: Sequence[PeerAddress],
                 interval_s: float, timeout_s: float, on_lost: Callable[[LostPeer], None],
                 on_helper_failed: Callable[[str], None], key: Optional[bytes] = None):
        check_heartbeat_settings(interval_s, timeout_s)
        if timeout_s == HEARTBEAT_OFF:
            raise ValueError("a HeartbeatProcess needs a timeout; with heartbeats off, make none")
        self.me = me
        self.interval_s = interval_s
        self._on_lost = on_lost
        self._on_helper_failed = on_helper_failed
        ticks_read, self._ticks = os.pipe()
        self._reports, reports_write = os.pipe()
        settings = {"me": asdict(me), "peers": [asdict(peer) for peer in peers],
                    "interval_s": interval_s, "timeout_s": timeout_s,
                    "socket_fd": sock.fileno(), "ticks_fd": ticks_read,
                    "reports_fd": reports_write,
                    # through the pipe, as the environment brought it: never on a command line
                    "key": key.hex() if key else None}
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        environ = dict(os.environ)
        environ["PYTHONPATH"] = os.pathsep.join(
            [package_root] + ([environ["PYTHONPATH"]] if environ.get("PYTHONPATH") else []))
        try:
            # -S: no site-packages (the helper needs the standard library and this package, on
            # PYTHONPATH); it starts in half the time.
            self._helper = subprocess.Popen(
                [sys.executable, "-S", "-m", HELPER_MODULE], stdin=subprocess.PIPE, env=environ,
                pass_fds=(sock.fileno(), ticks_read, reports_write))
        except OSError as error:
            for fd in (ticks_read, self._ticks, self._reports, reports_write):
                os.close(fd)
            raise HeartbeatError(f"heartbeat: cannot start its helper process "
                                 f"({sys.executable} -S -m {HELPER_MODULE}): {error}") from None
        finally:
            sock.close()  # the helper has its own copy
        os.close(ticks_read)
        os.close(reports_write)
        os.set_blocking(self._ticks, False)  # a helper that stopped reading never blocks us
        try:
            self._helper.stdin.write(json.dumps(settings).encode())
            self._helper.stdin.close()
        except OSError:  # it died at once; its end of the report pipe says so below
            pass
        try:
            self._await_ready()
        except HeartbeatError:
            self._helper.kill()
            self._helper.wait()
            os.close(self._ticks)
            os.close(self._reports)
            raise
        self._start_thread()

    def _await_ready(self) -> None:
        """Read the helper's first line, READY, within HELPER_START_S (byte by byte: what follows
        is for the thread)."""
        deadline = time.monotonic() + HELPER_START_S
        line = b""
        while not line.endswith(b"\n"):
            readable, _, _ = select.select([self._reports], [], [],
                                           max(0.0, deadline - time.monotonic()))
            if not readable:
                raise HeartbeatError(f"heartbeat: its helper process (pid {self._helper.pid}) did "
                                     f"not start within {HELPER_START_S:g} s")
            byte = os.read(self._reports, 1)
            if not byte:
                raise HeartbeatError(f"heartbeat: its helper process (pid {self._helper.pid}) "
                                     f"ended as it started, exit code {self._helper.wait()}; "
                                     f"its output above says why")
            line += byte
        if line != READY:
            raise HeartbeatError(f"heartbeat: its helper process said {line!r} instead of "
                                 f"{READY!r}")

    @property
    def helper_pid(self) -> int:
        return self._helper.pid

    def close(self, say_bye: bool = True) -> None:
        """Stop this process's thread, then tell the helper to say bye (say_bye) or not, and wait
        for it to exit (killing it after HELPER_EXIT_S). Idempotent."""
        if not self._stop_thread():
            return
        try:
            os.set_blocking(self._ticks, True)
            os.write(self._ticks, BYE if say_bye else QUIT)
        except OSError:  # the helper is gone already
            pass
        os.close(self._ticks)
        try:
            self._helper.wait(timeout=HELPER_EXIT_S)
        except subprocess.TimeoutExpired:
            self._helper.kill()
            self._helper.wait()
        os.close(self._reports)
        self._close_wake()

    def _run(self) -> None:
        pending = b""
        next_tick = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_tick:
                self._tick()
                next_tick = now + self.interval_s
            readable, _, _ = select.select([self._reports, self._wake_reader], [], [],
                                           max(0.0, next_tick - time.monotonic()))
            if self._reports not in readable or self._stop.is_set():
                continue
            data = os.read(self._reports, 65536)
            if not data:  # the helper ended without being asked to
                code = self._helper.wait()
                self._on_helper_failed(f"heartbeat: its helper process (pid {self._helper.pid}) "
                                       f"ended on its own with exit code {code}; its output above "
                                       f"says why")
                return
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                self._on_lost(LostPeer.decode(line))

    def _tick(self) -> None:
        try:
            os.write(self._ticks, TICK)
        except BlockingIOError:  # the helper is not reading (stopped): it stops beating
            pass
        except OSError:  # it is gone: its end of the report pipe says so
            pass


# ----------------------------------------------------------------------------------------------
# starting one over the torch.distributed store
# ----------------------------------------------------------------------------------------------
def start_heartbeat(store, rank: int, world_size: int, host: str, node: str,
                    interval_s: float, timeout_s: float, on_lost: Callable[[LostPeer], None],
                    rendezvous_timeout_s: float, prefix: str = STORE_PREFIX,
                    on_helper_failed: Optional[Callable[[str], None]] = None,
                    key: Optional[bytes] = None) -> HeartbeatProcess:
    """Bind on `host`, publish the address in `store` (a torch.distributed Store) under `prefix`,
    read every other rank's, start the helper process beating. Collective: every rank of the job
    calls it once per store. `on_helper_failed` (default: print the reason to stderr) is called
    if the helper ends on its own. `key`: the job's key (job_key.job_key), which seals every
    datagram; every rank must hold the same one, or none. Raises HeartbeatError."""
    check_heartbeat_settings(interval_s, timeout_s)
    sock = bind_udp(host)
    try:
        me = PeerAddress(rank, host, sock.getsockname()[1], node, os.getpid(),
                         random.getrandbits(63), key_check(key))
        store.set(f"{prefix}/{rank}", me.encode())
        peers = _read_peers(store, prefix, rank, world_size, rendezvous_timeout_s)
        _check_same_key(me, peers)
    except BaseException:
        sock.close()
        raise
    return HeartbeatProcess(sock, me, peers, interval_s, timeout_s, on_lost,
                            on_helper_failed or _print_helper_failure, key=key)


def _check_same_key(me: PeerAddress, peers: Sequence[PeerAddress]) -> None:
    """Raises HeartbeatError naming the peers whose job key differs from this rank's (or who have
    one where this rank has none): their datagrams would never open here, and ours not there."""
    others = [peer for peer in peers if peer.key_check != me.key_check]
    if not others:
        return
    first = others[0]
    if not first.key_check:
        differs = f"holds no {JOB_KEY_ENV}, and this rank ({me.node}) one"
    elif not me.key_check:
        differs = f"holds a {JOB_KEY_ENV}, and this rank ({me.node}) none"
    else:
        differs = f"holds another {JOB_KEY_ENV} than this rank ({me.node})"
    more = f" (and {len(others) - 1} more rank(s))" if len(others) > 1 else ""
    raise JobKeyMismatch(f"heartbeat: rank {first.rank} ({first.node}) {differs}{more}; give "
                         f"every node's launcher the same {JOB_KEY_ENV}, or none on any")


def protection_line(key: Optional[bytes], store_host: str) -> str:
    """The start-up line that says how this job is protected from other processes: where its
    rendezvous store listens (`store_host`, the ranks' MASTER_ADDR) and how heartbeats are
    checked (docs/multinode.md, "Threat model")."""
    if store_host == LOOPBACK:
        where = "one node: the rendezvous store and every socket on 127.0.0.1"
    else:
        where = (f"the rendezvous store at {store_host} is reachable from the network and "
                 f"unauthenticated")
    if key:
        beats = (f"heartbeats authenticated with the job's key ({JOB_KEY_ENV}, HMAC-SHA256), "
                 f"from each peer's own socket, in sequence")
    else:
        beats = (f"heartbeats from each peer's own socket, in sequence, NOT authenticated (no "
                 f"{JOB_KEY_ENV}: give every node the same one)")
    return f"job protection: {where}; {beats}; docs/multinode.md, \"Threat model\""


def _print_helper_failure(reason: str) -> None:
    say(reason)


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
    # One request for all of them: key by key, every rank of a 4096-rank job would send the
    # store 4095 requests, half a second each rank and 16.8 million for the store to serve.
    return [PeerAddress.decode(value) for value in store.multi_get(keys)]
