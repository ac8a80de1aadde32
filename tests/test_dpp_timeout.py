"""A stuck peer makes DPP report its state and the job exit non-zero, instead of hanging.

The tiny GPT trains with --use-dpp at pp=2; once it is iterating, the test freezes pipeline rank 1
with SIGSTOP (the process stays alive, so only the no-progress deadline can notice). Rank 0 must
print its state within --dpp-timeout (ready tasks, awaited tags and bytes held when it was inside the
schedule; the phase when it was in one of the step's collectives) and exit non-zero, and torchrun
must then end the job.

torchrun ends the job by sending SIGTERM to the ranks left, and SIGKILL to those still there 30 s
later (fixed in torch; its --shutdown-timeout does not apply there). A stopped process cannot act on
a SIGTERM, so the frozen rank would always get that SIGKILL: once torchrun has sent the SIGTERM (its
log line), the test sends the SIGKILL itself instead of waiting out the 30 s.
"""
import os
import signal
import subprocess
import threading
import time

import pytest

from _train_util import ITERATION_RE, REPO_ROOT, TINY_GPT_ARGS, _env, data_args, torchrun_command

DPP_TIMEOUT_S = 5


def _children(pid):
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def _rank_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    except OSError:
        return None
    rank = env.get(b"RANK")
    return int(rank) if rank is not None else None


def _find_rank(torchrun_pid, rank):
    for child in _children(torchrun_pid):
        if _rank_of(child) == rank:
            return child
    return None


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_stuck_peer_reports_state_and_exits_nonzero():
    args = [*data_args(), *TINY_GPT_ARGS, "--train-iters", "100000", "--pipeline-model-parallel-size",
            "2", "--use-dpp", "--p2p-transport", "shm", "--dpp-timeout", str(DPP_TIMEOUT_S)]
    process = subprocess.Popen(torchrun_command(args, 2), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=_env(), cwd=REPO_ROOT,
                               start_new_session=True)
    lines = []
    iterating = threading.Event()
    terminating = threading.Event()

    def read():
        for line in process.stdout:
            lines.append(line)
            match = ITERATION_RE.search(line)
            if match and int(match.group(1)) >= 2:  # DPP is running (not still setting up)
                iterating.set()
            if "closing signal SIGTERM" in line:  # torchrun's log line as it ends the job
                terminating.set()

    reader = threading.Thread(target=read)
    reader.start()
    stopped = None
    try:
        assert iterating.wait(timeout=150), "training never started:\n" + "".join(lines[-50:])
        # torchrun -m torch.distributed.run: the ranks are children of the elastic agent process.
        stopped = _find_rank(process.pid, 1)
        assert stopped is not None, "could not find the process of rank 1"
        os.kill(stopped, signal.SIGSTOP)
        frozen_at = time.monotonic()
        # Rank 0 gives up and exits; torchrun sends the frozen rank SIGTERM, which cannot act on a
        # stopped process: its SIGKILL 30 s later is sent here at once. (Without that log line,
        # torchrun's own SIGKILL ends the frozen rank.)
        deadline = frozen_at + 120
        while not terminating.wait(timeout=0.2) and process.poll() is None and time.monotonic() < deadline:
            pass
        if terminating.is_set():
            os.kill(stopped, signal.SIGKILL)
        returncode = process.wait(timeout=120)
        elapsed = time.monotonic() - frozen_at
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reader.join(timeout=10)
    output = "".join(lines)
    assert returncode != 0, output[-3000:]
    # Where rank 0 notices depends on what it was doing when its peer froze: inside the pipeline
    # schedule the runtime reports its waits; in a blocking collective of the step (gradient
    # all-reduce, optimizer norm, stop agreement) the stall watchdog reports the phase.
    if "[dpp rank 0] no progress for 5 s" in output:
        assert "awaited (peer, tag)" in output and "activation bytes held" in output, output[-3000:]
    else:
        assert "[dpp rank 0] no progress for 7 s (watchdog)" in output, output[-3000:]
        assert "[dpp rank 0]   stuck in: " in output, output[-3000:]
    assert elapsed < DPP_TIMEOUT_S + 90, f"the job took {elapsed:.0f} s to end after the peer froze"
