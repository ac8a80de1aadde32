"""Heartbeats (megatron_dpp/comm/heartbeat.py): a peer that stops answering is named within the
timeout, in the direction that went silent; a peer that is slow, or left on purpose, never is.

In-process: heartbeats on loopback with short intervals (a torch.distributed HashStore carries
their addresses; each rank's beats go through its own helper process, as in training, or through
a Heartbeat run in this process where a test needs to look inside). In real processes: a 2-rank
training run whose rank 1 is frozen with SIGSTOP must end on rank 0 with exit code LOST_PEER,
naming rank 1's node, address and pid: once with the default settings under --use-dpp (the 30 s
promise), once under Megatron's own 1F1B with a short timeout. The two-node case (a link set
down between network namespaces) is in test_multinode.py.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch
import torch.distributed as dist

from _train_util import (ITERATION_RE, REPO_ROOT, TINY_GPT_ARGS, _env, data_args, run_training,
                         torchrun_command)
from megatron_dpp.comm.heartbeat import (_BEAT, DEFAULT_INTERVAL_S, DEFAULT_TIMEOUT_S, INBOUND,
                                         LOOPBACK, OUTBOUND, Heartbeat, HeartbeatError,
                                         PeerAddress, bind_udp, check_heartbeat_settings,
                                         LostPeer, encode_packet, heartbeat_host, start_heartbeat)
from megatron_dpp.exit_codes import LOST_PEER

INTERVAL_S = 0.1
TIMEOUT_S = 0.5


# ----------------------------------------------------------------------------------------------
# in-process
# ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def heartbeats(count: int = 2, interval_s: float = INTERVAL_S, timeout_s: float = TIMEOUT_S):
    """`count` heartbeats started as ranks of one job over a HashStore; ([Heartbeat], [[LostPeer]]
    reported by each). Every one is closed (without a bye) on the way out."""
    store = dist.HashStore()
    started: list = [None] * count
    lost: list[list] = [[] for _ in range(count)]
    errors: list = []

    def start(rank: int) -> None:
        try:
            started[rank] = start_heartbeat(store, rank, count, LOOPBACK, f"node {rank}",
                                            interval_s, timeout_s, on_lost=lost[rank].append,
                                            rendezvous_timeout_s=20)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=start, args=(rank,)) for rank in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    try:
        assert not errors and all(started), errors
        yield started, lost
    finally:
        for beat in started:
            if beat is not None:
                beat.close(say_bye=False)


def wait_until(predicate, timeout_s: float, what: str) -> float:
    """Seconds until predicate() held; fails naming `what` after timeout_s."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"{what}: not within {timeout_s:g} s"
        time.sleep(0.01)
    return time.monotonic() - start


@pytest.mark.timeout(30)
def test_beating_peers_are_never_lost_and_a_bye_is_honoured():
    with heartbeats() as (beats, lost):
        time.sleep(4 * TIMEOUT_S)
        assert lost == [[], []]
        beats[0].close(say_bye=True)  # rank 0 finished
        time.sleep(4 * TIMEOUT_S)
        assert lost == [[], []], lost[1][0].reason() if lost[1] else ""


@pytest.mark.timeout(30)
@pytest.mark.alone  # sub-second deadlines: another worker's ranks on these cores would stretch them
def test_a_silent_peer_is_named_inbound_within_the_timeout():
    with heartbeats() as (beats, lost):
        time.sleep(2 * INTERVAL_S)
        # Rank 0 goes silent (a crash, a stop, a link down) while close() runs: its helper stops
        # beating before close() has waited for it to exit, so the silence is timed from here.
        silent_from = time.monotonic()
        beats[0].close(say_bye=False)
        wait_until(lambda: lost[1], 10 * TIMEOUT_S, "rank 1 names the silent rank 0")
        elapsed = time.monotonic() - silent_from
        assert TIMEOUT_S - INTERVAL_S <= elapsed <= TIMEOUT_S + 0.5, elapsed
        found = lost[1][0]
        assert found.direction == INBOUND and found.peer.rank == 0
        assert found.reason().startswith("lost rank 0 (node 0, 127.0.0.1): no heartbeat from it "
                                         "for 0."), found.reason()
        assert found.reason().endswith("s (inbound)"), found.reason()
        assert found.state_lines()[0] == f"its process (pid {os.getpid()} on node 0) is stopped " \
            f"or frozen (SIGSTOP, a debugger, or native code holding Python's GIL)"
        assert lost[0] == []


@pytest.mark.timeout(30)
class _LosingSendsTo:
    """A socket whose datagrams to `lost_to` are lost on the way (a one-way broken link)."""

    def __init__(self, sock, lost_to):
        self._sock, self._lost_to = sock, lost_to

    def sendto(self, data, address):
        return len(data) if tuple(address) == self._lost_to else self._sock.sendto(data, address)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def test_a_one_way_loss_is_named_outbound_where_the_beats_still_arrive():
    """Rank 0's beats to rank 1 are lost on the way; rank 1's reach rank 0. Rank 1 has heard
    nothing (inbound, and never: maybe a firewall); rank 0 hears that it is not heard."""
    sockets = [bind_udp(LOOPBACK) for _ in range(2)]
    addresses = [PeerAddress(rank, LOOPBACK, sock.getsockname()[1], f"node {rank}", os.getpid(),
                             1000 + rank) for rank, sock in enumerate(sockets)]
    lost: list[list] = [[], []]
    beats = [Heartbeat(_LosingSendsTo(sockets[0], (LOOPBACK, addresses[1].port)), addresses[0],
                       [addresses[1]], INTERVAL_S, TIMEOUT_S, lost[0].append),
             Heartbeat(sockets[1], addresses[1], [addresses[0]], INTERVAL_S, TIMEOUT_S,
                       lost[1].append)]
    try:
        wait_until(lambda: lost[0] and lost[1], 10 * TIMEOUT_S, "both ranks name the broken way")
    finally:
        for beat in beats:
            beat.close(say_bye=False)
    heard_nothing, not_heard = lost[1][0], lost[0][0]
    assert heard_nothing.direction == INBOUND and heard_nothing.beats_received == 0
    assert "none of its heartbeats ever arrived" in heard_nothing.state_lines()[0]
    assert "--heartbeat-timeout 0 turns heartbeats off" in heard_nothing.state_lines()[0]
    assert not_heard.direction == OUTBOUND and not_heard.silent_s >= TIMEOUT_S
    assert not_heard.reason().startswith("lost rank 1 (node 1, 127.0.0.1): it hears us no longer "
                                         "(outbound"), not_heard.reason()


@pytest.mark.timeout(30)
def test_a_busy_main_thread_does_not_stop_the_beats():
    """The heartbeats go on while the main thread computes: a pure Python loop (the GIL is
    handed over every 5 ms, enough for the tick to the helper), torch ops and sleeps, each for
    several timeouts."""
    with heartbeats(timeout_s=4 * INTERVAL_S) as (_beats, lost):
        busy_until = time.monotonic() + 3 * TIMEOUT_S
        total = 0
        while time.monotonic() < busy_until:
            total += sum(i * i for i in range(1000))
        matrix = torch.randn(256, 256)
        busy_until = time.monotonic() + 3 * TIMEOUT_S
        while time.monotonic() < busy_until:
            matrix = torch.tanh(matrix @ matrix)
        time.sleep(2 * TIMEOUT_S)
        assert lost == [[], []], [found.reason() for each in lost for found in each]
        assert total > 0


def _hold_the_gil(seconds: float) -> float:
    """Seconds spent in one builtin call, which keeps the GIL all along (no bytecode runs, so no
    other thread does): a rank whose C code holds the GIL, or a process stopped and resumed."""
    count = 10 ** 6
    while True:
        start = time.monotonic()
        sum(range(count))
        spent = time.monotonic() - start
        if spent >= seconds:
            return spent
        count = int(count * min(10.0, 1.5 * seconds / max(spent, 1e-3)))


@pytest.mark.timeout(60)
def test_a_stall_of_this_process_is_not_counted_against_its_peers():
    """After a stall of both ranks' training process (this one: no tick reaches the helpers),
    the helpers stop beating and stop counting silence: no peer is lost."""
    with heartbeats() as (_beats, lost):
        time.sleep(2 * INTERVAL_S)
        held = _hold_the_gil(3 * TIMEOUT_S)
        assert held >= 3 * TIMEOUT_S
        time.sleep(2 * TIMEOUT_S)
        assert lost == [[], []], [found.reason() for each in lost for found in each]


@pytest.mark.timeout(30)
def test_datagrams_of_strangers_do_not_count_as_beats():
    """A beat with rank 0's number but another run id (another job, an earlier run on the same
    port), and noise, keep no silent peer alive."""
    from megatron_dpp.comm import heartbeat as module

    with heartbeats() as (beats, lost):
        target = (LOOPBACK, beats[1].me.port)
        beats[0].close(say_bye=False)
        stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            deadline = time.monotonic() + 10 * TIMEOUT_S
            sequence = 0
            while not lost[1] and time.monotonic() < deadline:
                sequence += 1
                stranger.sendto(module.encode_packet(module._BEAT, 0, beats[0].me.run_id + 1,
                                                     sequence, 0), target)
                stranger.sendto(b"noise", target)
                time.sleep(INTERVAL_S / 2)
        finally:
            stranger.close()
        assert lost[1] and lost[1][0].peer.rank == 0, "the stranger's beats kept rank 0 alive"


@pytest.mark.timeout(30)
def test_a_forged_bye_from_another_socket_leaves_the_peer_watched():
    """A process that read rank 0's run id (the rendezvous store) sends rank 1 a bye in rank 0's
    name, and beats numbered 2**64 - 1, from a socket of its own: rank 1 goes on hearing rank
    0's real beats, and loses nobody."""
    from megatron_dpp.comm import heartbeat as module

    sockets = [bind_udp(LOOPBACK) for _ in range(2)]
    addresses = [PeerAddress(rank, LOOPBACK, sock.getsockname()[1], f"node {rank}", os.getpid(),
                             2000 + rank) for rank, sock in enumerate(sockets)]
    lost: list[list] = [[], []]
    beats = [Heartbeat(sockets[rank], addresses[rank], [addresses[1 - rank]], INTERVAL_S,
                       TIMEOUT_S, lost[rank].append) for rank in range(2)]
    try:
        wait_until(lambda: beats[1].beats_received()[0] >= 1, 5, "rank 0's first beat")
        forger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with forger:
            for sequence in (10**6, 2**64 - 1):
                for kind in (module._BYE, module._BEAT):
                    forger.sendto(encode_packet(kind, 0, addresses[0].run_id, sequence, 0),
                                  (LOOPBACK, addresses[1].port))
        heard = beats[1].beats_received()[0]
        wait_until(lambda: beats[1].beats_received()[0] >= heard + 3, 10 * TIMEOUT_S,
                   "rank 0's real beats after the forgeries")
        assert not lost[1] and not beats[1]._state[0].left
    finally:
        for beat in beats:
            beat.close(say_bye=False)


def test_only_the_peers_socket_in_sequence_counts():
    """The receiving side of one datagram: from the peer's published socket, numbered above the
    last one within SEQUENCE_WINDOW; a replay, a number past the window, another socket: nothing."""
    from megatron_dpp.comm import heartbeat as module

    sock, sink = bind_udp(LOOPBACK), bind_udp(LOOPBACK)
    me = PeerAddress(0, LOOPBACK, sock.getsockname()[1], "node 0", os.getpid(), 1)
    peer = PeerAddress(1, LOOPBACK, sink.getsockname()[1], "node 1", os.getpid(), 7)
    beat = Heartbeat(sock, me, [peer], INTERVAL_S, 100.0, lambda lost: None)
    try:
        beat.close(say_bye=False)  # its thread stopped: _receive alone below
        state, source, elsewhere = beat._state[1], (LOOPBACK, peer.port), (LOOPBACK, 1)

        def receive(kind, sequence, at=source):
            beat._receive(encode_packet(kind, 1, 7, sequence, 0), at, 0.0)

        receive(_BEAT, module.SEQUENCE_WINDOW + 1)  # past the window above -1
        receive(_BEAT, 1, at=elsewhere)
        assert state.beats == 0
        receive(_BEAT, 1)
        receive(_BEAT, 1)  # a replay
        assert state.beats == 1 and state.last_sequence == 1
        receive(module._BYE, 1)  # a replayed number
        receive(module._BYE, 5, at=elsewhere)
        receive(module._BYE, 2 + module.SEQUENCE_WINDOW)
        assert not state.left
        receive(_BEAT, 3)  # beats lost on the way: a gap
        receive(module._BYE, 4)
        assert state.beats == 2 and state.left
    finally:
        sink.close()


@pytest.mark.timeout(30)
def test_a_rank_that_never_publishes_is_named_at_start():
    store = dist.HashStore()
    with pytest.raises(HeartbeatError, match=r"rank\(s\) 1, 2 did not publish their heartbeat "
                                             r"address within 0.3 s"):
        start_heartbeat(store, 0, 3, LOOPBACK, "node 0", INTERVAL_S, TIMEOUT_S,
                        on_lost=lambda lost: None, rendezvous_timeout_s=0.3)


def test_the_address_is_the_nodes_own():
    assert heartbeat_host(["10.0.0.1", "10.0.0.2"], {"GROUP_RANK": "1"}) == "10.0.0.2"
    assert heartbeat_host(None, {"GROUP_WORLD_SIZE": "1", "GROUP_RANK": "0"}) == LOOPBACK
    # Several nodes without --node-ips: the address on the route to the master.
    assert heartbeat_host(None, {"GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}) == LOOPBACK


@pytest.mark.parametrize("interval,timeout,message", [
    (0.0, 15.0, "--heartbeat-interval must be positive seconds, got 0"),
    (float("nan"), 15.0, "--heartbeat-interval must be positive"),
    (1.0, 3.0, "--heartbeat-timeout must be at least 4 x --heartbeat-interval (4 s)"),
    (1.0, -1.0, "--heartbeat-timeout must be at least 4"),
])
def test_bad_settings_are_refused_in_flag_names(interval, timeout, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_heartbeat_settings(interval, timeout)


def test_the_defaults_detect_within_30_s_and_zero_turns_heartbeats_off():
    check_heartbeat_settings(DEFAULT_INTERVAL_S, DEFAULT_TIMEOUT_S)
    check_heartbeat_settings(DEFAULT_INTERVAL_S, 0.0)
    # Declared at the first beat after the timeout: timeout + interval at most.
    assert DEFAULT_TIMEOUT_S + DEFAULT_INTERVAL_S < 30


def test_the_flags_default_to_the_modules_settings():
    from megatron_dpp.arguments import build_parser

    args = build_parser().parse_args([])
    assert (args.heartbeat_interval, args.heartbeat_timeout) == (DEFAULT_INTERVAL_S,
                                                                 DEFAULT_TIMEOUT_S)


@pytest.mark.parametrize("flags,message", [
    (["--heartbeat-timeout", "2"], "--heartbeat-timeout must be at least 4 x --heartbeat-interval"),
    (["--heartbeat-interval", "-1"], "--heartbeat-interval must be positive seconds, got -1"),
])
def test_bad_heartbeat_flags_stop_before_launch(flags, message, monkeypatch, capsys):
    from megatron_dpp.arguments import parse_args

    for name in ("MASTER_ADDR", "GROUP_WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as stopped:
        parse_args([*data_args(), *TINY_GPT_ARGS, *flags], prog="megatron_dpp.pretrain_gpt")
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 2 and "\n" not in err, err
    assert err.startswith("megatron_dpp.pretrain_gpt: error: " + message), err


# ----------------------------------------------------------------------------------------------
# training runs
# ----------------------------------------------------------------------------------------------
# ----------------------------------------------------------------------------------------------
# the helper process, the phase and the receive buffer
# ----------------------------------------------------------------------------------------------
def _engines(count: int, options: dict, interval_s: float = INTERVAL_S,
             timeout_s: float = TIMEOUT_S) -> tuple:
    """`count` Heartbeats run in this process, each knowing the others, rank r built with the
    keyword arguments options.get(r, {}); (beats, lost lists)."""
    sockets = [bind_udp(LOOPBACK) for _ in range(count)]
    addresses = [PeerAddress(rank, LOOPBACK, sock.getsockname()[1], f"node {rank}", os.getpid(),
                             2000 + rank) for rank, sock in enumerate(sockets)]
    lost: list[list] = [[] for _ in range(count)]
    beats = [Heartbeat(sock, addresses[rank], addresses[:rank] + addresses[rank + 1:],
                       interval_s, timeout_s, lost[rank].append, **options.get(rank, {}))
             for rank, sock in enumerate(sockets)]
    return beats, lost


@pytest.mark.timeout(30)
@pytest.mark.alone  # sub-second deadlines: another worker's ranks on these cores would stretch them
def test_a_stopped_training_process_stops_the_beats_and_the_judging():
    """While `alive` says the training process is stopped, its heartbeat sends nothing (its peer
    names it) and counts no silence (its silent peer is not named)."""
    running = [True]
    beats, lost = _engines(2, {0: {"alive": lambda: running[0]}})
    try:
        time.sleep(2 * INTERVAL_S)
        running[0] = False
        elapsed = wait_until(lambda: lost[1], 10 * TIMEOUT_S, "rank 1 names the stopped rank 0")
        assert elapsed <= TIMEOUT_S + 2 * INTERVAL_S + 0.5, elapsed
        assert lost[1][0].peer.rank == 0 and lost[1][0].direction == INBOUND
        time.sleep(3 * TIMEOUT_S)  # rank 1 stopped beating when it named rank 0
        assert lost[0] == [], lost[0][0].reason()
    finally:
        for beat in beats:
            beat.close(say_bye=False)


@pytest.mark.timeout(30)
@pytest.mark.alone  # sub-second deadlines: another worker's ranks on these cores would stretch them
def test_the_first_beat_goes_at_its_phase():
    beats, _lost = _engines(2, {0: {"first_beat_s": 0.6}, 1: {"first_beat_s": 0.0}},
                            interval_s=0.6, timeout_s=2.4)
    try:
        time.sleep(0.3)
        assert beats[1].beats_received()[0] == 0  # rank 0 has not beaten yet
        assert beats[0].beats_received()[1] >= 1
        wait_until(lambda: beats[1].beats_received()[0] >= 1, 5, "rank 0's first beat")
        with bind_udp(LOOPBACK) as spare, \
                pytest.raises(ValueError, match="first beat must come within the first interval"):
            Heartbeat(spare, beats[0].me, [], 0.6, 2.4, print, first_beat_s=0.7)
    finally:
        for beat in beats:
            beat.close(say_bye=False)


@pytest.mark.timeout(30)
def test_a_burst_from_every_peer_is_received_whole():
    """600 peers' beats arriving at one moment (more than a socket holds by default): the receive
    buffer is sized for them, so every one is counted."""
    peers = 600
    sock = bind_udp(LOOPBACK)
    me = PeerAddress(0, LOOPBACK, sock.getsockname()[1], "node 0", os.getpid(), 1)
    sink = bind_udp(LOOPBACK)
    addresses = [PeerAddress(rank, LOOPBACK, sink.getsockname()[1], "node 1", os.getpid(),
                             5000 + rank) for rank in range(1, peers + 1)]
    beat = Heartbeat(sock, me, addresses, INTERVAL_S, 100.0, lambda lost: None)
    try:
        if beat.receive_buffer_bytes < peers * 1024:
            pytest.skip(f"the kernel grants {beat.receive_buffer_bytes} B of receive buffer "
                        f"(net.core.rmem_max): too little to hold {peers} datagrams")
        for rank in range(1, peers + 1):  # from the socket the peers published
            sink.sendto(encode_packet(_BEAT, rank, 5000 + rank, 1, 0), (LOOPBACK, me.port))
        wait_until(lambda: sum(beat.beats_received().values()) == peers, 10,
                   f"all {peers} beats counted (counted "
                   f"{sum(beat.beats_received().values())})")
    finally:
        beat.close(say_bye=False)
        sink.close()


@pytest.mark.timeout(60)
def test_the_helper_ends_with_the_training_process():
    """A training process that dies (SIGKILL: no close) takes its helper with it: the end of the
    tick pipe ends the helper, with no bye, so its peers name the rank."""
    script = (
        "import os, sys, time\n"
        "from megatron_dpp.comm.heartbeat import HeartbeatProcess, PeerAddress, bind_udp\n"
        "sock, peer = bind_udp('127.0.0.1'), bind_udp('127.0.0.1')\n"
        "me = PeerAddress(0, '127.0.0.1', sock.getsockname()[1], 'node 0', os.getpid(), 1)\n"
        "other = PeerAddress(1, '127.0.0.1', peer.getsockname()[1], 'node 0', os.getpid(), 2)\n"
        "beat = HeartbeatProcess(sock, me, [other], 0.1, 0.5, print, print)\n"
        "print(beat.helper_pid, flush=True)\n"
        "time.sleep(600)\n")
    rank = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            cwd=REPO_ROOT, env=_env())
    try:
        helper_pid = int(rank.stdout.readline())
        assert _process_runs(helper_pid)
        rank.kill()
        rank.wait(timeout=10)
        wait_until(lambda: not _process_runs(helper_pid), 10, f"helper {helper_pid} ends")
    finally:
        rank.kill()
        rank.wait(timeout=10)


def _process_runs(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(30)
def test_a_helper_that_dies_is_reported_once_with_its_exit_code():
    failures: list = []
    with heartbeats() as (beats, lost):
        beats[0]._on_helper_failed = failures.append
        os.kill(beats[0].helper_pid, signal.SIGKILL)
        wait_until(lambda: failures, 10, "the training process hears that its helper died")
        time.sleep(3 * INTERVAL_S)
    assert len(failures) == 1, failures
    assert re.fullmatch(r"heartbeat: its helper process \(pid \d+\) ended on its own with exit "
                        r"code -9; its output above says why", failures[0]), failures[0]


@pytest.mark.timeout(30)
def test_the_helper_outlives_a_ctrl_c_to_the_process_group():
    """SIGINT and SIGTERM reach the helper with the rest of the group; the training process
    answers them (a checkpoint, then a bye), so the helper stays until told."""
    failures: list = []
    with heartbeats() as (beats, lost):
        beats[0]._on_helper_failed = failures.append
        for number in (signal.SIGINT, signal.SIGTERM):
            os.kill(beats[0].helper_pid, number)
        time.sleep(2 * TIMEOUT_S)
        assert failures == [] and lost == [[], []], (failures, lost)
        assert _process_runs(beats[0].helper_pid)


@pytest.mark.timeout(60)
def test_a_helper_that_cannot_start_is_named_at_start(monkeypatch):
    from megatron_dpp.comm import heartbeat as module

    monkeypatch.setattr(module, "HELPER_MODULE", "megatron_dpp.comm.no_such_helper")
    store = dist.HashStore()
    store.set(f"{module.STORE_PREFIX}/1", PeerAddress(1, LOOPBACK, 9, "node 0", 1, 2).encode())
    with pytest.raises(HeartbeatError, match=r"^heartbeat: its helper process \(pid \d+\) ended "
                                             r"as it started, exit code 1; its output above says "
                                             r"why$"):
        start_heartbeat(store, 0, 2, LOOPBACK, "node 0", INTERVAL_S, TIMEOUT_S,
                        on_lost=lambda lost: None, rendezvous_timeout_s=5)


def test_the_helper_starts_without_torch():
    """The helper imports only the standard library and the heartbeat module: no torch (seconds
    and hundreds of MB per rank)."""
    probe = ("import sys, megatron_dpp.comm.heartbeat_helper; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            cwd=REPO_ROOT, env=_env(), timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.alone  # sub-second deadlines: another worker's ranks on these cores would stretch them
def test_a_healthy_run_with_a_tight_timeout_loses_nobody(tmp_path):
    """Model building, iterations, checkpoint saves and the ranks' exits at different moments
    (the first to finish says bye) never look like a lost peer, even with a 1 s timeout."""
    rc, losses, _norms, output = run_training(
        ["--pipeline-model-parallel-size", "2", "--use-dpp", "--train-iters", "4",
         "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
         "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1"], nproc=2, timeout=180)
    assert rc == 0 and len(losses) == 4, output[-3000:]
    assert "lost rank" not in output, output[-3000:]


# ----------------------------------------------------------------------------------------------
# a rank frozen with SIGSTOP in a training run
# ----------------------------------------------------------------------------------------------
MARKER = "DPP_HEARTBEAT_TEST"
# torchrun's log line when a rank exits non-zero (torch.distributed.elastic's SubprocessContext).
RANK_EXIT_RE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")


def _pid_of_rank(marker: str, rank: int) -> int | None:
    """The training process of `rank` among the processes whose environment carries the marker:
    the one whose parent is not among them (its heartbeat helper inherits the same environment,
    and after the pids wrap around it may be listed first)."""
    wanted = {f"{MARKER}={marker}".encode(), f"RANK={rank}".encode()}
    candidates = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                variables = set(environ.read().split(b"\0"))
            with open(f"/proc/{entry}/status") as status:
                parent = next(int(line.split()[1]) for line in status if line.startswith("PPid:"))
        except (OSError, StopIteration):
            continue
        if wanted <= variables:
            candidates[int(entry)] = parent
    roots = [pid for pid, parent in candidates.items() if parent not in candidates]
    return roots[0] if len(roots) == 1 else None


def _kill_stopped(pid: int | None) -> None:
    if pid is None:
        return
    for sent in (signal.SIGCONT, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sent)


def _train_and_freeze_rank_1(extra: list[str], report_within_s: float):
    """Train at pp=2 until iteration 2, freeze rank 1 with SIGSTOP; (seconds until rank 0's report,
    rank 0's exit code as torchrun logs it, rank 1's pid, the output)."""
    marker = uuid.uuid4().hex
    env = _env()
    env[MARKER] = marker
    args = [*data_args(), *TINY_GPT_ARGS, "--train-iters", "100000",
            "--pipeline-model-parallel-size", "2", *extra]
    process = subprocess.Popen(torchrun_command(args, 2), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO_ROOT,
                               start_new_session=True)
    lines: list[str] = []
    iterating, reported, terminating = threading.Event(), threading.Event(), threading.Event()

    def read() -> None:
        for line in process.stdout:
            lines.append(line)
            match = ITERATION_RE.search(line)
            if match and int(match.group(1)) >= 2:
                iterating.set()
            if line.startswith("[dpp rank 0] lost rank 1"):
                reported.set()
            if "closing signal SIGTERM" in line:  # torchrun saw rank 0 exit and ends the job
                terminating.set()

    reader = threading.Thread(target=read)
    reader.start()
    stopped = None
    try:
        assert iterating.wait(timeout=150), "training never started:\n" + "".join(lines[-40:])
        stopped = _pid_of_rank(marker, 1)
        assert stopped is not None, "no process of rank 1 found"
        os.kill(stopped, signal.SIGSTOP)
        frozen_at = time.monotonic()
        assert reported.wait(timeout=report_within_s + 30), \
            "rank 0 did not name the frozen rank 1:\n" + "".join(lines[-40:])
        elapsed = time.monotonic() - frozen_at
        # torchrun's SIGTERM cannot act on a stopped process (torchrun would SIGKILL it 30 s
        # later): kill it now; torchrun then logs rank 0's exit code, the first failure.
        assert terminating.wait(timeout=20), \
            "torchrun did not see rank 0 exit:\n" + "".join(lines[-40:])
        _kill_stopped(stopped)
        process.wait(timeout=60)
    finally:
        _kill_stopped(stopped)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        reader.join(timeout=10)
    output = "".join(lines)
    codes = {int(m.group(2)): int(m.group(1)) for m in RANK_EXIT_RE.finditer(output)}
    return elapsed, codes.get(0), stopped, output


# (id, flags, the time rank 0 must name rank 1 within). --use-dpp keeps every default: the promise
# is "within 30 s"; Megatron's 1F1B gets a short timeout to save test time.
FROZEN_CASES = [
    ("dpp_default_settings", ["--use-dpp"], 30.0),
    ("megatron_1f1b_short_timeout",
     ["--heartbeat-interval", "0.5", "--heartbeat-timeout", "3"], 6.0),
]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("extra,within_s", [case[1:] for case in FROZEN_CASES],
                         ids=[case[0] for case in FROZEN_CASES])
def test_a_frozen_rank_is_named_and_ends_the_job(extra, within_s):
    elapsed, rank0_code, stopped, output = _train_and_freeze_rank_1(extra, within_s)
    report = "\n".join(line for line in output.splitlines() if line.startswith("[dpp rank 0]"))
    print(f"rank 0 named the frozen rank 1 {elapsed:.1f} s after SIGSTOP, exit code {rank0_code}:"
          f"\n{report}")
    assert elapsed < within_s, f"{elapsed:.1f} s:\n{report}"
    assert rank0_code == LOST_PEER, output[-3000:]
    # One line: the reason, then what it tells.
    assert re.search(rf"^\[dpp rank 0\] lost rank 1 \(node 0, 127\.0\.0\.1\): no heartbeat from it "
                     rf"for [\d.]+ s \(inbound\); its process \(pid {stopped} on node 0\) is "
                     rf"stopped or frozen [^\n]*$", report, re.MULTILINE), report


def test_a_silent_peer_whose_process_has_exited_is_said_to_have_exited():
    """On this node the report looks the peer's process up: a process killed (gone, or a zombie
    its parent has not reaped yet) has exited; it is not called stopped or frozen."""
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while _state(zombie.pid) != "Z":  # exited, not reaped: wait() below reaps it
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.01)
    try:
        lines = {}
        for label, pid in (("zombie", zombie.pid), ("alive", os.getpid())):
            peer = PeerAddress(1, LOOPBACK, 1, "node 0", pid, 1001)
            lines[label] = LostPeer(peer, INBOUND, 16.0, 12, None, 1.0, 15.0).state_lines()[0]
    finally:
        zombie.wait(timeout=10)
    gone = LostPeer(PeerAddress(1, LOOPBACK, 1, "node 0", zombie.pid, 1001), INBOUND, 16.0, 12,
                    None, 1.0, 15.0).state_lines()[0]
    exited = (f"its process (pid {zombie.pid} on node 0) has exited (killed, or ended without "
              f"saying goodbye); the launcher's report says how")
    assert lines["zombie"] == gone == exited
    assert lines["alive"] == (f"its process (pid {os.getpid()} on node 0) is stopped or frozen "
                              f"(SIGSTOP, a debugger, or native code holding Python's GIL)")


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]
