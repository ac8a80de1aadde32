"""Checkpoint resume reproduces the uninterrupted loss trajectory exactly (pp=2, two ranks), and
SIGINT/SIGTERM stop training at an iteration boundary: checkpoint saved, non-zero exit, no hang."""
import os
import queue
import re
import signal
import subprocess
import threading
import time

import pytest

from _train_util import (REPO_ROOT, TINY_GPT_ARGS, _env, data_args, parse_log, run_training,
                         torchrun_command)

# The LR schedule must not depend on --train-iters, or a shorter first run would change it.
SCHEDULE = ["--lr-decay-iters", "6", "--pipeline-model-parallel-size", "2"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resume_reproduces_uninterrupted_losses(tmp_path):
    rc, full_losses, full_norms, out = run_training([*SCHEDULE, "--train-iters", "6"], nproc=2)
    assert rc == 0 and len(full_losses) == 6, out[-3000:]

    save = str(tmp_path / "ckpt")
    rc, first_losses, _norms, out = run_training(
        [*SCHEDULE, "--train-iters", "3", "--save", save], nproc=2)
    assert rc == 0, out[-3000:]
    assert first_losses == full_losses[:3]
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "3"
    assert os.path.isfile(os.path.join(save, "iter_0000003", "checksums.json"))

    rc, resumed_losses, resumed_norms, out = run_training(
        [*SCHEDULE, "--train-iters", "6", "--load", save], nproc=2)
    assert rc == 0, out[-3000:]
    assert "loaded checkpoint" in out and re.search(r" iteration\s+4/", out), out[-3000:]
    assert resumed_losses == full_losses[3:], (resumed_losses, full_losses)
    assert resumed_norms == full_norms[3:]


def _read_lines(stream, lines: "queue.Queue[str | None]"):
    for line in stream:
        lines.put(line)
    lines.put(None)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_stops_saves_and_exits(tmp_path, signum):
    save = str(tmp_path / "ckpt")
    args = [*data_args(), *TINY_GPT_ARGS, "--pipeline-model-parallel-size", "2",
            "--train-iters", "100000", "--lr-decay-iters", "100", "--save", save]
    process = subprocess.Popen(torchrun_command(args, 2), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=_env(), cwd=REPO_ROOT,
                               start_new_session=True)
    lines: "queue.Queue[str | None]" = queue.Queue()
    reader = threading.Thread(target=_read_lines, args=(process.stdout, lines))
    reader.start()
    output = []
    try:
        deadline = time.monotonic() + 180
        while not any(re.search(r" iteration\s+2/", line) for line in output):
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, "training ended before the signal:\n" + "".join(output)
            output.append(line)
        if signum == signal.SIGINT:
            os.killpg(process.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches every process
        else:
            process.send_signal(signal.SIGTERM)  # a job scheduler signals the launcher
        rc = process.wait(timeout=90)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        reader.join(timeout=30)
    while not lines.empty():
        line = lines.get()
        if line is not None:
            output.append(line)
    text = "".join(output)
    assert rc != 0, text[-3000:]
    assert f"stopped by signal {int(signum)}" in text, text[-3000:]
    losses, _ = parse_log(text)
    saved = int(open(os.path.join(save, "latest_checkpointed_iteration.txt")).read())
    assert saved == len(losses) >= 2, (saved, len(losses))
