"""benchmarks/transport_bench.py --quick runs end to end and writes the documented JSON. Speed is
reported by the benchmark, not asserted here (timings on shared CI machines are noise)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(240)
def test_transport_bench_quick(tmp_path):
    out = tmp_path / "transport.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "transport_bench.py"), "--quick",
         "--single-copy-min-bytes", "1MiB", "--json", str(out)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=220)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = json.loads(out.read_text())["results"]
    keys = {(row["transport"], row["bytes"]) for row in rows}
    assert keys == {(t, s) for t in ("shm", "shm-1copy", "shm-2copy", "gloo", "memcpy")
                    for s in (4096, 1 << 20)}
    for row in rows:
        assert row["bandwidth_gbps"] > 0
        assert 0 < row["latency_us_p50"] <= row["latency_us_p99"]
    assert "x memcpy" in result.stdout  # the table
    # Which path the shm rows took, said and recorded.
    paths = json.loads(out.read_text())["shm_paths"]
    counts = {name: path["message_counts"] for name, path in paths.items()}
    assert counts["shm"]["received_zero_copy"] > 0, counts  # 1 MiB messages lent their slot
    assert paths["shm-1copy"]["single_copy_peers"] == [0]
    assert counts["shm-1copy"]["received_single_copy"] > 0 and counts["shm-1copy"]["received_zero_copy"] == 0
    assert counts["shm-2copy"]["received_single_copy"] == counts["shm-2copy"]["received_zero_copy"] == 0
    assert "shm: slots lent from 256 KiB, single copy from" in result.stdout
    assert "shm-1copy: single copy from" in result.stdout


def test_transport_bench_rejects_bad_sizes():
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "transport_bench.py"), "--sizes", "lots"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "--sizes" in result.stderr
