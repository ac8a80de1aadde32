"""The launchers' layout defaults by GPU count (run_scripts/_launch.sh, launch_prepare), with
--dry-run and a machine's Python that reports N GPUs: a wrapper interpreter (DPP_VENV) that answers
the launcher's GPU-count query with N and runs everything else (the flag pre-check) with the real
one. RECIPE is the CPU one, as the pre-check runs on this CPU (the GPU recipes ask for --bf16)."""
from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

from _train_util import REPO_ROOT, _env, ensure_sample_data

SCRIPT = REPO_ROOT / "run_scripts" / "run_single_gpt.sh"
LAYOUT_VARIABLES = ("PP", "TP", "VPP", "NPROC", "USE_DPP", "RECIPE", "DATA_ARGS", "MASTER_PORT",
                    "RANKS_PER_GPU")


def _venv_with_gpus(tmp_path, gpus: int, memory: int | None = None) -> str:
    """A DPP_VENV whose python answers the launcher's GPU-count query with `gpus` (and, given
    `memory`, its GPU-memory query with that many bytes) and runs everything else for real."""
    venv = tmp_path / f"venv-{gpus}-gpus"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    python = venv / "bin" / "python"
    memory_answer = ("" if memory is None else
                     f'if [ "$1" = -c ] && [[ "$2" == *total_memory* ]]; then echo {memory}; exit 0; fi\n')
    python.write_text("#!/usr/bin/env bash\n"
                      f'if [ "$1" = -c ] && [[ "$2" == *torch.cuda.device_count* ]]; then echo {gpus}; exit 0; fi\n'
                      + memory_answer +
                      f'exec {shlex.quote(sys.executable)} "$@"\n')
    python.chmod(0o755)
    return str(venv)


def _dry_run(tmp_path, gpus: int, env: dict | None = None, memory: int | None = None,
             **variables: str) -> subprocess.CompletedProcess:
    """run_single_gpt.sh --dry-run on a machine standing in `gpus` GPUs (env: the environment to
    start from, default the tests'; memory: the GPU memory it reports)."""
    env = dict(_env() if env is None else env)
    for name in LAYOUT_VARIABLES:
        env.pop(name, None)
    # The launcher asks Python for the GPU count only where NVIDIA device nodes exist.
    (tmp_path / "nvidia0").touch()
    env.update(DPP_VENV=_venv_with_gpus(tmp_path, gpus, memory), DATA_DIR=str(ensure_sample_data()),
               DPP_NVIDIA_DEVICE_NODES=str(tmp_path / "nvidia[0-9]*"), RECIPE="gpt3_tiny",
               **variables)
    return subprocess.run(["bash", str(SCRIPT), "--dry-run"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=100, start_new_session=True)


def _command(stdout: str) -> list[str]:
    (line,) = [line for line in stdout.splitlines() if line.startswith("node 0: ")]
    return shlex.split(line[len("node 0: "):])


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("gpus,nproc,rounded", [(2, 2, False), (4, 4, False), (3, 2, True)])
def test_two_or_more_gpus_default_to_a_dpp_pipeline(tmp_path, gpus, nproc, rounded):
    result = _dry_run(tmp_path, gpus)
    assert result.returncode == 0, result.stdout + result.stderr
    command = _command(result.stdout)
    assert _flag(command, "--nproc-per-node") == str(nproc)
    assert _flag(command, "--pipeline-model-parallel-size") == "2" and "--use-dpp" in command
    assert f"{nproc} processes, TP=1 PP=2 VPP=1, USE_DPP=1, recipe gpt3_tiny" in result.stdout
    rounding = f"NPROC={nproc}: {nproc} of the {gpus} GPUs, a multiple of PP x TP = 2"
    assert (rounding in result.stdout) == rounded, result.stdout


@pytest.mark.timeout(120)
def test_one_gpu_runs_without_a_pipeline_and_says_use_dpp_is_off(tmp_path):
    result = _dry_run(tmp_path, 1)
    assert result.returncode == 0, result.stdout + result.stderr
    command = _command(result.stdout)
    assert _flag(command, "--nproc-per-node") == "1" and "--use-dpp" not in command
    assert _flag(command, "--pipeline-model-parallel-size") == "1"
    assert ("1 processes, TP=1 PP=1 VPP=1, --use-dpp off (USE_DPP=1 but PP=1: the dynamic schedule "
            "needs a pipeline; set PP>=2)") in result.stdout
    assert "USE_DPP=1," not in result.stdout


@pytest.mark.timeout(120)
def test_cpu_with_pp1_says_use_dpp_is_off_and_use_dpp_0_is_plain(tmp_path):
    off = _dry_run(tmp_path, 0, PP="1")
    assert off.returncode == 0, off.stdout + off.stderr
    assert "--use-dpp off (USE_DPP=1 but PP=1" in off.stdout and "--use-dpp" not in _command(off.stdout)
    plain = _dry_run(tmp_path, 0, PP="1", USE_DPP="0")
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert "PP=1 VPP=1, USE_DPP=0, recipe" in plain.stdout


@pytest.mark.timeout(120)
def test_a_layout_larger_than_the_gpus_is_one_line_exit_2(tmp_path):
    result = _dry_run(tmp_path, 2, PP="4")
    assert result.returncode == 2
    assert result.stderr.strip() == ("run_single_gpt: PP=4 x TP=1 needs 4 GPUs; this machine has 2 "
                                     "(lower PP or TP, or set NPROC)")
    assert "node 0:" not in result.stdout
