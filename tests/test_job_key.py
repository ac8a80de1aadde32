"""The job's key (megatron_dpp/comm/job_key.py): every heartbeat datagram is sealed with it for its
receiver, so that a process outside the job cannot forge one, even from the peer's own address
(raw sockets, root); ranks whose keys differ are named at start. (A malformed DPP_JOB_KEY is one
line before launch: tests/test_args_validation.py BAD_FLAGS, job_key_*.)
"""
from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest
import torch.distributed as dist

from megatron_dpp.comm import heartbeat as module
from megatron_dpp.comm.heartbeat import (_BEAT, _BYE, LOOPBACK, Heartbeat, JobKeyMismatch,
                                         PeerAddress, bind_udp, encode_packet, protection_line,
                                         start_heartbeat)
from megatron_dpp.comm.job_key import (JOB_KEY_ENV, MAC_BYTES, DatagramSeal, job_key,
                                       job_key_problem, key_check, new_job_key)

INTERVAL_S = 0.1
TIMEOUT_S = 0.5
KEY = bytes(range(32))


def wait_until(predicate, timeout_s: float, what: str) -> None:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"{what}: not within {timeout_s:g} s"
        time.sleep(0.01)


# ----------------------------------------------------------------------------------------------
# the key and the seal
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,problem", [
    ("zz" * 16, "DPP_JOB_KEY must be hexadecimal digits"),
    ("ab" * 8, "DPP_JOB_KEY holds 16 hexadecimal digits; a job key needs at least 32"),
    ("", "DPP_JOB_KEY holds 0 hexadecimal digits"),
])
def test_a_malformed_key_is_one_line(text, problem):
    assert job_key_problem({JOB_KEY_ENV: text}).startswith(problem)
    with pytest.raises(ValueError, match=problem):
        job_key({JOB_KEY_ENV: text})


def test_a_fresh_key_is_accepted_and_none_means_unauthenticated():
    fresh = new_job_key()
    assert job_key_problem({JOB_KEY_ENV: fresh}) is None
    assert job_key({JOB_KEY_ENV: fresh}) == bytes.fromhex(fresh) and len(fresh) == 64
    assert job_key({}) is None and job_key_problem({}) is None
    assert new_job_key() != fresh


def test_the_check_value_tells_keys_apart_and_is_not_the_key():
    assert key_check(KEY) == key_check(bytes(KEY)) != key_check(b"\x01" * 32)
    assert KEY.hex()[:16] not in key_check(KEY) and key_check(None) == ""


def test_a_seal_opens_only_for_its_receiver_with_its_key():
    seal, other_key = DatagramSeal(KEY), DatagramSeal(b"\x01" * 32)
    body = encode_packet(_BEAT, 0, 7, 1, 0)
    sealed = seal.seal(body, receiver=1)
    assert len(sealed) == len(body) + MAC_BYTES
    assert seal.opened(sealed, receiver=1) == body
    assert seal.opened(sealed, receiver=2) is None  # sealed for rank 1, replayed to rank 2
    assert other_key.opened(sealed, receiver=1) is None
    tampered = bytearray(sealed)
    tampered[8] ^= 1  # another sender rank, with the tag left as it was
    assert seal.opened(bytes(tampered), receiver=1) is None
    assert seal.opened(body, receiver=1) is None  # no tag at all


# ----------------------------------------------------------------------------------------------
# heartbeats with a key
# ----------------------------------------------------------------------------------------------
def _two_keyed(keys=(KEY, KEY)):
    sockets = [bind_udp(LOOPBACK) for _ in range(2)]
    addresses = [PeerAddress(rank, LOOPBACK, sock.getsockname()[1], f"node {rank}", os.getpid(),
                             3000 + rank, key_check(keys[rank]))
                 for rank, sock in enumerate(sockets)]
    lost: list[list] = [[], []]
    beats = [Heartbeat(sockets[rank], addresses[rank], [addresses[1 - rank]], INTERVAL_S,
                       TIMEOUT_S, lost[rank].append, key=keys[rank]) for rank in range(2)]
    return beats, addresses, lost


def test_one_datagram_counts_only_sealed_with_the_key_for_this_rank():
    """From the peer's own socket, in sequence (all the other checks pass), a datagram counts
    only when sealed with the job's key for this receiver."""
    sock, sink = bind_udp(LOOPBACK), bind_udp(LOOPBACK)
    me = PeerAddress(0, LOOPBACK, sock.getsockname()[1], "node 0", os.getpid(), 1)
    peer = PeerAddress(1, LOOPBACK, sink.getsockname()[1], "node 1", os.getpid(), 7)
    beat = Heartbeat(sock, me, [peer], INTERVAL_S, 100.0, lambda lost: None, key=KEY)
    try:
        beat.close(say_bye=False)  # its thread stopped: _receive alone below
        state, source = beat._state[1], (LOOPBACK, peer.port)

        def receive(kind, sequence, seal=DatagramSeal(KEY), receiver=0):
            packet = encode_packet(kind, 1, 7, sequence, 0)
            beat._receive(packet if seal is None else seal.seal(packet, receiver), source, 0.0)

        receive(_BEAT, 1, seal=None)  # unsealed: what a forger without the key sends
        receive(_BEAT, 1, seal=DatagramSeal(b"\x02" * 32))  # another job's key
        receive(_BEAT, 1, receiver=2)  # sealed for another rank
        receive(_BYE, 1, seal=None)
        assert state.beats == 0 and state.last_sequence == -1 and not state.left
        receive(_BEAT, 1)
        assert state.beats == 1 and state.last_sequence == 1
    finally:
        sink.close()


@pytest.mark.timeout(30)
def test_keyed_peers_hear_each_other():
    beats, _addresses, lost = _two_keyed()
    try:
        wait_until(lambda: all(beat.beats_received()[1 - rank] >= 3
                               for rank, beat in enumerate(beats)), 10, "three beats each way")
        assert lost == [[], []]
    finally:
        for beat in beats:
            beat.close(say_bye=False)


def _udp_from(source: tuple[str, int], target: tuple[str, int], payload: bytes) -> bytes:
    """An IPv4 packet carrying a UDP datagram from `source` to `target` (checksum 0: none, which
    IPv4 allows), for a raw socket: the sender's address is whatever it writes here."""
    udp = struct.pack("!HHHH", source[1], target[1], 8 + len(payload), 0) + payload
    header = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, socket.IPPROTO_UDP, 0,
                         socket.inet_aton(source[0]), socket.inet_aton(target[0]))
    return header + udp


def _raw_socket():
    try:
        return socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    except PermissionError:
        pytest.skip("raw sockets need root (CAP_NET_RAW)")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("key", [KEY, None], ids=["with_the_job_key", "without_a_key"])
def test_a_bye_forged_from_the_peers_own_address(key):
    """A forger that writes rank 0's own address and port as the source (a raw socket) and knows
    rank 0's run id and next sequence number sends rank 1 a bye in rank 0's name. With the job's
    key rank 1 keeps watching rank 0 and hearing its beats; without one the forgery is believed
    (rank 1 stops watching): the protection that only the key gives."""
    raw = _raw_socket()
    beats, addresses, lost = _two_keyed((key, key))
    try:
        wait_until(lambda: beats[1].beats_received()[0] >= 2, 10, "rank 0's first beats")
        with raw:
            # The next numbers rank 0 will use, and the window above them: one will be in sequence.
            for sequence in range(beats[0]._sequence + 1, beats[0]._sequence + 20):
                forged = encode_packet(_BYE, 0, addresses[0].run_id, sequence, 0)
                raw.sendto(_udp_from((LOOPBACK, addresses[0].port),
                                     (LOOPBACK, addresses[1].port), forged), (LOOPBACK, 0))
        time.sleep(4 * INTERVAL_S)
        if key is None:
            assert beats[1]._state[0].left, "the forged bye was not even believed without a key"
            return
        heard = beats[1].beats_received()[0]
        wait_until(lambda: beats[1].beats_received()[0] >= heard + 3, 10,
                   "rank 0's real beats after the forgery")
        assert not beats[1]._state[0].left and lost == [[], []]
    finally:
        for beat in beats:
            beat.close(say_bye=False)


# ----------------------------------------------------------------------------------------------
# start-up: the ranks compare their keys
# ----------------------------------------------------------------------------------------------
def _start_both(keys):
    store = dist.HashStore()
    results: list = [None, None]

    def start(rank):
        try:
            results[rank] = start_heartbeat(store, rank, 2, LOOPBACK, f"node {rank}", INTERVAL_S,
                                            TIMEOUT_S, on_lost=lambda lost: None,
                                            rendezvous_timeout_s=20, key=keys[rank])
        except BaseException as error:  # noqa: BLE001 - returned
            results[rank] = error

    threads = [threading.Thread(target=start, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


@pytest.mark.timeout(60)
@pytest.mark.parametrize("keys,message", [
    ((KEY, b"\x01" * 32), "heartbeat: rank 1 (node 1) holds another DPP_JOB_KEY than this rank "
                          "(node 0); give every node's launcher the same DPP_JOB_KEY, or none on "
                          "any"),
    ((KEY, None), "heartbeat: rank 1 (node 1) holds no DPP_JOB_KEY, and this rank (node 0) one"),
    ((None, KEY), "heartbeat: rank 1 (node 1) holds a DPP_JOB_KEY, and this rank (node 0) none"),
])
def test_ranks_with_different_keys_are_named_at_start(keys, message):
    results = _start_both(keys)
    try:
        assert isinstance(results[0], JobKeyMismatch), results[0]
        assert str(results[0]).startswith(message), str(results[0])
    finally:
        for result in results:
            if not isinstance(result, BaseException) and result is not None:
                result.close(say_bye=False)


@pytest.mark.timeout(60)
def test_ranks_with_the_same_key_start_and_beat_through_their_helpers():
    results = _start_both((KEY, KEY))
    try:
        assert not any(isinstance(result, BaseException) for result in results), results
        time.sleep(4 * TIMEOUT_S)  # sealed beats through the helper processes: nobody lost
        assert all(result.helper_pid and result._helper.poll() is None for result in results)
    finally:
        for result in results:
            if result is not None and not isinstance(result, BaseException):
                result.close(say_bye=False)


def test_the_start_line_says_which_protection_is_on():
    assert protection_line(KEY, "127.0.0.1") == (
        "job protection: one node: the rendezvous store and every socket on 127.0.0.1; heartbeats "
        "authenticated with the job's key (DPP_JOB_KEY, HMAC-SHA256), from each peer's own "
        "socket, in sequence; docs/multinode.md, \"Threat model\"")
    line = protection_line(None, "10.0.0.1")
    assert "the rendezvous store at 10.0.0.1 is reachable from the network" in line
    assert "NOT authenticated (no DPP_JOB_KEY: give every node the same one)" in line
    assert module.JOB_KEY_ENV == JOB_KEY_ENV
