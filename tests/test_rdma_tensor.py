"""rdma_tensor between two processes over loopback (UCX over TCP): every dtype, non-contiguous,
zero-size and 64 MiB tensors, any order of sends and receives, pooled buffers, timeouts naming the
peer and tag, bad headers, a killed peer. The scenarios are in _rdma_peer.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rdma_tensor
from _ports import free_local_port

HERE = Path(__file__).resolve().parent
PEER = HERE / "_rdma_peer.py"

pytestmark = pytest.mark.skipif(bool(rdma_tensor.unavailable_reason()),
                                reason=rdma_tensor.unavailable_reason() or "available")


def run_pair(scenario: str, timeout: float = 120) -> list[tuple[int, dict, str]]:
    """Both ranks of `scenario`; (exit code, its JSON result, its stderr) per rank."""
    port = free_local_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", UCX_TLS="tcp",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    processes = [subprocess.Popen([sys.executable, str(PEER), scenario, str(rank), str(port)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for rank in range(2)]
    results = []
    for process in processes:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            stderr = [other.communicate()[1][-1500:] for other in processes]
            raise AssertionError(f"{scenario}: a rank did not finish within {timeout} s; stderr "
                                 f"of rank 0: {stderr[0]!r}; of rank 1: {stderr[1]!r}")
        lines = out.strip().splitlines()
        results.append((process.returncode, json.loads(lines[-1]) if lines else {}, err))
    return results


def test_every_dtype_and_size_in_reverse_order():
    (rc0, sent, err0), (rc1, got, err1) = run_pair("dtypes")
    assert rc0 == 0 and rc1 == 0, err0 + err1
    assert got["received"] == sent["sent"] == 15
    assert got["wrong"] == []


def test_any_order_and_buffers_from_the_pool():
    results = run_pair("any_order")
    for rc, result, err in results:
        assert rc == 0, err
        assert result["wrong"] == []
        assert result["registered"] > 0
        assert result["registered_again"] == 0, "buffers were registered per message"


def test_timeout_names_peer_address_and_tag():
    (rc0, result, err0), (rc1, _, err1) = run_pair("timeout")
    assert rc0 == 0 and rc1 == 0, err0 + err1
    assert result["is_timeout_error"]
    assert "rank 1 at 127.0.0.1" in result["error"] and "tag=12345" in result["error"]
    assert 0.4 < result["seconds"] < 5


def test_bad_magic_is_a_protocol_error():
    (_, _, err0), (rc1, result, err1) = run_pair("bad_header")
    assert rc1 == 0, err1
    assert "magic" in result["error"] and "rank 0" in result["error"], result


def test_payload_shorter_than_its_shape_is_refused():
    (_, _, err0), (rc1, result, err1) = run_pair("short_payload")
    assert rc1 == 0, err1
    assert "error" in result, err0 + err1
    assert "bytes" in result["error"] or "B" in result["error"], result


def test_a_receive_posted_after_a_bad_message_gets_the_protocol_error():
    (_, _, err0), (rc1, result, err1) = run_pair("short_payload_late_recv")
    assert rc1 == 0, err1
    assert "error" in result and "protocol error" in result["error"], result


def test_killed_peer_fails_the_receive_quickly():
    (rc0, result, err0), (rc1, _, _) = run_pair("peer_killed")
    assert rc1 == 9
    assert rc0 == 0, err0
    assert "error" in result, f"expected PeerLostError, got {result}"
    assert "rank 1 at 127.0.0.1" in result["error"] and "peer lost" in result["error"]
    assert result["seconds"] < 30
