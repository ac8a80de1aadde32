"""benchmarks/gpu_speed_anchor.py on the CPU (--device cpu --quick): the table, the JSON's fields,
flags overriding the quick shape, the written-out attention, bad flags (one line, exit 2), and
--device cuda without a GPU (one line, exit 0)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from _train_util import REPO_ROOT, _env, main_in_process

ANCHOR = str(REPO_ROOT / "benchmarks" / "gpu_speed_anchor.py")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, ANCHOR, *args], capture_output=True, text=True,
                          timeout=110, env=_env(), cwd=REPO_ROOT)


def _run_here(*args: str) -> subprocess.CompletedProcess:
    """gpu_speed_anchor.main in this process (a process of its own spends 2 s importing torch)."""
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    import gpu_speed_anchor

    return main_in_process(gpu_speed_anchor.main, args)


@pytest.mark.timeout(120)
def test_quick_cpu_run_prints_a_table_and_writes_its_json(tmp_path):
    out = tmp_path / "anchor.json"
    result = _run("--device", "cpu", "--quick", "--steps", "3", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "tokens/s" in result.stdout and "attention sdpa" in result.stdout
    report = json.loads(out.read_text())
    assert report["config"]["steps"] == 3 and report["config"]["layers"] == 2
    assert report["attention"] == "sdpa" and report["config"]["precision"] == "bf16"
    assert report["tokens_per_step"] == 2 * 2 * 64
    ms = report["ms_per_step"]
    assert 0 < ms["min"] <= ms["median"] <= ms["max"]
    by_step = report["tokens_per_s_by_step"]
    assert by_step["min"] <= report["tokens_per_s"] <= by_step["max"]
    assert report["tokens_per_s"] == pytest.approx(
        report["tokens_per_step"] * 3 / (sum([ms["min"], ms["median"], ms["max"]]) / 1e3), rel=1e-6)
    assert len(report["losses"]) == 3 and report["params"] > 0 and report["model_tflops"] > 0


@pytest.mark.timeout(120)
def test_unfused_attention_in_fp32(tmp_path):
    out = tmp_path / "anchor.json"
    result = _run("--device", "cpu", "--quick", "--unfused", "--precision", "fp32", "--dropout", "0",
                  "--json", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["attention"] == "unfused" and report["config"]["dropout"] == 0.0


BAD_FLAGS = [
    (["--device", "cpu", "--quick", "--hidden", "30"], "--hidden 30 must be a multiple of --heads 4"),
    (["--device", "cpu", "--steps", "0"], "--steps must be at least 1"),
    (["--device", "cpu", "--dropout", "1.5"], "--dropout must be in [0, 1)"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,message", BAD_FLAGS)
def test_bad_flags_are_one_line_exit_2(args, message):
    # The first case through the command (its exit code and stderr as a process's), the others
    # in this process.
    result = _run(*args) if args == BAD_FLAGS[0][0] else _run_here(*args)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr


@pytest.mark.timeout(60)
def test_without_a_gpu_cuda_says_so_in_one_line_and_exits_0(tmp_path):
    result = _run("--quick", "--json", str(tmp_path / "anchor.json"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("gpu_speed_anchor: --device cuda: no CUDA GPU here "
                                     "(torch.cuda.is_available() is False); nothing measured "
                                     "(--device cpu runs on the CPU)")
    assert not (tmp_path / "anchor.json").exists()
