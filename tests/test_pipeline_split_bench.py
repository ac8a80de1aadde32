"""benchmarks/pipeline_split_bench.py --quick runs end to end under both schedules: the even split
and 3 | 1 train the same losses, each stage's parameter count shows its layers, and the JSON holds
the paired ratio. How fast each split is stays the benchmark's to report (shared CPUs are noisy)."""
import json
import os
import subprocess
import sys

import pytest

from _train_util import REPO_ROOT, _env


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["dpp", "megatron"])
def test_quick_benchmark_pairs_the_splits(tmp_path, schedule):
    out = tmp_path / "split.json"
    command = [sys.executable, os.path.join(REPO_ROOT, "benchmarks", "pipeline_split_bench.py"),
               "--quick", "--schedule", schedule, "--json", str(out), "--timeout", "200"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=280, env=_env(),
                            cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    even, uneven = report["summary"]["even"], report["summary"]["first=3"]
    assert uneven["same_losses_as_even"] and len(report["losses"]["even"][0]) == 3
    layer = uneven["parameters_per_stage"][0] - even["parameters_per_stage"][0]
    assert layer > 0 and even["parameters_per_stage"][1] - uneven["parameters_per_stage"][1] == layer
    ratio = uneven["ratio_to_even"]
    assert ratio["pairs"] == 2 and 0 < ratio["interval_95"][0] <= ratio["median"]
    assert "losses equal the even split's (largest relative difference" in result.stdout


def test_refuses_a_split_without_a_last_stage_layer():
    command = [sys.executable, os.path.join(REPO_ROOT, "benchmarks", "pipeline_split_bench.py"),
               "--first-stage-layers", "8"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, env=_env(),
                            cwd=REPO_ROOT)
    assert result.returncode == 2 and "--first-stage-layers 8: give 1 to 7" in result.stderr
