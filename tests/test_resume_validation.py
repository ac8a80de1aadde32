"""A resumed run's validation stream goes on where the saved run's had reached, as Megatron-LM's
(the checkpoint's args.consumed_valid_samples; for a checkpoint that says 0, an iteration-based
run's (iteration // eval_interval) * eval_iters * global_batch_size). Real 2-rank runs of the tiny
GPT (data parallel 2), in both checkpoint formats: 6 iterations evaluated at 2, 4 and 6 and after
training, against the same run stopped and saved at 4 (--exit-interval 4) and resumed to 6.
"""
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from _train_util import run_training
from megatron_dpp.training.checkpoint.integrity import (checkpoint_files, file_entry,
                                                        write_manifest)
from megatron_dpp.training.checkpoint.save_load import TrainState
from megatron_dpp.training.loop import consumed_valid_samples_at_start
from test_final_evaluation import _final, _interval

RUN = ["--train-iters", "6", "--eval-interval", "2", "--eval-iters", "1"]
SAVED_AT = "iter_0000004"
# The interval evaluations at 2 and 4 read one global batch (8 samples) each.
VALID_AT_4 = 2 * 1 * 8


def _train(flags):
    rc, losses, _norms, out = run_training([*RUN, *flags], nproc=2, timeout=300)
    assert rc == 0, out[-3000:]
    return losses, out


def _validation(out: str) -> tuple:
    """(interval losses {iteration: loss}, the final validation loss)."""
    final = [loss for iteration, split, loss in _final(out) if split == "validation"]
    assert len(final) == 1, out[-3000:]
    return _interval(out), final[0]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Also Megatron-LM's start from a --load that is not there (and not --save): a warning, and
    the run starts from randomly initialized weights."""
    absent = tmp_path_factory.mktemp("no_checkpoint") / "absent"
    losses, out = _train(["--load", str(absent)])
    assert out.count(f"megatron_dpp: warning: could not find the metadata file "
                     f"{absent}/latest_checkpointed_iteration.txt: will not load any checkpoint, "
                     f"the model starts from randomly initialized weights") == 1, out[-3000:]
    intervals, final = _validation(out)
    assert intervals.keys() == {2, 4, 6}, out[-3000:]
    return losses, intervals, final


@pytest.fixture(scope="module", params=["torch_dist", "torch"])
def saved(request, tmp_path_factory):
    """(format, the checkpoint folder of the run stopped at 4)."""
    save = tmp_path_factory.mktemp(f"resume_validation_{request.param}") / "ckpt"
    _, out = _train(["--ckpt-format", request.param, "--save", str(save), "--exit-interval", "4"])
    assert " exiting: --exit-interval 4 after iteration 4" in out, out[-3000:]
    assert open(save / "latest_checkpointed_iteration.txt").read().strip() == "4"
    return request.param, save


def _saved_count(fmt: str, directory) -> list:
    """The consumed validation samples each file of the checkpoint records (None: absent)."""
    if fmt == "torch_dist":
        common = torch.load(os.path.join(directory, "common.pt"), weights_only=False)
        return [getattr(common["args"], "consumed_valid_samples", None)]
    return [torch.load(os.path.join(directory, name), weights_only=False).get(
        "consumed_valid_samples") for name in ("rank_00000.pt", "rank_00001.pt")]


def _as_saved_before_the_count(fmt: str, directory) -> None:
    """Rewrite the checkpoint as one saved before the count was kept: torch_dist's args said 0
    (as ours did, and Megatron-LM's before it counted), the torch format had no entry; the
    manifest is rewritten so that the edited files still verify."""
    if fmt == "torch_dist":
        path = os.path.join(directory, "common.pt")
        common = torch.load(path, weights_only=False)
        common["args"].consumed_valid_samples = 0
        torch.save(common, path)
    else:
        for name in ("rank_00000.pt", "rank_00001.pt"):
            path = os.path.join(directory, name)
            payload = torch.load(path, weights_only=False)
            del payload["consumed_valid_samples"]
            torch.save(payload, path)
    write_manifest(str(directory), {name: file_entry(os.path.join(directory, name))
                                    for name in checkpoint_files(str(directory))})


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_resumed_run_validates_on_the_uninterrupted_runs_batches(uninterrupted, saved):
    full_losses, full_intervals, full_final = uninterrupted
    fmt, save = saved
    assert _saved_count(fmt, save / SAVED_AT) == [VALID_AT_4] * (1 if fmt == "torch_dist" else 2)
    losses, out = _train(["--ckpt-format", fmt, "--load", str(save)])
    assert " loaded checkpoint from " in out and " at iteration 4" in out, out[-3000:]
    assert losses == full_losses[4:]
    intervals, final = _validation(out)
    assert intervals == {6: full_intervals[6]}, (intervals, full_intervals)
    assert final == full_final


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_checkpoint_without_the_count_takes_megatron_lms_offset(uninterrupted, saved,
                                                                   tmp_path):
    """(4 // 2) * 1 * 8 = 16 samples: here the count the run had, so the losses are the
    uninterrupted run's (from sample 0 they would be another batch's)."""
    _full_losses, full_intervals, full_final = uninterrupted
    fmt, save = saved
    load = tmp_path / "old"
    shutil.copytree(save, load)
    _as_saved_before_the_count(fmt, load / SAVED_AT)
    assert _saved_count(fmt, load / SAVED_AT) == ([0] if fmt == "torch_dist" else [None, None])
    _, out = _train(["--ckpt-format", fmt, "--load", str(load)])
    assert "is damaged" not in out and " at iteration 4" in out, out[-3000:]
    intervals, final = _validation(out)
    assert intervals == {6: full_intervals[6]}, (intervals, full_intervals)
    assert final == full_final


def _config(**flags) -> tuple:
    """(args, the training config): what the rule reads of each."""
    args = SimpleNamespace(**{"train_samples": None, **flags})
    return args, SimpleNamespace(eval_interval=3, eval_iters=2, global_batch_size=8)


def test_the_validation_offset_at_the_start():
    """Megatron-LM's rule: the checkpoint's count; 0 at an iteration > 0 of an iteration-based
    run: (iteration // eval_interval) * eval_iters * global_batch_size; nothing for a
    --train-samples run or at iteration 0 (no checkpoint, or --finetune's reset)."""
    args, train = _config()
    assert consumed_valid_samples_at_start(args, train, TrainState(7, 56, 0)) == (7 // 3) * 2 * 8
    assert consumed_valid_samples_at_start(args, train, TrainState(7, 56, 40)) == 40
    assert consumed_valid_samples_at_start(args, train, TrainState(0, 0, 0)) == 0
    args, train = _config(train_samples=80)
    assert consumed_valid_samples_at_start(args, train, TrainState(7, 56, 0)) == 0
