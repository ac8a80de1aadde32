"""The test suite's way of starting training runs (_forked_ranks.py: ranks forked from preloaded
servers) keeps what torchrun gives a rank and does on a failure, so that the tests that train
through it test what a torchrun job would do."""
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from _forked_ranks import run_forked
from _train_util import PYTHON, TINY_GPT_ARGS, _env, data_args, run_training

TESTS_DIR = Path(__file__).resolve().parent


def _probe_lines(output: str) -> dict:
    records = [json.loads(line[len("probe "):]) for line in output.splitlines()
               if line.startswith("probe {")]
    return {record["rank"]: record for record in records}


def _torchrun_probe(mode: str, nproc: int) -> tuple[int, str]:
    result = subprocess.run([PYTHON, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc-per-node={nproc}", "-m", "_rank_probe", mode],
                            capture_output=True, text=True, env=_env(), cwd=TESTS_DIR, timeout=120)
    return result.returncode, result.stdout + result.stderr


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.timeout(240)
def test_a_forked_rank_sees_what_torchrun_gives_it():
    rc, output = run_forked("_rank_probe", ["env"], nproc=2, env=_env(), cwd=TESTS_DIR,
                            timeout=120)
    assert rc == 0, output[-3000:]
    forked = _probe_lines(output)
    torchrun_rc, torchrun_output = _torchrun_probe("env", 2)
    assert torchrun_rc == 0, torchrun_output[-3000:]
    reference = _probe_lines(torchrun_output)
    assert sorted(forked) == sorted(reference) == [0, 1], output[-3000:]
    for rank in (0, 1):
        ours, theirs = forked[rank], reference[rank]
        for name in ("MASTER_PORT", "TORCHELASTIC_RUN_ID"):  # the job's own
            assert ours["variables"].pop(name) and theirs["variables"].pop(name)
        assert ours["variables"] == theirs["variables"], (ours, theirs)
        assert ours["name"] == theirs["name"] == "__main__"
        assert ours["argv"] == theirs["argv"] and ours["argv"][0].endswith("_rank_probe.py")
        assert ours["cwd"] == theirs["cwd"] == ours["path0"] == str(TESTS_DIR)
        assert ours["session"] == ours["pid"]  # a session of its own, as torchrun starts ranks
    # One interpreter each: the string hashes differ between ranks, as between processes.
    assert forked[0]["hash"] != forked[1]["hash"]


# Imported on first use by torch.autograd.profiler.record_function: one small module.
IMPORTED_AT_FIRST_USE = {"torch.profiler._cupti_monitor"}


@pytest.mark.timeout(240)
def test_a_forked_rank_that_trains_imports_nothing_the_servers_could_have():
    """The servers preload what a rank imports (_rank_zygote.preload), also inside functions: each
    module of torch, Megatron-Core, this package or their libraries left to the rank costs every
    rank of every test run its import (1-1.5 s of CPU a rank when the list last missed some)."""
    flags = [*data_args(), *TINY_GPT_ARGS, "--train-iters", "2", "--pipeline-model-parallel-size",
             "2", "--use-dpp", "--p2p-transport", "shm"]
    rc, output = run_forked("_rank_probe", ["imports", *flags], nproc=2, env=_env(), cwd=TESTS_DIR,
                            timeout=120)
    assert rc == 0, output[-3000:]
    lists = [json.loads(line[len("probe imports "):]) for line in output.splitlines()
             if line.startswith("probe imports ")]
    assert len(lists) == 2, output[-3000:]
    for imported in lists:
        assert set(imported) <= IMPORTED_AT_FIRST_USE, imported


@pytest.mark.timeout(120)
def test_a_failed_rank_stops_the_others_and_is_reported_as_torchrun_does():
    start = time.monotonic()
    rc, output = run_forked("_rank_probe", ["fail"], nproc=2, env=_env(), cwd=TESTS_DIR,
                            timeout=100)
    assert time.monotonic() - start < 30, output[-3000:]  # rank 0 stopped, not waited for
    assert rc == 1, output[-3000:]
    assert "rank      : 1 (local_rank: 1)\n  exitcode  : 3" in output, output[-3000:]
    assert "rank      : 0 (local_rank: 0)\n  exitcode  : -15" in output, output[-3000:]


@pytest.mark.timeout(120)
def test_a_run_past_its_timeout_is_killed_and_raises_with_its_output():
    with pytest.raises(AssertionError, match="did not finish within 3s") as raised:
        run_forked("_rank_probe", ["hang"], nproc=2, env=_env(), cwd=TESTS_DIR, timeout=3)
    pids = [int(pid) for pid in re.findall(r"probe pid (\d+)", str(raised.value))]
    assert len(pids) == 2, str(raised.value)
    assert all(_gone(pid, within_s=10) for pid in pids)


@pytest.mark.timeout(120)
def test_a_rank_ends_through_the_interpreters_own_exit():
    rc, output = run_forked("_rank_probe", ["atexit"], nproc=2, env=_env(), cwd=TESTS_DIR,
                            timeout=100)
    assert rc == 1
    assert "probe atexit ran on rank 0" in output and "probe atexit ran on rank 1" in output
    assert "rank      : 0 (local_rank: 0)\n  exitcode  : 4" in output, output[-3000:]
    # Rank 1 exits 0; if rank 0's failure is seen first, rank 1 is stopped on its way out (as
    # torchrun would stop it) and reported with SIGTERM's code, never with another.
    reported = re.findall(r"rank      : 1 \(local_rank: 1\)\n  exitcode  : (-?\d+)", output)
    assert reported in ([], ["-15"]), output[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_forked_training_equals_torchrun_training():
    flags = ["--pipeline-model-parallel-size", "2", "--use-dpp"]
    rc, losses, grad_norms, out = run_training(flags, nproc=2)
    assert rc == 0 and len(losses) == 5, out[-3000:]
    rc, torchrun_losses, torchrun_norms, out = run_training(flags, nproc=2, torchrun=True)
    assert rc == 0, out[-3000:]
    assert (losses, grad_norms) == (torchrun_losses, torchrun_norms)


def test_a_run_that_shows_a_gpu_is_left_to_torchrun():
    env = {**_env(), "CUDA_VISIBLE_DEVICES": "0"}
    assert run_forked("_rank_probe", ["env"], nproc=1, env=env, cwd=TESTS_DIR, timeout=10) is None
