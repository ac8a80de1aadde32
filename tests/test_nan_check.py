"""A NaN or Inf in training stops the run, as Megatron-LM's default check for NaN in the loss and
gradients does (--no-check-for-nan-in-loss-and-grad turns it off). A learning rate of 1e12 makes
the tiny GPT's third iteration NaN. Checked: at pp=2 under --use-dpp, with a checkpoint every
iteration, the run stops at iteration 3 with one line and exit code 1, and the latest checkpoint is
iteration 2's; with the flag it trains on; under --fp16's dynamic loss scale the check is off (as
Megatron-LM); the loss check at logged iterations, where no gradient norm tells."""
import math
import os
import re
import types

import pytest

from _train_util import TINY_GPT_ARGS, data_args, run_training
from megatron_dpp.training.loop import _not_finite

EXPLODING = ["--train-iters", "6", "--lr", "1e12", "--min-lr", "0"]
NAN_LINE = ("megatron_dpp: error: iteration 3: the gradient norm is nan (a NaN or Inf in the "
            "gradients); the run stops and saves nothing from this iteration on (as Megatron-LM; "
            "--no-check-for-nan-in-loss-and-grad trains on)")


def _iterations(out: str) -> list[int]:
    return [int(n) for n in re.findall(r" iteration\s+(\d+)/", out)]


@pytest.mark.timeout(300)
def test_a_nan_stops_the_run_before_anything_of_it_is_saved(tmp_path):
    save = str(tmp_path / "ckpt")
    rc, _, _, out = run_training([*EXPLODING, "--pipeline-model-parallel-size", "2", "--use-dpp",
                                  "--save", save, "--save-interval", "1"])
    assert rc == 1, out[-3000:]
    assert NAN_LINE in out, out[-3000:]
    assert _iterations(out) == [1, 2, 3]  # the NaN iteration's line, then nothing
    assert "saved checkpoint at iteration 3" not in out
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as tracker:
        assert tracker.read().strip() == "2"


@pytest.mark.timeout(300)
def test_the_flag_trains_on():
    rc, _, _, out = run_training([*EXPLODING, "--no-check-for-nan-in-loss-and-grad"])
    assert rc == 0, out[-3000:]
    assert _iterations(out) == [1, 2, 3, 4, 5, 6] and "lm loss: NAN" in out


def test_fp16s_dynamic_loss_scale_turns_the_check_off(monkeypatch):
    from megatron_dpp.arguments import parse_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    base = [*data_args(), *TINY_GPT_ARGS]
    assert parse_args(base).check_for_nan_in_loss_and_grad
    assert not parse_args([*base, "--fp16"]).check_for_nan_in_loss_and_grad
    assert parse_args([*base, "--fp16", "--loss-scale", "1024"]).check_for_nan_in_loss_and_grad


def test_the_loss_is_checked_where_it_is_logged():
    """The ranks agree on the logging rank's verdict; a finite gradient norm does not hide it."""
    agreed = []
    signals = types.SimpleNamespace(any_rank=lambda flag: agreed.append(flag) or flag)
    trainer = types.SimpleNamespace(watch=lambda phase: None, unwatch=lambda: None)
    nan_loss = {"lm loss": (math.nan, 8.0)}
    assert _not_finite(trainer, signals, 1.5, True, nan_loss) == "the loss is NaN or Inf"
    assert _not_finite(trainer, signals, None, True, {"lm loss": (8.3, 8.0)}) is None
    assert _not_finite(trainer, signals, 0.0, True, None) is None  # not the logging rank
    assert agreed == [True, False, False]
    assert _not_finite(trainer, signals, 1.5, False, None) is None  # not logged: no collective
    assert "gradient norm is inf" in _not_finite(trainer, signals, math.inf, False, None)
    assert len(agreed) == 3
