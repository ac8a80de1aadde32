"""megatron_dpp.rank_launcher: when ranks fail, its last line is the first failing rank's line and
its exit code is that rank's; no torchrun traceback."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_dpp.rank_failure import (all_failures, first_failure, record_failure,
                                       record_failure_in)
from megatron_dpp.stopped_ranks import StoppedRankWatch, is_stopped

REPO_ROOT = Path(__file__).resolve().parents[1]
RANK_SCRIPT = str(Path(__file__).with_name("_failing_rank.py"))


def _launch(mode: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "megatron_dpp.rank_launcher", "--standalone",
               "--nproc-per-node", "2", RANK_SCRIPT, mode]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                          env={**__import__("os").environ, "PYTHONPATH": str(REPO_ROOT)})


def _last_line(result: subprocess.CompletedProcess) -> str:
    return result.stderr.strip().splitlines()[-1]


HOST = socket.gethostname()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode, code, last_line", [
    ("lines", 5, "rank 1: the first failure"),
    ("crash", 1, f"megatron_dpp.rank_launcher: rank 1 on {HOST} failed with exit code 1; its "
                 f"output above says why"),
    ("killed", 137, f"megatron_dpp.rank_launcher: rank 1 on {HOST} was killed by SIGKILL; its "
                    f"output above says what it was doing"),
    # The peer's line (a lost peer) follows the killed rank, which comes first.
    ("killed_peer_reports", 137, f"megatron_dpp.rank_launcher: rank 1 on {HOST} was killed by "
                                 f"SIGKILL; then: [rank 0] lost the peer"),
])
def test_launcher_ends_with_the_first_failure(mode, code, last_line):
    result = _launch(mode)
    assert result.returncode == code, result.stderr[-3000:]
    assert _last_line(result) == last_line, result.stderr[-3000:]
    assert "ChildFailedError" not in result.stderr, result.stderr[-3000:]
    if mode != "crash":  # the crashing rank's own traceback is its output, and stays
        assert "Traceback" not in result.stderr, result.stderr[-3000:]


@pytest.mark.timeout(150)
def test_a_rank_stopped_when_the_job_ends_is_killed_at_once():
    """torchrun waits 30 s for a rank to act on its SIGTERM; a stopped one cannot. The launcher
    kills it once a peer has reported it, and ends with the peer's line."""
    started = time.monotonic()
    result = _launch("stopped")
    took = time.monotonic() - started
    assert result.returncode == 4, result.stderr[-3000:]
    assert _last_line(result) == "[rank 0] lost the peer (rank 1)", result.stderr[-3000:]
    assert took < 25, f"the launcher took {took:.0f} s: it waited for the stopped rank"


def test_the_watch_kills_only_stopped_children_and_records_their_line(tmp_path):
    """StoppedRankWatch over real children: a running one is left alone, a stopped one is
    killed and its line recorded, and nothing happens before a failure is recorded."""
    env = {**os.environ, "RANK": "3"}
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not is_stopped(stopped.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        watch = StoppedRankWatch(str(tmp_path))
        watch.kill_stopped_ranks_if_a_rank_failed()
        assert stopped.poll() is None  # no failure recorded yet
        record_failure_in(str(tmp_path), 0, "[rank 0] lost the peer", 4)
        watch.kill_stopped_ranks_if_a_rank_failed()
        assert stopped.wait(timeout=10) == -signal.SIGKILL
        assert running.poll() is None
        assert watch.killed == [3]
        line = next(f for f in all_failures(str(tmp_path)) if f.rank == 3).line
        assert "rank 3" in line and "was stopped" in line, line
    finally:
        for process in (running, stopped):
            process.kill()
            process.wait()


@pytest.mark.timeout(150)
def test_launcher_passes_success_through():
    result = _launch("ok")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0 done" in result.stdout and "rank 1 done" in result.stdout


def test_first_failure_is_the_earliest_and_skips_damaged_records(tmp_path, monkeypatch):
    monkeypatch.setenv("DPP_FAILURE_DIR", str(tmp_path))
    assert first_failure(str(tmp_path)) is None
    for rank, line in ((3, "late"), (2, "early")):
        monkeypatch.setenv("RANK", str(rank))
        record_failure(line, exit_code=rank)
    # Rewrite rank 3's record to be the later one, whatever the clock's resolution.
    (tmp_path / "rank_3.json").write_text('{"rank": 3, "exit_code": 3, "line": "late", "time": 9e12}')
    (tmp_path / "rank_4.json").write_text('{"rank": 4, "exit_')  # a rank killed while writing
    found = first_failure(str(tmp_path))
    assert (found.rank, found.exit_code, found.line) == (2, 2, "early")


def test_record_failure_without_a_launcher_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("DPP_FAILURE_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    record_failure("a line", exit_code=2)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(240)
def test_a_launcher_ends_with_the_ranks_line_and_code(tmp_path):
    """Through run_single_gpt.sh: a checkpoint whose tracker is damaged passes the pre-launch check
    (the folder holds a tracker) and fails in every rank; the launcher's last line is theirs."""
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "latest_checkpointed_iteration.txt").write_text("forty\n")
    result = subprocess.run(["bash", str(REPO_ROOT / "run_scripts" / "run_single_gpt.sh"), "--load",
                             str(checkpoint), "--train-iters", "8"], capture_output=True, text=True,
                            timeout=220, cwd=tmp_path)
    expected = (f"megatron_dpp: error: checkpoint file {checkpoint}/latest_checkpointed_iteration.txt"
                f" is damaged: 'forty' is not an iteration number")
    assert result.returncode == 2, result.stderr[-3000:]
    assert _last_line(result) == expected, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr
