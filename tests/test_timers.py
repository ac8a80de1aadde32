"""Megatron-LM's timers (training/observe/timers.py): --timing-log-level, --timing-log-option,
--no-barrier-with-level-1-timing, --log-timers-to-tensorboard.

Checked: the level filter and a timer's accumulation (CPU clock); Megatron-LM's three blocks, to
the character; in training at pp=2, with the DPP runtime and with Megatron's schedule (traced),
the block under every logged iteration line with the timers Megatron-Core and the loop start (and under
--use-dpp no send/receive timers, which only Megatron's p2p code has), the same losses as a run
without timers, none at the default level; at every level Megatron-LM's level-0 blocks, each after
what it timed (the set-up, an evaluation, a checkpoint's save and load); the TensorBoard scalars;
the flag errors; on a GPU (marked), CUDA-event timers that never synchronize at start or stop.
"""
from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from _gpu import gpu_env
from _train_util import REPO_ROOT, TINY_GPT_ARGS, flag_error, run_training
from megatron_dpp.training.observe.timer_hooks import NO_TIMER
from megatron_dpp.training.observe.timers import TimerReport, Timers, timers_to_log

PP2 = ["--train-iters", "4", "--pipeline-model-parallel-size", "2", "--log-interval", "2"]
BLOCK_RE = re.compile(r"\(min, max\) time across ranks \(ms\):\n((?:    .*\n)+)")
ROW_RE = re.compile(r"    (\S+) \.+: \(([0-9.]+), ([0-9.]+)\)")


LEVEL_0 = ("model-and-optimizer-setup", "train/valid/test-data-iterators-setup", "evaluate",
           "save-checkpoint", "load-checkpoint")


def _blocks(out: str, iterations_only: bool = True) -> list[dict]:
    """Each minmax block: {timer: (min ms, max ms)}; iterations_only: leave out the level-0
    blocks (printed at every level)."""
    blocks = [{name: (float(low), float(high)) for name, low, high in ROW_RE.findall(block)}
              for block in BLOCK_RE.findall(out)]
    return [block for block in blocks
            if not (iterations_only and set(block) <= set(LEVEL_0))]


# ---- the timers themselves (CPU) --------------------------------------------------------------
def test_a_timer_above_the_level_is_not_kept():
    import torch

    timers = Timers(1, torch.device("cpu"))
    assert timers("forward-compute", log_level=2) is NO_TIMER
    assert timers("some-timer") is NO_TIMER  # no level: Megatron-Core's maximum, 2
    kept = timers("forward-backward", log_level=1)
    assert kept is not NO_TIMER and timers("forward-backward") is kept
    assert timers_to_log(1)[0] == "forward-backward" and "forward-compute" not in timers_to_log(1)
    assert "forward-compute" in timers_to_log(2) and timers_to_log(0) == []


def test_a_timer_accumulates_its_spans_until_read():
    import torch

    timer = Timers(2, torch.device("cpu"))("forward-compute", log_level=2)
    for _ in range(2):
        timer.start()
        time.sleep(0.02)
        timer.stop()
    first = timer.read(reset=True)
    assert first >= 0.04
    assert timer.read(reset=True) == 0.0  # reset
    timer.start()
    time.sleep(0.01)
    assert timer.read(reset=True) >= 0.01 and timer.running  # an open span counts and stays open
    timer.stop()
    with pytest.raises(RuntimeError, match="stopped while not running"):
        timer.stop()
    timer.start()
    with pytest.raises(RuntimeError, match="started while running"):
        timer.start()


def test_the_blocks_read_as_megatron_lms():
    # seconds per iteration: forward-backward ran on both ranks, embedding's all-reduce on rank 1
    report = TimerReport(names=["forward-backward", "embedding-grads-all-reduce"],
                         per_rank=[[0.05, 0.0], [0.0612345, 0.002]])
    assert report.text("minmax") == (
        "(min, max) time across ranks (ms):\n"
        "    forward-backward ...............................: (50.00, 61.23)\n"
        "    embedding-grads-all-reduce .....................: (2.00, 2.00)")
    assert report.text("max") == (
        "max time across ranks (ms):\n"
        "    forward-backward ...............................: 61.23\n"
        "    embedding-grads-all-reduce .....................: 2.00")
    assert report.text("all") == (
        "times across ranks (ms):\n"
        "  forward-backward:\n"
        "     rank  0: 50.00\n"
        "     rank  1: 61.23\n"
        "  embedding-grads-all-reduce:\n"
        "     rank  1: 2.00")
    assert TimerReport(names=[], per_rank=[[], []]).text("minmax") is None


# ---- in training (2 CPU ranks) ----------------------------------------------------------------
@pytest.mark.timeout(400)
def test_level_2_under_the_dpp_runtime_times_each_part_and_changes_no_loss():
    rc, plain_losses, _, plain = run_training([*PP2, "--use-dpp"])
    assert rc == 0, plain[-3000:]
    assert _blocks(plain) == []  # level 0, the default: no per-iteration timer runs
    assert [set(block) for block in _blocks(plain, iterations_only=False)] == [
        {"model-and-optimizer-setup", "train/valid/test-data-iterators-setup"}]
    rc, losses, _, out = run_training([*PP2, "--use-dpp", "--timing-log-level", "2"])
    assert rc == 0, out[-3000:]
    assert losses == plain_losses and len(losses) == 2
    blocks = _blocks(out)
    assert len(blocks) == 2, out[-3000:]
    for block in blocks:
        for name in ("forward-backward", "forward-compute", "backward-compute",
                     "batch-generator", "all-grads-sync", "optimizer", "optimizer-inner-step"):
            low, high = block[name]
            assert 0.0 < low <= high, (name, block)
        # the DPP runtime sends through its own transports, not Megatron's p2p timers
        assert not any(name.endswith(("-send", "-recv")) for name in block), block
        # the parts fit inside the whole
        assert block["forward-compute"][1] < block["forward-backward"][1] * 1.05
    # each block follows its iteration line (the set-up's, "done with setup ...")
    lines = out.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("(min, max) time across ranks")]
    assert len(heads) == 3 and lines[heads[0] - 1] == "done with setup ...", out[-3000:]
    assert all(re.match(r" iteration\s+\d+/", lines[i - 1]) for i in heads[1:]), out[-3000:]


@pytest.mark.timeout(300)
def test_megatrons_schedule_times_its_sends_and_receives_per_rank(tmp_path):
    """With --trace too: its stand-in for config.timers passes every call on to the timers."""
    rc, _, _, out = run_training([*PP2, "--timing-log-level", "2", "--timing-log-option", "all",
                                  "--no-barrier-with-level-1-timing", "--trace", "--trace-dir",
                                  str(tmp_path)])
    assert rc == 0, out[-3000:]
    first = re.search(r" iteration\s+\d+/", out).start()  # (the set-up's block is before)
    block = out[first:]
    block = block[block.index("times across ranks (ms):"):]
    block = block[:re.search(r" iteration\s+\d+/", block).start()]
    for name in ("forward-backward", "forward-compute", "backward-compute", "optimizer"):
        assert re.search(rf"  {name}:\n     rank  0: [0-9.]+\n     rank  1: [0-9.]+\n",
                         block), block
    # the first stage only sends activations and only receives gradients
    assert re.search(r"  forward-send:\n     rank  0: [0-9.]+\n", block), block
    assert re.search(r"  forward-recv:\n     rank  1: [0-9.]+\n", block), block


@pytest.mark.timeout(300)
def test_timers_go_to_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from test_tensorboard_log import _scalars

    board = str(tmp_path / "tb")
    rc, _, _, out = run_training([*PP2, "--timing-log-level", "1", "--timing-log-option", "max",
                                  "--tensorboard-dir", board, "--log-timers-to-tensorboard"])
    assert rc == 0, out[-3000:]
    scalars = _scalars(board)
    elapsed = [float(ms) for ms in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", out)]
    printed = [float(ms) for ms in re.findall(r"    forward-backward \.+: ([0-9.]+)", out)]
    assert [step for step, _ in scalars["iteration-time"]] == [2, 4]
    for (_, seconds), ms in zip(scalars["iteration-time"], elapsed):
        assert abs(seconds * 1000.0 - ms) <= 0.05 + 1e-6  # the line's value, in seconds
    # each timer's max over the ranks, in seconds per iteration; the line printed the same in ms
    assert [step for step, _ in scalars["forward-backward-time"]] == [2, 4]
    for (_, seconds), ms in zip(scalars["forward-backward-time"], printed):
        assert abs(seconds * 1000.0 - ms) <= 0.005 + 1e-6
    assert all(value > 0 for _, value in scalars["optimizer-time"])
    assert "forward-compute-time" not in scalars  # level 2's


@pytest.mark.timeout(300)
def test_level_0_timers_follow_what_they_time_at_every_level(tmp_path):
    """Megatron-LM's level-0 timers, printed whatever --timing-log-level: the set-up after "done
    with setup ...", an evaluation before its validation loss, a checkpoint's save and load after
    their lines; --timing-log-option formats them too."""
    save = str(tmp_path / "ckpt")
    rc, _, _, out = run_training([*PP2, "--use-dpp", "--eval-interval", "2", "--eval-iters", "1",
                                  "--save", save, "--save-interval", "4"])
    assert rc == 0, out[-3000:]
    lines = out.splitlines()

    def block_after(index: int) -> dict:
        assert lines[index + 1] == "(min, max) time across ranks (ms):", lines[index:index + 3]
        name, low, high = ROW_RE.match(lines[index + 2]).groups()
        return {name: (float(low), float(high))}

    setup = lines.index("done with setup ...")
    assert [ROW_RE.match(line).group(1) for line in lines[setup + 2:setup + 4]] == [
        "model-and-optimizer-setup", "train/valid/test-data-iterators-setup"]
    assert any(line.startswith("[after dataloaders are built] datetime: ") for line in lines)
    done = [i for i, line in enumerate(lines)
            if line.startswith("[after training is done] datetime: ")]
    last_iteration = max(i for i, line in enumerate(lines) if re.match(r" iteration\s+4/", line))
    assert len(done) == 1 and done[0] > last_iteration, lines[-8:]
    validations = [i for i, line in enumerate(lines) if line.startswith(" validation loss at")]
    # At iterations 2 and 4, then Megatron-LM's evaluation after the last one (no test split).
    assert len(validations) == 3
    assert lines[validations[2]].startswith(" validation loss at iteration 4 on validation set")
    for index in validations:  # the evaluate block, then the validation line
        assert ROW_RE.match(lines[index - 1]).group(1) == "evaluate", lines[index - 3:index + 1]
    saved = [i for i, line in enumerate(lines) if line.startswith(" saved checkpoint at")]
    assert len(saved) == 1
    low, high = block_after(saved[0])["save-checkpoint"]
    assert 0.0 < low <= high
    # A resume: the load's block, in --timing-log-option max's form.
    rc, _, _, out = run_training([*PP2, "--use-dpp", "--train-iters", "6", "--load", save,
                                  "--override-opt_param-scheduler", "--timing-log-option", "max"])
    assert rc == 0, out[-3000:]
    # The checkpoint libraries' deprecations, which Megatron-Core's torch_dist load sets off on
    # every rank, are filtered out (megatron_dpp.kernels.CHECKPOINT_LIBRARY_DEPRECATIONS).
    assert "FutureWarning" not in out, out[-3000:]
    lines = out.splitlines()
    loaded = next(i for i, line in enumerate(lines) if line.startswith(" loaded checkpoint"))
    assert lines[loaded + 1] == "max time across ranks (ms):"
    assert re.match(r"    load-checkpoint \.+: [0-9.]+$", lines[loaded + 2]), lines[loaded + 2]


@pytest.mark.parametrize("argv, message", [
    (["--no-barrier-with-level-1-timing"],
     "--no-barrier-with-level-1-timing needs --timing-log-level 1 or 2"),
    (["--timing-log-level", "1", "--log-timers-to-tensorboard"],
     "--log-timers-to-tensorboard needs --tensorboard-dir DIR (or --wandb-project NAME)"),
    (["--timing-log-level", "3"], "--timing-log-level: invalid choice: 3"),
])
def test_flag_errors(capsys, monkeypatch, argv, message):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert message in flag_error(capsys, [*TINY_GPT_ARGS, *argv])


# ---- on a GPU ---------------------------------------------------------------------------------
CUDA_TIMER_SCRIPT = """
import torch
from megatron_dpp.training.observe.timers import Timers
timers = Timers(2, torch.device("cuda"))
x = torch.randn(2048, 2048, device="cuda")
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("error")  # a synchronization at start or stop fails
timer = timers("forward-compute", log_level=2)
for _ in range(3):
    timer.start()
    for _ in range(20):
        x = torch.tanh(x @ x)
    timer.stop()
torch.cuda.set_sync_debug_mode("default")
spans = timer.read(reset=True)
torch.cuda.synchronize()
start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(3 * 20):
    x = torch.tanh(x @ x)
stop.record()
stop.synchronize()
print("SPANS", spans, start.elapsed_time(stop) / 1000.0)
"""


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_cuda_timers_record_events_without_synchronizing():
    done = subprocess.run([sys.executable, "-c", CUDA_TIMER_SCRIPT], capture_output=True,
                          text=True, env=gpu_env(), cwd=REPO_ROOT, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    spans, reference = map(float, done.stdout.split("SPANS")[1].split())
    assert 0.5 * reference < spans < 2.0 * reference, (spans, reference)


@pytest.mark.gpu
@pytest.mark.timeout(420)
def test_level_2_times_a_bf16_run_on_one_gpu():
    rc, losses, _, out = run_training(
        ["--bf16", "--pipeline-model-parallel-size", "1", "--train-iters", "6",
         "--lr-warmup-iters", "2", "--log-interval", "3", "--timing-log-level", "2"],
        nproc=1, timeout=360, env=gpu_env(), base_args=TINY_GPT_ARGS)
    assert rc == 0 and len(losses) == 2, out[-3000:]
    blocks = _blocks(out)
    assert len(blocks) == 2, out[-3000:]
    for block in blocks:
        for name in ("forward-backward", "forward-compute", "backward-compute", "optimizer"):
            assert block[name][0] > 0.0, (name, block)
        assert block["forward-compute"][1] < block["forward-backward"][1] * 1.05, block
