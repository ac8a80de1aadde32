"""The evaluation after training, as Megatron-LM's pretrain: after the last iteration the run
evaluates the validation split ("iteration N on validation set") and the test split ("iteration N
on test set"), each a split with data and --eval-iters > 0; --skip-train evaluates the model
(of --load) so and trains nothing. Real 2-rank runs of the tiny GPT (data parallel 2).

Which batches each evaluation reads proves what ran: the validation stream goes on from the
interval evaluations (Megatron-LM sizes the split for one evaluation more), so the final
validation loss of a run that evaluated once at iteration 4 is the loss that a run evaluating
at iterations 2 and 4 gets at 4 (the same model, the same second batch); --skip-train reads the
validation split from its start, so on the checkpoint of iteration 4 it gets the first run's
interval loss at 4. The test split is read from its start by every run.
"""
import importlib.util
import os
import re

import pytest

from _train_util import TINY_GPT_ARGS, data_args, flag_error, run_training, without_flags

# The sample corpus's 5% shares hold ~300 samples of 64 tokens: one epoch covers every
# evaluation below, so the splits' sample orders agree whatever count each run asks for.
WITH_TEST = ["--split", "90,5,5", "--eval-iters", "1", "--train-iters", "4"]
INTERVAL_RE = re.compile(r"^ validation loss at iteration (\d+) \| lm loss value: ([-+0-9.eE]+)",
                         re.MULTILINE)
FINAL_RE = re.compile(r"^ validation loss at iteration (\d+) on (validation|test) set \| "
                      r"lm loss value: ([-+0-9.eE]+)", re.MULTILINE)
ITERATION_LINE_RE = re.compile(r"^ iteration\s+(\d+)/", re.MULTILINE)
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


def _train(flags, timeout=240):
    rc, losses, _norms, out = run_training(flags, nproc=2, timeout=timeout)
    assert rc == 0, out[-3000:]
    return losses, out


def _interval(out: str) -> dict:
    return {int(iteration): float(loss) for iteration, loss in INTERVAL_RE.findall(out)}


def _final(out: str) -> list:
    """[(iteration, split, loss)] of the evaluations after training, in order."""
    return [(int(iteration), split, float(loss))
            for iteration, split, loss in FINAL_RE.findall(out)]


def _tensorboard_flags(directory) -> list:
    return ["--tensorboard-dir", str(directory)] if HAS_TENSORBOARD else []


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """once: --eval-interval 4, saved at iteration 4; twice: --eval-interval 2; skipped:
    --skip-train --load of once's checkpoint (--save too: it must write nothing there)."""
    root = tmp_path_factory.mktemp("final_evaluation")
    save = root / "ckpt"
    _, once = _train([*WITH_TEST, "--eval-interval", "4", "--save", str(save),
                      *_tensorboard_flags(root / "tb_once")])
    _, twice = _train([*WITH_TEST, "--eval-interval", "2"])
    saved = sorted(os.listdir(save))
    _, skipped = _train([*WITH_TEST, "--eval-interval", "4", "--skip-train", "--load", str(save),
                         "--save", str(save), *_tensorboard_flags(root / "tb_skipped")])
    return {"once": once, "twice": twice, "skipped": skipped, "saved": saved, "root": root,
            "save": save}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_after_the_last_iteration_the_validation_then_the_test_split(runs):
    out = runs["once"]
    lines = out.splitlines()
    final = _final(out)
    assert [(iteration, split) for iteration, split, _ in final] == [
        (4, "validation"), (4, "test")], out[-3000:]
    done = lines.index(next(line for line in lines if line.startswith("[after training is done]")))
    last_iteration = max(i for i, line in enumerate(lines) if ITERATION_LINE_RE.match(line))
    finals = [i for i, line in enumerate(lines) if FINAL_RE.match(line)]
    assert last_iteration < done < finals[0], lines[last_iteration:]
    # Megatron-LM's verbose evaluation on rank 0, then the 'evaluate' timer's block, each time.
    for index in finals:
        assert lines[index - 2] == "(min, max) time across ranks (ms):", lines[index - 5:index + 1]
    assert out.count("Evaluating on 8 samples") == 2 and out.count("Evaluating iter 1/1") == 2
    assert _interval(out).keys() == {4}  # the interval evaluation at 4 still runs, as Megatron-LM's


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_final_validation_reads_on_after_the_interval_evaluations(runs):
    """once's final validation at 4 reads the second validation batch, as twice's interval
    evaluation at 4 does (after its first at 2): the same model, the same batch, the same loss.
    once's own interval evaluation at 4 read the first batch: another loss."""
    once, twice = runs["once"], runs["twice"]
    (_, _, once_valid), (_, _, once_test) = _final(once)
    assert _interval(twice).keys() == {2, 4}
    assert once_valid == _interval(twice)[4]
    assert once_valid != _interval(once)[4]
    # twice's final validation reads a third batch; the test split starts over in every run.
    (_, _, twice_valid), (_, _, twice_test) = _final(twice)
    assert twice_valid not in (once_valid, _interval(once)[4])
    assert twice_test == once_test


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_skip_train_evaluates_the_loaded_model_and_trains_nothing(runs):
    out = runs["skipped"]
    assert not ITERATION_LINE_RE.search(out), out[-3000:]
    assert "skipping training (--skip-train is on) ..." in out
    assert " training: " not in out  # the training summary line: nothing is trained
    # As Megatron-LM's --skip-train turns --no-load-optim on.
    assert (" at iteration 4 (not loaded: the optimizer and the learning-rate schedule)"
            in out), out[-3000:]
    final = _final(out)
    assert [(iteration, split) for iteration, split, _ in final] == [
        (4, "validation"), (4, "test")], out[-3000:]
    (_, _, valid), (_, _, test) = final
    # The validation split from its start: once's interval evaluation at 4 (its first batch).
    assert valid == _interval(runs["once"])[4]
    assert test == _final(runs["once"])[1][2]
    assert not _interval(out)
    assert " saved checkpoint" not in out and sorted(os.listdir(runs["save"])) == runs["saved"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tensorboard_gets_the_final_losses_but_not_under_skip_train(runs):
    """Megatron-LM writes both final losses under `lm loss validation` at the last iteration
    (write_to_tensorboard=not skip_train)."""
    pytest.importorskip("tensorboard")
    from test_tensorboard_log import _scalars

    scalars = _scalars(str(runs["root"] / "tb_once"))
    (_, _, valid), (_, _, test) = _final(runs["once"])
    interval = _interval(runs["once"])[4]
    assert scalars["lm loss validation"] == [
        (4, pytest.approx(loss, rel=1e-6)) for loss in (interval, valid, test)]
    assert "lm loss validation" not in _scalars(str(runs["root"] / "tb_skipped"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_no_test_evaluation_without_a_test_split():
    """--split 98,2,0: no test dataset, so no test evaluation (Megatron-LM has no test
    iterator then); the validation split is evaluated after the last iteration."""
    _, out = _train(["--split", "98,2,0", "--eval-iters", "1", "--train-iters", "2"])
    assert [(iteration, split) for iteration, split, _ in _final(out)] == [(2, "validation")]
    assert "on test set" not in out and out.count("Evaluating on 8 samples") == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_eval_iters_0_evaluates_nothing_after_training():
    _, out = _train(["--train-iters", "2", "--eval-iters", "0", "--split", "90,5,5"])
    assert len(ITERATION_LINE_RE.findall(out)) == 2
    assert "validation loss" not in out and "Evaluating" not in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_test_data_path_alone_is_evaluated_after_training():
    """--train-data-path P --test-data-path P: the test split is evaluated after training, and
    with no --valid-data-path the validation split is not (said in one line)."""
    prefix = data_args()[1]
    flags = ["--train-data-path", prefix, "--test-data-path", prefix, "--eval-iters", "1",
             "--train-iters", "2"]
    rc, _, _, out = run_training(
        [*data_args()[2:6], *flags], nproc=2, with_data=False, timeout=240,
        base_args=without_flags(TINY_GPT_ARGS, "--eval-iters", "--train-iters"))
    assert rc == 0, out[-3000:]
    assert [(iteration, split) for iteration, split, _ in _final(out)] == [(2, "test")]
    assert out.count(" validation off (the test split is evaluated after training): no "
                     "--valid-data-path") == 1, out[-3000:]


def test_skip_train_flags_that_leave_nothing_to_evaluate(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    base = without_flags(TINY_GPT_ARGS, "--eval-iters")
    data = without_flags(data_args(), "--split")
    assert "--skip-train only evaluates, and --eval-iters 0 evaluates nothing" in flag_error(
        capsys, [*data, *base, "--skip-train", "--eval-iters", "0"])
    assert ("--skip-train only evaluates, and --split 100,0,0 gives the validation and the test "
            "split no documents" in flag_error(
                capsys, [*data, *base, "--skip-train", "--eval-iters", "1", "--split",
                         "100,0,0"]))
    prefix = data_args()[1]
    assert ("--skip-train only evaluates, and without --valid-data-path and --test-data-path no "
            "split has documents to evaluate" in flag_error(
                capsys, [*data[2:], *base, "--skip-train", "--eval-iters", "1",
                         "--train-data-path", prefix]))


def test_the_validation_split_is_sized_for_the_evaluation_after_training():
    """Megatron-LM's get_train_valid_test_num_samples: one validation evaluation per
    --eval-interval and the one after training, or one only under --skip-train; the test split
    one evaluation."""
    from types import SimpleNamespace

    from megatron_dpp.data.datasets import samples_per_split

    args = SimpleNamespace(train_iters=10, train_samples=None, global_batch_size=8,
                           eval_iters=3, eval_interval=4, skip_train=False)
    assert samples_per_split(args) == [80, (10 // 4 + 1) * 3 * 8, 3 * 8]
    args.skip_train = True
    assert samples_per_split(args) == [80, 3 * 8, 3 * 8]
