"""benchmarks/trace_overhead.py --quick runs end to end (the tiny GPT with and without --trace,
paired by round and iteration) and writes its JSON. The 2% target is the benchmark's to report,
not a test's to assert (timings on shared CPUs are noisy)."""
import json
import os
import subprocess
import sys

import pytest

from _train_util import REPO_ROOT, _env, ensure_sample_data


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_quick_benchmark_writes_paired_ratios(tmp_path):
    ensure_sample_data()
    out = tmp_path / "overhead.json"
    command = [sys.executable, os.path.join(REPO_ROOT, "benchmarks", "trace_overhead.py"), "--quick",
               "--json", str(out), "--timeout", "180"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=400, env=_env(),
                            cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    settings = report["settings"]
    assert settings["quick"] is True and report["target_ratio"] == 1.02
    rounds, iters, skip = settings["rounds"], settings["iters"], settings["skip"]
    for variant in ("traced", "untraced"):
        runs = report["times_ms"][variant]
        assert len(runs) == rounds and all(len(run) == iters for run in runs), runs
        assert all(ms > 0 for run in runs for ms in run), runs
    ratio = report["ratio"]
    assert ratio["pairs"] == len(ratio["ratios"]) == rounds * (iters - skip)
    assert len(ratio["round_medians"]) == rounds
    low, high = ratio["interval_95"]
    assert 0 < low <= ratio["median"] <= high, ratio
    assert ratio["q1"] <= ratio["median"] <= ratio["q3"], ratio
    assert "median" in result.stdout and "target: median <= 1.02" in result.stdout
