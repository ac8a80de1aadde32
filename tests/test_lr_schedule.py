"""Megatron-LM's learning-rate schedule (training/lr_schedule.py): counted in samples, so that a
checkpoint's `opt_param_scheduler` means what it means in Megatron-LM; sample-based training
(--train-samples, --lr-decay-samples, --lr-warmup-samples, --lr-warmup-fraction); and what a load
does with a checkpoint's schedule: convert an earlier megatron-dpp's iteration-counted one, and
stop in one line where it differs from the flags unless --override-opt_param-scheduler or
--use-checkpoint-opt_param-scheduler says which to take.
"""
import os
import re
import shutil

import pytest
import torch

from _train_util import TINY_GPT_ARGS, data_args, run_training, without_flags

BATCH = 8  # TINY_GPT_ARGS's global batch
LR_RE = re.compile(r"\| learning rate: ([-+0-9.eE]+)")
ERROR_RE = re.compile(r"^megatron_dpp: error: .*$", re.MULTILINE)


def _parse(monkeypatch, *extra, base=TINY_GPT_ARGS):
    from megatron_dpp.arguments import parse_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    return parse_args([*data_args(), *base, *extra], prog="megatron_dpp.pretrain_gpt")


class _Optimizer:
    """What Megatron-Core's scheduler touches of an optimizer."""

    def __init__(self):
        self.param_groups = [{}]


def _schedule(args):
    from megatron_dpp.training.config import training_config_from_args
    from megatron_dpp.training.lr_schedule import SampleSchedule

    args.padded_vocab_size = 128  # what build_tokenizer sets
    return SampleSchedule(_Optimizer(), training_config_from_args(args))


# ----------------------------------------------------------------------------------------------
# the schedule itself, in this process
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("style", ["linear", "cosine", "constant", "inverse-square-root"])
def test_learning_rate_of_each_iteration_is_the_iteration_counted_one(monkeypatch, style):
    """Counting samples changes the state, not the rate: the same rate as steps counted in
    iterations, bit for bit but for inverse-square-root (a square root of each count)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    args = _parse(monkeypatch, "--train-iters", "40", "--lr-warmup-iters", "5",
                  "--lr-decay-iters", "30", "--lr-decay-style", style)
    samples = _schedule(args)
    iterations = OptimizerParamScheduler(
        _Optimizer(), init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=5,
        lr_decay_steps=30, lr_decay_style=style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=40, wd_incr_style="constant")
    for _ in range(40):
        samples.step_after_update(args.global_batch_size)
        iterations.step(increment=1)
        got = samples.optimizer.param_groups[0]["lr"]
        want = iterations.optimizer.param_groups[0]["lr"]
        if style == "inverse-square-root":
            assert got == pytest.approx(want, rel=1e-14)
        else:
            assert got == want
    assert samples.num_steps == 40 * BATCH and samples.lr_warmup_steps == 5 * BATCH
    assert (samples.lr_decay_steps, samples.wd_incr_steps) == (30 * BATCH, 40 * BATCH)


def test_sample_based_flags_give_megatron_lm_lengths(monkeypatch):
    base = without_flags(TINY_GPT_ARGS, "--train-iters", "--lr-warmup-iters")
    args = _parse(monkeypatch, "--train-samples", "44", base=base)
    # Megatron-LM's update_train_iters: whole global batches of --train-samples.
    assert (args.train_iters, args.lr_decay_steps, args.lr_warmup_steps) == (5, 44, 0)
    args = _parse(monkeypatch, "--train-samples", "44", "--lr-decay-samples", "30",
                  "--lr-warmup-samples", "6", base=base)
    assert (args.lr_decay_steps, args.lr_warmup_steps, args.wd_incr_steps) == (30, 6, 44)
    args = _parse(monkeypatch, "--train-samples", "44", "--lr-warmup-fraction", "0.25", base=base)
    assert args.lr_warmup_steps == 11.0
    args = _parse(monkeypatch, "--lr-warmup-fraction", "0.25",
                  base=without_flags(TINY_GPT_ARGS, "--lr-warmup-iters"))
    assert (args.lr_decay_steps, args.lr_warmup_steps) == (5 * BATCH, 10.0)


@pytest.mark.parametrize("extra, expected", [
    (["--lr-decay-iters", "4"], "--lr-decay-iters counts iterations and --train-samples samples; "
                                "use --lr-decay-samples"),
    (["--lr-warmup-iters", "1"], "--lr-warmup-iters counts iterations and --train-samples "
                                 "samples; use --lr-warmup-samples"),
    (["--train-samples", "4"], "--train-samples 4 is less than one global batch (8)"),
    (["--lr-warmup-samples", "40"], "--lr-decay-samples (40 samples) must exceed "
                                    "--lr-warmup-samples (40 samples)"),
])
def test_sample_based_flag_errors_are_one_line(monkeypatch, capsys, extra, expected):
    base = [*without_flags(TINY_GPT_ARGS, "--train-iters", "--lr-warmup-iters"), "--train-samples", "40"]
    with pytest.raises(SystemExit) as exit_:
        _parse(monkeypatch, *extra, base=base)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_.value.code == 2 and len(lines) == 1 and expected in lines[0], lines


def test_an_iteration_counted_state_is_converted_and_megatron_lm_names_are_read():
    from megatron_dpp.training.checkpoint.scheduler_state import state_in_samples

    old = {"max_lr": 1e-3, "min_lr": 1e-4, "lr_warmup_steps": 1, "lr_decay_steps": 6,
           "num_steps": 3, "lr_decay_style": "cosine", "start_wd": 0.01, "end_wd": 0.01,
           "wd_incr_steps": 6, "wd_incr_style": "constant"}
    state, line = state_in_samples(old, False, iteration=3, consumed_samples=24)
    assert (state["num_steps"], state["lr_warmup_steps"], state["lr_decay_steps"],
            state["wd_incr_steps"]) == (24, 8, 48, 48)
    assert state["max_lr"] == 1e-3 and "converted to samples at global batch 8" in line
    same, line = state_in_samples(state, True, iteration=3, consumed_samples=24)
    assert same == state and line is None
    # Megatron-Core's older key names (its load_state_dict reads them too).
    renamed, _ = state_in_samples({"start_lr": 1e-3, "warmup_iter": 8, "end_iter": 48,
                                   "num_iters": 24, "decay_style": "cosine"}, True, 3, 24)
    assert renamed == {"max_lr": 1e-3, "lr_warmup_steps": 8, "lr_decay_steps": 48,
                       "num_steps": 24, "lr_decay_style": "cosine"}


def test_a_differing_schedule_is_named_and_the_two_flags_decide(monkeypatch):
    saved = _schedule(_parse(monkeypatch)).state_dict()
    assert _schedule(_parse(monkeypatch)).schedule_difference(saved) is None
    # Training longer with constant weight decay changes only the decay's length.
    longer = _schedule(_parse(monkeypatch, "--train-iters", "9", "--lr-decay-iters", "5"))
    assert longer.schedule_difference(saved) is None
    changed = _schedule(_parse(monkeypatch, "--lr", "2e-3", "--train-iters", "9"))
    line = changed.schedule_difference(saved)
    assert "--lr 0.001 in the checkpoint, 0.002 here" in line
    assert "decay samples (--lr-decay-iters/-samples, default the training's length) 40 in the " \
           "checkpoint, 72 here" in line
    assert line.endswith("add --override-opt_param-scheduler to take this run's flags or "
                         "--use-checkpoint-opt_param-scheduler to keep the checkpoint's")
    for flag in ("--override-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"):
        assert _schedule(_parse(monkeypatch, "--lr", "2e-3", flag)).schedule_difference(saved) \
            is None


# ----------------------------------------------------------------------------------------------
# through the trainer: checkpoints
# ----------------------------------------------------------------------------------------------
SCHEDULE = ["--lr-decay-iters", "5"]


@pytest.fixture(scope="module")
def uninterrupted():
    rc, losses, _norms, out = run_training([*SCHEDULE], nproc=1)
    assert rc == 0 and len(losses) == 5, out[-3000:]
    return losses, [float(x) for x in LR_RE.findall(out)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, uninterrupted):
    save = str(tmp_path_factory.mktemp("lr") / "ckpt")
    rc, losses, _norms, out = run_training([*SCHEDULE, "--train-iters", "3", "--save", save],
                                           nproc=1)
    assert rc == 0 and losses == uninterrupted[0][:3], out[-3000:]
    return save


def _common(save):
    return torch.load(os.path.join(save, "iter_0000003", "common.pt"), weights_only=False)


def _resume(save, *extra):
    rc, losses, _norms, out = run_training([*SCHEDULE, "--load", save, *extra], nproc=1)
    return rc, losses, [float(x) for x in LR_RE.findall(out)], out


@pytest.mark.timeout(240)
def test_checkpoint_schedule_counts_samples_and_resumes(saved, uninterrupted):
    from megatron_dpp.training.checkpoint.scheduler_state import SAMPLES_MARKER

    common = _common(saved)
    schedule = common["opt_param_scheduler"]
    # Megatron-LM's units: every count in samples, num_steps = the consumed samples.
    assert schedule["num_steps"] == common["args"].consumed_train_samples == 3 * BATCH
    assert (schedule["lr_warmup_steps"], schedule["lr_decay_steps"]) == (1 * BATCH, 5 * BATCH)
    assert common[SAMPLES_MARKER] is True
    rc, losses, rates, out = _resume(saved)
    assert rc == 0 and losses == uninterrupted[0][3:], out[-3000:]
    assert rates == uninterrupted[1][3:]


@pytest.mark.timeout(240)
def test_an_earlier_iteration_counted_checkpoint_resumes_on_its_schedule(saved, uninterrupted,
                                                                           tmp_path):
    """A checkpoint of megatron-dpp before samples were counted (rewritten here: its counts
    divided by the batch, no marker, its manifest made anew) resumes on the same schedule."""
    from megatron_dpp.training.checkpoint.integrity import (checkpoint_files, file_entry,
                                                            write_manifest)
    from megatron_dpp.training.checkpoint.scheduler_state import SAMPLES_MARKER

    old = str(tmp_path / "old")
    shutil.copytree(saved, old)
    directory = os.path.join(old, "iter_0000003")
    common = _common(old)
    del common[SAMPLES_MARKER]
    for key in ("num_steps", "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps"):
        common["opt_param_scheduler"][key] //= BATCH
    torch.save(common, os.path.join(directory, "common.pt"))
    write_manifest(directory, {name: file_entry(os.path.join(directory, name))
                               for name in checkpoint_files(directory)})
    rc, losses, rates, out = _resume(old)
    assert rc == 0, out[-3000:]
    assert "counted iterations (saved by an earlier megatron-dpp): converted to samples at " \
           "global batch 8" in out
    assert losses == uninterrupted[0][3:] and rates == uninterrupted[1][3:]


@pytest.mark.timeout(240)
def test_a_megatron_lm_checkpoint_schedule_is_read_in_samples(saved, uninterrupted, tmp_path):
    """Megatron-LM's common state has neither our layout nor our marker, and counts samples."""
    from megatron_dpp.training.checkpoint.integrity import (checkpoint_files, file_entry,
                                                            write_manifest)
    from megatron_dpp.training.checkpoint.scheduler_state import SAMPLES_MARKER

    theirs = str(tmp_path / "megatron_lm")
    shutil.copytree(saved, theirs)
    directory = os.path.join(theirs, "iter_0000003")
    common = _common(theirs)
    del common[SAMPLES_MARKER], common["megatron_dpp_layout"], common["consumed_samples"]
    torch.save(common, os.path.join(directory, "common.pt"))
    write_manifest(directory, {name: file_entry(os.path.join(directory, name))
                               for name in checkpoint_files(directory)})
    rc, losses, rates, out = _resume(theirs)
    assert rc == 0 and "converted" not in out, out[-3000:]
    assert losses == uninterrupted[0][3:] and rates == uninterrupted[1][3:]


@pytest.mark.timeout(300)
def test_a_changed_learning_rate_stops_the_load_unless_a_flag_decides(saved, uninterrupted):
    rc, _losses, _rates, out = _resume(saved, "--lr", "2e-3")
    errors = ERROR_RE.findall(out)
    assert rc != 0 and "exitcode  : 2" in out and len(errors) == 1, out[-3000:]
    assert "--lr 0.001 in the checkpoint, 0.002 here" in errors[0]
    assert "--override-opt_param-scheduler" in errors[0]
    # The checkpoint's schedule: the uninterrupted run's rates and losses.
    rc, losses, rates, out = _resume(saved, "--lr", "2e-3", "--use-checkpoint-opt_param-scheduler")
    assert rc == 0 and losses == uninterrupted[0][3:] and rates == uninterrupted[1][3:], out[-3000:]
    # The flags' schedule: twice the rates (min-lr raised with --lr keeps the cosine's shape).
    rc, losses, rates, out = _resume(saved, "--lr", "2e-3", "--min-lr", "2e-4",
                                     "--override-opt_param-scheduler")
    assert rc == 0, out[-3000:]
    assert rates == pytest.approx([2 * rate for rate in uninterrupted[1][3:]], rel=1e-6)
    # Iteration 4's loss comes before its update, iteration 5's after the doubled rate's.
    assert losses[0] == uninterrupted[0][3] and losses[1] != uninterrupted[0][4]


@pytest.mark.timeout(240)
def test_train_samples_trains_as_the_same_length_in_iterations(uninterrupted):
    base = without_flags(TINY_GPT_ARGS, "--train-iters", "--lr-warmup-iters")
    rc, losses, _norms, out = run_training(
        ["--train-samples", "40", "--lr-warmup-samples", "8", "--lr-decay-samples", "40"],
        nproc=1, base_args=base)
    assert rc == 0, out[-3000:]
    assert losses == uninterrupted[0]
    assert [float(x) for x in LR_RE.findall(out)] == uninterrupted[1]
