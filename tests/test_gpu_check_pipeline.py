"""`run_scripts/gpu_check.sh --pipeline` on the CPU: its --dry-run lists every pipeline run, each
of which the GPT launcher accepts (its own --dry-run, on a machine standing in one GPU with a
stand-in MPS control program: the flag check runs for real); and its table
(run_scripts/_gpu_pipeline_report.py) from real CPU training logs and aggregate.py reports."""
from __future__ import annotations

import json
import shlex
import statistics
import subprocess
import sys

import pytest

from _train_util import REPO_ROOT, TINY_GPT_ARGS, _env, run_training
from test_launch_gpu_defaults import _venv_with_gpus
from test_ranks_per_gpu import _launcher_env

from megatron_dpp.exit_codes import OK

SCRIPT = str(REPO_ROOT / "run_scripts" / "gpu_check.sh")
REPORT = str(REPO_ROOT / "run_scripts" / "_gpu_pipeline_report.py")
SCHEDULES = ("1f1b", "dpp", "dpp-split", "v")


def _dry_run(tmp_path, *extra: str) -> dict[str, list[str]]:
    result = subprocess.run(["bash", SCRIPT, "--pipeline", "--dry-run", "--output-dir",
                             str(tmp_path / "out"), *extra], capture_output=True, text=True,
                            timeout=60, env=_env(), cwd=REPO_ROOT)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert not (tmp_path / "out").exists()
    runs = {}
    for line in result.stdout.splitlines():
        name, command = line.split(": ", 1)
        runs[name] = shlex.split(command)
    return runs


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


@pytest.mark.timeout(60)
def test_dry_run_lists_each_pp_data_and_schedule_in_pairs_with_1f1b_first(tmp_path):
    runs = _dry_run(tmp_path, "--pipeline-layers", "16", "--pipeline-v-policy", "zb-v")
    assert list(runs) == [f"pp{pp}-{data}-{schedule}" for pp in (2, 4)
                          for data in ("packed", "varlen") for schedule in SCHEDULES]
    for name, command in runs.items():
        pp, data, schedule = name[2], name.split("-")[1], name.split("-", 2)[2]
        assert command[:7] == ["env", f"USE_DPP={0 if schedule == '1f1b' else 1}", f"PP={pp}",
                               "TP=1", f"NPROC={pp}", f"RANKS_PER_GPU={pp}", "bash"]
        assert _flag(command, "--num-layers") == "16" and "--trace" in command
        assert _flag(command, "--trace-dir") == str(tmp_path / "out" / "pipeline" / "traces" / name)
        assert ("--variable-seq-lengths" in command) == (data == "varlen")
        assert ("--dpp-split-backward" in command) == (schedule in ("dpp-split", "v"))
        assert ("--dpp-stage-placement" in command) == (schedule == "v")
        if schedule == "v":
            assert _flag(command, "--num-virtual-stages-per-pipeline-rank") == "2"
            assert _flag(command, "--dpp-policy") == "zb-v"
        assert _flag(command, "--hidden-dropout") == "0" and _flag(command, "--seed") == "1234"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["pp4-varlen-1f1b", "pp4-varlen-dpp", "pp4-varlen-dpp-split",
                                  "pp4-varlen-v", "pp2-packed-dpp"])
def test_each_pipeline_run_passes_the_launchers_own_check(tmp_path, name):
    """The run's command with --dry-run, on a machine standing in one H200 (the launcher's GPU
    queries answered, nvidia-cuda-mps-control a stand-in): the flag check passes, the command
    shares the GPU."""
    command = _dry_run(tmp_path)[name]
    (tmp_path / "nvidia0").touch()
    env = _launcher_env(tmp_path)
    for variable in ("PP", "TP", "VPP", "NPROC", "USE_DPP", "RECIPE", "DATA_ARGS", "RANKS_PER_GPU"):
        env.pop(variable, None)
    env.update(DPP_VENV=_venv_with_gpus(tmp_path, 1, 141 << 30),
               DPP_NVIDIA_DEVICE_NODES=str(tmp_path / "nvidia[0-9]*"))
    result = subprocess.run([*command, "--dry-run"], capture_output=True, text=True, timeout=300,
                            env=env, cwd=REPO_ROOT)
    assert result.returncode == OK, result.stdout + result.stderr
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("node 0: ")]
    torchrun = shlex.split(line[len("node 0: "):])
    pp = name[2]
    assert torchrun[2:5] == ["megatron_dpp.rank_launcher", "--ranks-per-gpu", pp]
    assert f"RANKS_PER_GPU={pp} ({pp} ranks on each GPU under MPS" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_report_table_from_real_pipeline_logs(tmp_path):
    """Two real CPU runs at pp=2, Megatron's 1F1B and --use-dpp, traced and aggregated; a third
    run that failed; the table gives each figure, the ratio batch by batch, and exit 1."""
    out = tmp_path / "out"
    (out / "pipeline").mkdir(parents=True)
    steps = []
    args = [*TINY_GPT_ARGS, "--train-iters", "8", "--pipeline-model-parallel-size", "2"]
    logs = {}
    for schedule, extra in (("1f1b", []), ("dpp", ["--use-dpp"])):
        name = f"pp2-packed-{schedule}"
        traces = out / "pipeline" / "traces" / name
        rc, losses, _, log = run_training([*args, *extra, "--trace", "--trace-dir", str(traces)],
                                          nproc=2, timeout=240)
        assert rc == 0, log[-3000:]
        logs[name] = (log, losses)
        memory = "".join(f"[Rank {rank}] (after 1 iterations) memory (MB) | allocated: 10.0 | max "
                         f"allocated: {100 * (rank + 1) + len(schedule)}.0 | reserved: 900.0 | "
                         f"max reserved: 900.0\n" for rank in (0, 1))  # as GPU ranks print it
        (out / "pipeline" / f"{name}.log").write_text(memory + log)
        steps.append(f"pipeline/{name}\t0\tpipeline/{name}.log\t20")
        aggregate = subprocess.run([sys.executable, str(REPO_ROOT / "profiling" / "aggregate.py"),
                                    "--benchmark_dir", str(traces)], capture_output=True,
                                   text=True, timeout=200, env=_env(), cwd=REPO_ROOT)
        assert aggregate.returncode == 0, aggregate.stderr
        (out / "pipeline" / f"{name}-aggregate.log").write_text(aggregate.stdout)
        steps.append(f"aggregate/{name}\t0\tpipeline/{name}-aggregate.log\t5")
    (out / "pipeline" / "pp2-packed-v.log").write_text("Traceback ...\n")
    steps.append("pipeline/pp2-packed-v\t1\tpipeline/pp2-packed-v.log\t3")
    (out / "steps.tsv").write_text("\n".join(steps) + "\n")
    seq = int(args[args.index("--seq-length") + 1])
    result = subprocess.run([sys.executable, REPORT, str(out), "--seq-length", str(seq)],
                            capture_output=True, text=True, timeout=60, env=_env())
    assert result.returncode == 1, result.stdout + result.stderr
    summary = json.loads((out / "pipeline.json").read_text())
    runs = {run["name"]: run for run in summary["runs"]}
    base, dpp, failed = runs["pp2-packed-1f1b"], runs["pp2-packed-dpp"], runs["pp2-packed-v"]
    assert summary["failed_steps"] == ["pipeline/pp2-packed-v"] and not failed["passed"]
    assert base["losses"] == pytest.approx(logs["pp2-packed-1f1b"][1], rel=1e-6)
    assert len(base["ms"]) == 8 and base["peak_mb_per_rank"] == [104.0, 204.0]
    assert base["tokens_per_s"] == pytest.approx(8 * seq / (base["ms_per_iteration"] / 1e3))
    assert 0.0 <= base["bubble"] < 1.0 and 0.0 <= dpp["bubble"] < 1.0
    ratios = [a / b for a, b in zip(dpp["ms"][3:], base["ms"][3:])]
    assert dpp["vs_1f1b"]["median"] == pytest.approx(statistics.median(ratios))
    assert dpp["vs_1f1b"]["pairs"] == 5 and base["vs_1f1b"]["median"] == 1.0
    assert dpp["loss_rel_diff"] < 1e-4 and base["loss_rel_diff"] == 0.0
    assert failed["vs_1f1b"] is None and failed["loss_rel_diff"] is None
    lines = result.stdout.splitlines()
    (row,) = [line for line in lines if line.startswith("pp2-packed-dpp ")]
    assert f"{dpp['vs_1f1b']['median']:.3f} ({dpp['vs_1f1b']['q1']:.3f}-{dpp['vs_1f1b']['q3']:.3f})" in row
    assert f"{100 * dpp['bubble']:.1f}%" in row and "103 203" in row
    assert any(line.startswith("pp2-packed-v ") and "FAIL (1)" in line for line in lines)
    assert lines[-1] == "failed steps: pipeline/pp2-packed-v"


SESSION = str(REPO_ROOT / "run_scripts" / "gpu_session.sh")


@pytest.mark.timeout(60)
def test_session_help_names_every_flag_and_what_comes_back():
    result = subprocess.run(["bash", SESSION, "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0
    for word in ("--deadline", "--test-workers", "--suite-cores", "--pipeline-cores",
                 "--pipeline-layers", "session.txt", "pipeline.txt", "pipeline.json", "tests.txt",
                 "setup.txt", "logs.tar.gz"):
        assert word in result.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,message", [
    ([], "usage: bash run_scripts/gpu_session.sh OUT_DIR [flags]"),
    (["OUT", "--deadline", "0"], "--deadline 0: expected a positive whole number"),
    (["OUT", "--suite-cores", "a"], "--suite-cores a: expected a CPU list"),
    (["OUT", "--bogus", "1"], "unknown argument --bogus"),
    (["OUT", "--deadline"], "--deadline needs a value"),
])
def test_session_bad_flags_are_one_line_exit_2(tmp_path, args, message):
    result = subprocess.run(["bash", SESSION, *args], capture_output=True, text=True, timeout=30,
                            cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr
    assert not (tmp_path / "OUT").exists()
