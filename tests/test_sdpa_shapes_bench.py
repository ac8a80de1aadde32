"""benchmarks/sdpa_shapes.py on the CPU: --quick runs every backend it names (the ones this torch
cannot run with dropout on the CPU reported unavailable, with torch's reason), writes the JSON
gpu_check.sh's report reads; bad flags are one line and exit 2; --device cuda without a GPU says so
and exits 0."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from _train_util import REPO_ROOT, _env, main_in_process

BENCH = str(REPO_ROOT / "benchmarks" / "sdpa_shapes.py")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True,
                          timeout=120, env=_env(), cwd=REPO_ROOT)


def _run_here(*args: str) -> subprocess.CompletedProcess:
    """sdpa_shapes.main in this process (a process of its own spends 2 s importing torch)."""
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    import sdpa_shapes

    return main_in_process(sdpa_shapes.main, args)


@pytest.mark.timeout(150)
def test_quick_run_times_the_cpus_backend_and_names_the_unavailable_ones(tmp_path):
    out = tmp_path / "shapes.json"
    result = _run("--device", "cpu", "--quick", "--json", str(out))
    assert result.returncode == 0, result.stderr
    shapes = json.loads(out.read_text())
    assert shapes["default_backend"] == "math" and shapes["dtype"] == "float32"
    rows = {row["backend"]: row for row in shapes["results"]}
    assert list(rows) == ["default", "cudnn", "flash", "efficient", "math"]
    for name in ("default", "math"):  # the CPU's attention with dropout
        assert rows[name]["available"] and rows[name]["repeated_ms"] > 0 < rows[name]["fresh_ms"]
        assert rows[name]["new_shape_ms"] == pytest.approx(
            rows[name]["fresh_ms"] - rows[name]["repeated_ms"])
    assert not rows["cudnn"]["available"] and rows["cudnn"]["why"]
    assert "a new length each call" in result.stdout and "cudnn      unavailable:" in result.stdout


BAD_FLAGS = [
    (["--backends", "cudnn,fast"], "--backends: unknown fast"),
    (["--fresh", "0"], "--fresh must be at least 1"),
    (["--length", "8", "--fresh", "4"], "--length 8 leaves too few new lengths"),
    (["--dropout", "1.5"], "--dropout must be in [0, 1)"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, message", BAD_FLAGS)
def test_bad_flags_are_one_line_exit_2(args, message):
    # The first case through the command (its exit code and output as a process's), the others
    # in this process.
    run = _run if args == BAD_FLAGS[0][0] else _run_here
    result = run("--device", "cpu", *args)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("sdpa_shapes: error: ")
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.timeout(60)
def test_without_a_gpu_it_says_so_and_exits_0():
    result = _run()
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("sdpa_shapes: no CUDA GPU here (torch.cuda.is_available() is "
                                     "False); nothing to measure")
