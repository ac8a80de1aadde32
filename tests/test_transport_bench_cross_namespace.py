"""benchmarks/transport_bench.py --cross-namespace --quick runs its two ranks in two network
namespaces and writes the documented JSON: gloo and tcp rows, rdma rows where rdma_tensor imports
(else the reason it was skipped), the issue's targets, and no namespace left behind. Speed is
reported by the benchmark, not asserted here."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _netns import netns_skip_reason

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH = REPO_ROOT / "benchmarks" / "transport_bench.py"
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
from cross_namespace_bench import rdma_skip_reason  # noqa: E402


@pytest.mark.timeout(150)
def test_cross_namespace_quick(tmp_path):
    reason = netns_skip_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "xns.json"
    result = subprocess.run(
        [sys.executable, str(BENCH), "--cross-namespace", "--quick", "--json", str(out),
         "--timeout", "100"],  # fails, and cleans up, before the subprocess timeout
        cwd=REPO_ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
        timeout=130)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    document = json.loads(out.read_text())
    rdma_runs = rdma_skip_reason() is None
    transports = {"gloo", "tcp"} | ({"rdma"} if rdma_runs else set())
    rows = {(row["transport"], row["bytes"]): row for row in document["results"]}
    assert set(rows) == {(t, s) for t in transports for s in (4096, 1 << 20)}
    for row in rows.values():
        assert row["bandwidth_gbps"] > 0 and row["latency_us_p50"] > 0 and row["latency_us_p99"] > 0
        assert len(row["bandwidth_gbps_rounds"]) == len(row["latency_us_p50_rounds"]) == 2
        assert min(row["bandwidth_gbps_rounds"]) > 0
    targets = document["targets"]
    latency, bandwidth = targets["latency_4KiB_rdma_over_gloo"], targets["bandwidth_rdma_over_tcp"]
    assert set(bandwidth) == {str(1 << 20)}
    if rdma_runs:
        assert latency["ratio"] > 0 and isinstance(latency["met"], bool)
        assert bandwidth[str(1 << 20)]["ratio"] > 0
        # UCX went over the veth by TCP, not through the shared /dev/shm.
        interface = document["network"]["interfaces"][0]
        assert f"tcp/{interface}" in document["rdma_endpoint"], document["rdma_endpoint"]
        assert "posix" not in document["rdma_endpoint"] and "sysv" not in document["rdma_endpoint"]
    else:
        assert "rdma" in document["skipped"] and "rdma: skipped" in result.stdout
        assert latency["met"] is None and bandwidth[str(1 << 20)]["met"] is None
    for rank, interface in enumerate(document["network"]["interfaces"]):
        assert document["environment"][rank] == {
            "UCX_TLS": "tcp", "UCX_NET_DEVICES": interface, "GLOO_SOCKET_IFNAME": interface}
    assert "UCX_TLS=tcp" in result.stdout and "rdma/gloo" in result.stdout
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    assert not set(document["network"]["namespaces"]) & set(listing.stdout.split())


def test_cross_namespace_rejects_a_same_node_transport():
    result = subprocess.run(
        [sys.executable, str(BENCH), "--cross-namespace", "--transports", "shm"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--transports" in result.stderr and "rdma,gloo,tcp" in result.stderr
