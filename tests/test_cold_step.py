"""benchmarks/cold_step.py runs and writes one row per pause (its timings are not asserted)."""
import json
import os
import subprocess
import sys

from _train_util import REPO_ROOT, _env


def test_cold_step_writes_a_row_per_pause(tmp_path):
    out = tmp_path / "cold.json"
    command = [sys.executable, os.path.join(REPO_ROOT, "benchmarks", "cold_step.py"), "--steps", "5",
               "--pause", "0", "0.001", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=_env(),
                            cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = json.loads(out.read_text())["results"]
    assert [row["pause_s"] for row in rows] == [0.0, 0.001]
    for row in rows:
        assert row["steps"] == 5 and row["forward_us_median"] > 0 and row["backward_us_median"] > 0
    assert "pause    1.0 ms before each step" in result.stdout


def test_cold_step_refuses_a_negative_pause():
    command = [sys.executable, os.path.join(REPO_ROOT, "benchmarks", "cold_step.py"), "--pause", "-1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=_env(),
                            cwd=REPO_ROOT)
    assert result.returncode == 2
    assert "every --pause >= 0" in result.stderr.strip().splitlines()[-1]
