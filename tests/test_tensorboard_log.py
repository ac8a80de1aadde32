"""--tensorboard-dir: Megatron-LM's TensorBoard scalars, from the rank that prints the log line, at
pp=2 (the last stage holds the losses): the same values as the log line, each also `vs samples`;
and --log-num-zeros-in-grad's count, in both."""
import os
import re

import pytest

from _train_util import run_training

pytest.importorskip("tensorboard")  # a test dependency (pyproject's `test` extra)

LR_RE = re.compile(r"\| learning rate: ([-+0-9.eE]+)")
VALIDATION_RE = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([-+0-9.eE]+)")
FINAL_VALIDATION_RE = re.compile(
    r"validation loss at iteration (\d+) on validation set \| lm loss value: ([-+0-9.eE]+)")


def _scalars(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = [name for name in os.listdir(directory) if name.startswith("events.out.tfevents")]
    assert len(files) == 1, os.listdir(directory)  # one writer: the logging rank's
    events = EventAccumulator(directory)
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


@pytest.mark.timeout(300)
def test_tensorboard_gets_the_log_lines_values(tmp_path):
    board = str(tmp_path / "tb")
    rc, losses, norms, out = run_training(
        ["--train-iters", "3", "--pipeline-model-parallel-size", "2", "--tensorboard-dir", board,
         "--eval-interval", "2", "--eval-iters", "1", "--log-validation-ppl-to-tensorboard",
         "--log-world-size-to-tensorboard", "--log-batch-size-to-tensorboard"], nproc=2)
    assert rc == 0 and len(losses) == 3, out[-3000:]
    scalars = _scalars(board)
    assert [step for step, _ in scalars["lm loss"]] == [1, 2, 3]
    assert [value for _, value in scalars["lm loss"]] == pytest.approx(losses, rel=1e-6)
    assert [step for step, _ in scalars["lm loss vs samples"]] == [8, 16, 24]
    rates = [float(x) for x in LR_RE.findall(out)]
    assert [value for _, value in scalars["learning-rate"]] == pytest.approx(rates, rel=1e-6)
    assert [value for _, value in scalars["grad-norm"]] == pytest.approx(norms, rel=1e-6)
    assert [value for _, value in scalars["loss-scale"]] == [1.0, 1.0, 1.0]
    assert [value for _, value in scalars["world-size"]] == [2.0, 2.0, 2.0]
    assert [value for _, value in scalars["batch-size"]] == [8.0, 8.0, 8.0]
    (iteration, loss), = VALIDATION_RE.findall(out)
    # Then, as Megatron-LM, the evaluation after the last iteration (no test split: 98,2,0).
    (_, final), = FINAL_VALIDATION_RE.findall(out)
    assert scalars["lm loss validation"] == [(2, pytest.approx(float(loss), rel=1e-6)),
                                             (3, pytest.approx(float(final), rel=1e-6))]
    assert scalars["lm loss validation ppl"][0][1] == pytest.approx(2.718281828 ** float(loss),
                                                                    rel=1e-5)
    assert "mem-allocated-bytes" not in scalars


@pytest.mark.timeout(300)
def test_the_interval_and_the_leaving_out_flags(tmp_path):
    board = str(tmp_path / "tb")
    rc, losses, _norms, out = run_training(
        ["--train-iters", "4", "--tensorboard-dir", board, "--tensorboard-log-interval", "2",
         "--no-log-learnig-rate-to-tensorboard", "--no-log-loss-scale-to-tensorboard"], nproc=1)
    assert rc == 0, out[-3000:]
    scalars = _scalars(board)
    assert [step for step, _ in scalars["lm loss"]] == [2, 4]
    assert [value for _, value in scalars["lm loss"]] == pytest.approx(losses[1::2], rel=1e-6)
    assert "learning-rate" not in scalars and "loss-scale" not in scalars


def test_tensorboard_flags_are_checked_before_launch(monkeypatch, capsys):
    import importlib.util

    from _train_util import TINY_GPT_ARGS, data_args, flag_error

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")

    def error(*flags):
        return flag_error(capsys, [*data_args(), *TINY_GPT_ARGS, *flags])

    assert "--tensorboard-log-interval needs --tensorboard-dir DIR" in \
        error("--tensorboard-log-interval", "5")
    assert "--log-memory-to-tensorboard reports the CUDA caching allocator, and there is no " \
           "CUDA GPU here" in error("--tensorboard-dir", "/tmp/tb", "--log-memory-to-tensorboard")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "tensorboard" else real(name, *rest))
    assert "--tensorboard-dir needs the tensorboard package, which this Python lacks: pip " \
           "install tensorboard" in error("--tensorboard-dir", "/tmp/tb")


NUM_ZEROS_RE = re.compile(r"\| num zeros: ([0-9.]+) \|")


@pytest.mark.timeout(300)
def test_num_zeros_in_grad_in_the_log_line_and_tensorboard(tmp_path):
    """Megatron's count over the model-parallel group: the same at pp=1 and pp=2. Untied, the
    word embedding's rows of the tokens a batch lacks get no gradient (tied, the output layer
    gives every row one)."""
    board = str(tmp_path / "tb")
    flags = ["--train-iters", "2", "--log-num-zeros-in-grad", "--untie-embeddings-and-output-weights"]
    rc, _losses, _norms, one = run_training([*flags, "--tensorboard-dir", board], nproc=1)
    assert rc == 0, one[-3000:]
    counts = [float(x) for x in NUM_ZEROS_RE.findall(one)]
    # A batch of 8 x 64 tokens leaves most of the 4096 embedding rows (of 64) without a gradient.
    assert len(counts) == 2 and all(count > 64 * 3000 for count in counts), counts
    assert [value for _, value in _scalars(board)["num-zeros"]] == counts
    rc, _losses, _norms, two = run_training([*flags, "--pipeline-model-parallel-size", "2"],
                                            nproc=2)
    assert rc == 0 and [float(x) for x in NUM_ZEROS_RE.findall(two)] == counts, two[-3000:]
    rc, _losses, _norms, plain = run_training(["--train-iters", "2"], nproc=1)
    assert rc == 0 and not NUM_ZEROS_RE.findall(plain)
