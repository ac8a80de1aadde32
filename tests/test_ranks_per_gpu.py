"""Several pipeline ranks on one GPU (megatron_dpp/shared_gpu.py, the launcher's --ranks-per-gpu,
the run scripts' RANKS_PER_GPU), on the CPU: the device map, the backend choice, the environment
each rank gets, and the MPS control daemon's life cycle (started, stopped on a normal end, on a
failing rank and on SIGTERM to the launcher, its directories removed) through a stand-in
`nvidia-cuda-mps-control` first on PATH that records its invocations. The ranks are plain Python
scripts under the real launcher and torchrun; what MPS does to kernels needs a GPU."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _train_util import REPO_ROOT, _env, ensure_sample_data
from test_launch_gpu_defaults import _command
from test_launch_gpu_defaults import _dry_run as launch_dry_run

from megatron_dpp import shared_gpu


# A stand-in for NVIDIA's control program: each call appends one JSON line (its arguments, what it
# read on stdin for a quit, the pipe directory and whether it exists). -d starts a "daemon" (a
# detached sleeper) and writes its pid where NVIDIA's daemon writes its own, unless
# $MPS_STANDIN_STATUS makes it fail; a quit ends that daemon half a second later, as the real one
# ends after quit returns.
_STANDIN = """#!/usr/bin/env python3
import json, os, subprocess, sys
args = sys.argv[1:]
stdin = "" if args == ["-d"] else sys.stdin.read()
pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "")
pid_file = os.path.join(pipe, "nvidia-cuda-mps-control.pid")
quiet = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
             start_new_session=True)
status = int(os.environ.get("MPS_STANDIN_STATUS", "0")) if args == ["-d"] else 0
pid = None
if args == ["-d"] and status == 0:
    pid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], **quiet).pid
    with open(pid_file, "w") as f:
        f.write(str(pid))
if stdin == "quit\\n" and os.path.exists(pid_file):
    pid = int(open(pid_file).read())
    subprocess.Popen([sys.executable, "-c", "import os, time; time.sleep(0.5); os.kill(%d, 15)" % pid],
                     **quiet)
with open(os.environ["MPS_STANDIN_LOG"], "a") as log:
    log.write(json.dumps({"args": args, "stdin": stdin, "pipe": pipe, "daemon": pid,
                          "pipe_exists": os.path.isdir(pipe),
                          "log_dir": os.environ.get("CUDA_MPS_LOG_DIRECTORY", "")}) + "\\n")
sys.exit(status)
"""

# A rank: writes its environment's share of the job, then ends as MODE says.
_RANK = """import json, os, sys, time
out, mode = sys.argv[1], sys.argv[2]
names = ("LOCAL_RANK", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY",
         "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "DPP_RANKS_PER_GPU")
with open(os.path.join(out, "rank%s.json" % os.environ["LOCAL_RANK"]), "w") as f:
    json.dump({name: os.environ.get(name) for name in names}, f)
if mode == "fail" and os.environ["LOCAL_RANK"] == "1":
    sys.exit(3)
if mode == "wait":
    time.sleep(60)
"""


def _standin_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    control = bin_dir / shared_gpu.MPS_CONTROL
    control.write_text(_STANDIN)
    control.chmod(0o755)
    return bin_dir


def _calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _path_without_control(path: list[str]) -> list[str]:
    """PATH without the directories holding a real control program; skips the test where such a
    directory also holds what the test runs (bash, env: a GPU machine's /usr/bin)."""
    kept = []
    for directory in path:
        if not (Path(directory) / shared_gpu.MPS_CONTROL).exists():
            kept.append(directory)
        elif any((Path(directory) / tool).exists() for tool in ("bash", "env")):
            pytest.skip(f"{shared_gpu.MPS_CONTROL} is in {directory} beside bash: it cannot be "
                        f"left off PATH")
    return kept


def _launcher_env(tmp_path: Path, with_control: bool = True, **extra: str) -> dict:
    env = _env()
    path = env.get("PATH", "").split(os.pathsep)
    if with_control:  # the stand-in first: it answers, not a real one further on
        path.insert(0, str(_standin_bin(tmp_path)))
    else:
        path = _path_without_control(path)
    env.update(PATH=os.pathsep.join(path), MPS_STANDIN_LOG=str(tmp_path / "mps.log"), **extra)
    for name in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY",
                 "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", shared_gpu.RANKS_PER_GPU_ENV):
        env.pop(name, None)
    return env


def _launcher(tmp_path: Path, mode: str, per_gpu: str = "2", nproc: int = 2) -> list[str]:
    rank = tmp_path / "rank.py"
    rank.write_text(_RANK)
    (tmp_path / "out").mkdir(exist_ok=True)
    return [sys.executable, "-m", "megatron_dpp.rank_launcher", "--ranks-per-gpu", per_gpu,
            "--standalone", "--nproc-per-node", str(nproc), str(rank), str(tmp_path / "out"), mode]


def _ranks(tmp_path: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted((tmp_path / "out").glob("rank*.json"))]


# ---- the pieces ------------------------------------------------------------------------------

@pytest.mark.parametrize("per_gpu,devices", [(1, [0, 1, 2, 3]), (2, [0, 0, 1, 1]), (4, [0, 0, 0, 0])])
def test_device_map_puts_consecutive_ranks_on_one_gpu(per_gpu, devices):
    assert [shared_gpu.device_index(rank, per_gpu) for rank in range(4)] == devices


@pytest.mark.parametrize("local_rank,per_gpu,device,backend", [
    ("3", "2", 1, "gloo"), ("1", "2", 0, "gloo"), ("2", "4", 0, "gloo"), ("1", None, 1, "nccl")])
def test_platform_takes_the_shared_device_and_gloo(monkeypatch, local_rank, per_gpu, device, backend):
    """setup_platform on a machine that has CUDA (stood in): the device of LOCAL_RANK // N, gloo
    where ranks share it."""
    from megatron_dpp import platform

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    if per_gpu is None:
        monkeypatch.delenv(shared_gpu.RANKS_PER_GPU_ENV, raising=False)
    else:
        monkeypatch.setenv(shared_gpu.RANKS_PER_GPU_ENV, per_gpu)
    result = platform.setup_platform()
    assert chosen == [device]
    assert result.device == torch.device("cuda", device) and result.backend == backend


@pytest.mark.parametrize("asked,cuda,per_gpu,backend", [
    (None, True, 1, "nccl"), (None, True, 2, "gloo"), (None, False, 1, "gloo"),
    (None, False, 2, "gloo"), ("gloo", True, 1, "gloo")])
def test_backend_choice(asked, cuda, per_gpu, backend):
    assert shared_gpu.shared_gpu_backend(asked, cuda, per_gpu) == backend


def test_each_rank_gets_the_daemons_directories_its_sm_share_and_n():
    assert shared_gpu.rank_environment("/tmp/dpp_mps.x", 4) == {
        "CUDA_MPS_PIPE_DIRECTORY": "/tmp/dpp_mps.x/pipe",
        "CUDA_MPS_LOG_DIRECTORY": "/tmp/dpp_mps.x/log",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25", shared_gpu.RANKS_PER_GPU_ENV: "4"}
    assert [shared_gpu.sm_percentage(n) for n in (1, 2, 3, 4)] == [100, 50, 33, 25]


@pytest.mark.parametrize("per_gpu,nproc,gpus,message", [
    (2, 4, 2, None), (2, 4, None, None),
    (2, 3, 2, "--ranks-per-gpu 2 does not divide the node's 3 ranks"),
    (2, 6, 2, "6 ranks at 2 per GPU need 3 GPUs; this node has 2"),
    (0, 2, 1, "--ranks-per-gpu 0: expected a positive whole number")])
def test_layout_error(per_gpu, nproc, gpus, message):
    error = shared_gpu.layout_error(per_gpu, nproc, gpus)
    assert error == message if message is None else message in error


# ---- the flag check (the launcher's precheck) --------------------------------------------------

def _precheck(extra: list[str], **env: str) -> subprocess.CompletedProcess:
    data = ensure_sample_data()
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
             "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3",
             "--pipeline-model-parallel-size", "2",
             "--data-path", str(data / "sample_text_document"), "--vocab-file",
             str(data / "vocab.json"), "--merge-file", str(data / "merges.txt"), *extra]
    return subprocess.run([sys.executable, "-m", "megatron_dpp.arguments", "gpt", *flags],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                          env={**_env(), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0",
                               **env})


@pytest.mark.timeout(300)
def test_precheck_refuses_nccl_the_distributed_optimizer_and_too_little_memory():
    shared = {shared_gpu.RANKS_PER_GPU_ENV: "2"}
    nccl = _precheck(["--distributed-backend", "nccl"], **shared)
    assert nccl.returncode == 2 and len(nccl.stderr.strip().splitlines()) == 1
    assert "NCCL refuses two ranks on one device" in nccl.stderr
    optimizer = _precheck(["--use-distributed-optimizer"], **shared)
    assert optimizer.returncode == 2 and "--use-distributed-optimizer with 2 ranks per GPU" in optimizer.stderr
    small = _precheck([], DPP_GPU_MEMORY_BYTES="100000", **shared)
    assert small.returncode == 2 and len(small.stderr.strip().splitlines()) == 1, small.stderr
    assert "2 ranks per GPU need at least" in small.stderr and "the GPU has 0.0 GiB" in small.stderr
    fits = _precheck([], DPP_GPU_MEMORY_BYTES=str(141 << 30), **shared)
    assert fits.returncode == 0, fits.stderr


def test_memory_estimate_follows_the_ranks_on_the_first_gpu(monkeypatch):
    """Pipeline ranks 0..N-1 on the first GPU: each more rank adds its layers' states and 1F1B's
    activations (pp - p micro-batches on rank p)."""
    from megatron_dpp.arguments import parse_args
    from megatron_dpp.models.flags import largest_microbatch_activation_bytes
    from megatron_dpp.shared_gpu_memory import first_gpu_bytes

    data = ensure_sample_data()
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv(shared_gpu.RANKS_PER_GPU_ENV, raising=False)
    args = parse_args(["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
                       "--seq-length", "64", "--max-position-embeddings", "64",
                       "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "2",
                       "--lr", "1e-3", "--pipeline-model-parallel-size", "4", "--bf16",
                       "--data-path", str(data / "sample_text_document"),
                       "--vocab-file", str(data / "vocab.json"),
                       "--merge-file", str(data / "merges.txt")], model="gpt")
    microbatch = largest_microbatch_activation_bytes(args)
    one, two = first_gpu_bytes(args, 1), first_gpu_bytes(args, 2)
    assert microbatch > 0 and one > 4 * microbatch
    assert two - one == one - microbatch  # rank 1: the same states, one micro-batch fewer


# ---- the daemon's life cycle through the launcher -----------------------------------------------

def _assert_daemon_started_and_stopped(tmp_path: Path) -> str:
    calls = _calls(tmp_path / "mps.log")
    assert [call["args"] for call in calls] == [["-d"], []], calls
    start, stop = calls
    assert start["pipe_exists"] and stop["pipe_exists"]  # made before the start, kept to the quit
    assert stop["stdin"] == "quit\n" and stop["pipe"] == start["pipe"]
    assert start["daemon"] is not None and stop["daemon"] == start["daemon"]
    assert not shared_gpu._running(start["daemon"])  # waited for: gone when the launcher ends
    directory = os.path.dirname(start["pipe"])
    assert directory.startswith("/tmp/dpp_mps.") and start["log_dir"] == directory + "/log"
    assert not os.path.exists(directory)  # removed
    return directory


@pytest.mark.timeout(120)
def test_a_normal_end_stops_the_daemon_and_each_rank_got_its_share(tmp_path):
    result = subprocess.run(_launcher(tmp_path, "ok"), capture_output=True, text=True,
                            timeout=100, env=_launcher_env(tmp_path), cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    directory = _assert_daemon_started_and_stopped(tmp_path)
    assert result.stdout.splitlines()[0] == (
        f"megatron_dpp.rank_launcher: ranks per GPU: 2 (rank r on GPU r // 2: 2 ranks on 1 GPU); "
        f"MPS control daemon started (CUDA_MPS_PIPE_DIRECTORY={directory}/pipe), 50% of the SMs "
        f"per rank (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE); collectives over gloo (NCCL refuses two "
        f"ranks on one device), CUDA tensors staged through the host where gloo lacks the operation")
    ranks = _ranks(tmp_path)
    assert [rank["LOCAL_RANK"] for rank in ranks] == ["0", "1"]
    for rank in ranks:
        assert rank["CUDA_MPS_PIPE_DIRECTORY"] == directory + "/pipe"
        assert rank["CUDA_MPS_LOG_DIRECTORY"] == directory + "/log"
        assert rank["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        assert rank[shared_gpu.RANKS_PER_GPU_ENV] == "2"


@pytest.mark.timeout(120)
def test_a_failing_rank_stops_the_daemon(tmp_path):
    result = subprocess.run(_launcher(tmp_path, "fail"), capture_output=True, text=True,
                            timeout=100, env=_launcher_env(tmp_path), cwd=REPO_ROOT)
    assert result.returncode == 3, result.stdout + result.stderr
    _assert_daemon_started_and_stopped(tmp_path)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_stops_the_daemon(tmp_path, signum):
    launcher = subprocess.Popen(_launcher(tmp_path, "wait"), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=_launcher_env(tmp_path),
                                cwd=REPO_ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(_ranks(tmp_path)) < 2:  # both ranks started: the daemon runs
            assert time.monotonic() < deadline, "the ranks did not start within 60 s"
            assert launcher.poll() is None, launcher.communicate()
            time.sleep(0.2)
        launcher.send_signal(signum)
        out, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 128 + signum, out + err
    _assert_daemon_started_and_stopped(tmp_path)


@pytest.mark.timeout(60)
def test_a_daemon_that_does_not_start_is_one_line_and_no_rank_runs(tmp_path):
    result = subprocess.run(_launcher(tmp_path, "ok"), capture_output=True, text=True, timeout=50,
                            env=_launcher_env(tmp_path, MPS_STANDIN_STATUS="1"), cwd=REPO_ROOT)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == ("megatron_dpp.rank_launcher: error: nvidia-cuda-mps-control "
                                     "-d could not start the daemon (exit status 1)")
    (start,) = _calls(tmp_path / "mps.log")
    assert not os.path.exists(os.path.dirname(start["pipe"])) and _ranks(tmp_path) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("with_control,per_gpu,nproc,message", [
    (False, "2", 2, "error: nvidia-cuda-mps-control is not on PATH (NVIDIA's MPS, which several "
                    "ranks on one GPU need)"),
    (True, "2", 3, "error: --ranks-per-gpu 2 does not divide the node's 3 ranks; give a number of "
                   "ranks that is a multiple of 2"),
    (True, "x", 2, "error: --ranks-per-gpu x: expected a positive whole number")])
def test_the_launcher_refuses_in_one_line_before_anything_starts(tmp_path, with_control, per_gpu,
                                                                 nproc, message):
    result = subprocess.run(_launcher(tmp_path, "ok", per_gpu, nproc), capture_output=True,
                            text=True, timeout=50, env=_launcher_env(tmp_path, with_control),
                            cwd=REPO_ROOT)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == f"megatron_dpp.rank_launcher: {message}"
    assert _calls(tmp_path / "mps.log") == [] and _ranks(tmp_path) == []


# ---- the run scripts' RANKS_PER_GPU (--dry-run on a machine standing in N GPUs) ---------------

def _dry_run(tmp_path: Path, gpus: int, memory: int = 141 << 30, with_control: bool = True,
             **variables: str) -> subprocess.CompletedProcess:
    """test_launch_gpu_defaults' dry run, with the stand-in MPS control program on PATH or not."""
    return launch_dry_run(tmp_path, gpus, env=_launcher_env(tmp_path, with_control), memory=memory,
                          **variables)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variables,nproc,pp", [({"RANKS_PER_GPU": "2"}, 2, 2),
                                                ({"RANKS_PER_GPU": "4", "PP": "4"}, 4, 4)])
def test_ranks_per_gpu_on_one_gpu_makes_a_pipeline(tmp_path, variables, nproc, pp):
    result = _dry_run(tmp_path, 1, **variables)
    assert result.returncode == 0, result.stdout + result.stderr
    command = _command(result.stdout)
    n = variables["RANKS_PER_GPU"]
    assert command[2:5] == ["megatron_dpp.rank_launcher", "--ranks-per-gpu", n]
    assert command[command.index("--nproc-per-node") + 1] == str(nproc)
    assert command[command.index("--pipeline-model-parallel-size") + 1] == str(pp)
    assert "--use-dpp" in command
    assert (f"{nproc} processes, TP=1 PP={pp} VPP=1, USE_DPP=1, RANKS_PER_GPU={n} ({n} ranks on "
            f"each GPU under MPS, gloo collectives), recipe gpt3_tiny") in result.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("gpus,with_control,variables,message", [
    (1, False, {"RANKS_PER_GPU": "2"},
     "RANKS_PER_GPU=2 needs NVIDIA's MPS: nvidia-cuda-mps-control is not on PATH"),
    (0, True, {"RANKS_PER_GPU": "2"},
     "RANKS_PER_GPU=2 shares GPUs between ranks; this machine has none"),
    (2, True, {"RANKS_PER_GPU": "2", "NPROC": "3", "PP": "1"},
     "RANKS_PER_GPU=2 does not divide NPROC=3, the node's ranks; give a multiple of 2"),
    (1, True, {"RANKS_PER_GPU": "2", "NPROC": "4"},
     "NPROC=4 at RANKS_PER_GPU=2 needs 2 GPUs; this machine has 1"),
    (1, True, {"RANKS_PER_GPU": "2", "TP": "2", "NPROC": "2", "PP": "1"},
     "RANKS_PER_GPU=2 with TP=2: the tensor-parallel all-reduces"),
    (1, True, {"RANKS_PER_GPU": "0"}, "RANKS_PER_GPU=0 is not a positive whole number")])
def test_ranks_per_gpu_where_it_cannot_work_is_one_line_exit_2(tmp_path, gpus, with_control,
                                                                variables, message):
    result = _dry_run(tmp_path, gpus, with_control=with_control, **variables)
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr, result.stderr
    assert "node 0:" not in result.stdout


@pytest.mark.timeout(120)
def test_ranks_per_gpu_beyond_the_gpus_memory_is_refused(tmp_path):
    result = _dry_run(tmp_path, 1, memory=1 << 20, RANKS_PER_GPU="2")
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "2 ranks per GPU need at least" in result.stderr and "the GPU has 0.0 GiB" in result.stderr
    assert "node 0:" not in result.stdout


# ---- python -m megatron_dpp.shared_gpu: a command under the daemon (gpu_check.sh's transport) ---

_SHOW_ENV = ("import os, sys; print(os.environ['CUDA_MPS_PIPE_DIRECTORY'], "
             "os.environ['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE']); sys.exit(int(sys.argv[1]))")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("status", [0, 5])
def test_a_command_under_the_daemon_gets_its_environment_and_exit_status(tmp_path, status):
    result = subprocess.run([sys.executable, "-m", "megatron_dpp.shared_gpu", "--ranks-per-gpu",
                             "2", "--", sys.executable, "-c", _SHOW_ENV, str(status)],
                            capture_output=True, text=True, timeout=50,
                            env=_launcher_env(tmp_path), cwd=REPO_ROOT)
    assert result.returncode == status, result.stderr
    directory = _assert_daemon_started_and_stopped(tmp_path)
    assert result.stdout.split() == [directory + "/pipe", "50"]


@pytest.mark.timeout(60)
def test_a_command_stopped_by_sigterm_stops_the_daemon(tmp_path):
    ready = tmp_path / "ready"
    sleeper = f"import pathlib, time; pathlib.Path({str(ready)!r}).touch(); time.sleep(60)"
    wrapper = subprocess.Popen([sys.executable, "-m", "megatron_dpp.shared_gpu", "--ranks-per-gpu",
                                "2", "--", sys.executable, "-c", sleeper],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=_launcher_env(tmp_path), cwd=REPO_ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert time.monotonic() < deadline, "the command did not start within 30 s"
            time.sleep(0.1)
        wrapper.send_signal(signal.SIGTERM)
        out, err = wrapper.communicate(timeout=30)
    finally:
        if wrapper.poll() is None:
            os.killpg(wrapper.pid, signal.SIGKILL)
    assert wrapper.returncode == 128 + signal.SIGTERM, out + err
    _assert_daemon_started_and_stopped(tmp_path)
