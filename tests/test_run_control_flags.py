"""Megatron-LM's flags that end a run early or load part of a checkpoint, through the trainer:
--exit-interval and --exit-duration-in-mins (stop on every rank after the same iteration, save
first with --save, exit 0), and --no-load-optim, --no-load-rng, --finetune (what --load restores).
"""
import os
import re

import pytest

from _train_util import run_training

SCHEDULE = ["--lr-decay-iters", "5", "--pipeline-model-parallel-size", "2"]


def _tracker(save):
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as handle:
        return handle.read().strip()


@pytest.fixture(scope="module")
def uninterrupted():
    rc, losses, _norms, out = run_training(SCHEDULE, nproc=2)
    assert rc == 0 and len(losses) == 5, out[-3000:]
    return losses


@pytest.mark.timeout(300)
def test_exit_interval_saves_exits_0_and_the_run_resumes(tmp_path, uninterrupted):
    save = str(tmp_path / "ckpt")
    rc, losses, _norms, out = run_training([*SCHEDULE, "--exit-interval", "2", "--save", save],
                                           nproc=2)
    assert rc == 0 and losses == uninterrupted[:2], out[-3000:]
    assert "exiting: --exit-interval 2 after iteration 2" in out
    assert _tracker(save) == "2"
    rc, losses, _norms, out = run_training([*SCHEDULE, "--load", save], nproc=2)
    assert rc == 0 and losses == uninterrupted[2:], out[-3000:]


@pytest.mark.timeout(300)
def test_exit_duration_stops_every_rank_after_the_same_iteration(tmp_path, uninterrupted):
    save = str(tmp_path / "ckpt")
    rc, losses, _norms, out = run_training(
        [*SCHEDULE, "--exit-duration-in-mins", "0.0001", "--save", save], nproc=2)
    assert rc == 0, out[-3000:]
    # Set-up alone takes longer than 6 ms: the first iteration is the last.
    assert losses == uninterrupted[:1]
    assert re.search(r"exiting: --exit-duration-in-mins 0\.0001 passed \([0-9.]+ minutes since "
                     r"the start on this rank\) after iteration 1", out), out[-3000:]
    assert _tracker(save) == "1"


# ----------------------------------------------------------------------------------------------
# what --load restores
# ----------------------------------------------------------------------------------------------
LR_RE = re.compile(r"\| learning rate: ([-+0-9.eE]+)")
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


def _rates(out):
    return [float(x) for x in LR_RE.findall(out)]


@pytest.fixture(scope="module")
def with_dropout(tmp_path_factory):
    """The uninterrupted run with dropout (losses, learning rates) and a checkpoint at 2."""
    rc, losses, _norms, out = run_training([*SCHEDULE, *DROPOUT], nproc=2)
    assert rc == 0 and len(losses) == 5, out[-3000:]
    save = str(tmp_path_factory.mktemp("dropout") / "ckpt")
    rc, first, _norms, saved_out = run_training([*SCHEDULE, *DROPOUT, "--train-iters", "2",
                                                 "--save", save], nproc=2)
    assert rc == 0 and first == losses[:2], saved_out[-3000:]
    return losses, _rates(out), save


@pytest.mark.timeout(300)
def test_a_whole_load_continues_and_no_load_rng_draws_other_dropout(with_dropout):
    losses, rates, save = with_dropout
    rc, resumed, _norms, out = run_training([*SCHEDULE, *DROPOUT, "--load", save], nproc=2)
    assert rc == 0 and resumed == losses[2:] and _rates(out) == rates[2:], out[-3000:]
    rc, resumed, _norms, out = run_training([*SCHEDULE, *DROPOUT, "--load", save,
                                             "--no-load-rng"], nproc=2)
    assert rc == 0 and "(not loaded: the RNG states)" in out, out[-3000:]
    # The same weights and batch, other dropout masks (the seed's, as at iteration 1).
    assert len(resumed) == 3 and resumed[0] != losses[2]
    assert _rates(out) == rates[2:]


@pytest.mark.timeout(300)
def test_no_load_optim_keeps_the_position_and_restarts_the_schedule(with_dropout):
    losses, rates, save = with_dropout
    rc, resumed, _norms, out = run_training([*SCHEDULE, *DROPOUT, "--load", save,
                                             "--no-load-optim"], nproc=2)
    assert rc == 0, out[-3000:]
    assert "(not loaded: the optimizer and the learning-rate schedule)" in out
    # Iteration 3's loss comes from the loaded weights, data and RNG, before any update.
    assert len(resumed) == 3 and resumed[0] == losses[2]
    # The schedule starts again: iteration 3 gets the rate of iteration 1.
    assert _rates(out)[0] == rates[0] != rates[2]


@pytest.mark.timeout(300)
def test_finetune_loads_the_model_only_and_starts_at_iteration_0(with_dropout):
    losses, rates, save = with_dropout
    rc, tuned, _norms, out = run_training([*SCHEDULE, *DROPOUT, "--load", save, "--finetune"],
                                          nproc=2)
    assert rc == 0, out[-3000:]
    assert "at iteration 0 (--finetune: the model only, from iteration 0 and the data's start)" \
        in out
    assert re.search(r" iteration\s+1/\s+5 \| consumed samples:\s+8 \|", out), out[-3000:]
    assert len(tuned) == 5 and _rates(out) == rates
    # Iteration 1's batch again, on weights trained two iterations: a lower loss than at the start.
    assert tuned[0] < losses[0]


@pytest.mark.timeout(300)
def test_no_load_optim_loads_a_distributed_optimizer_checkpoint_without_one(tmp_path):
    save = str(tmp_path / "ckpt")
    rc, _losses, _norms, out = run_training([*SCHEDULE, "--train-iters", "2", "--save", save,
                                             "--use-distributed-optimizer"], nproc=2)
    assert rc == 0, out[-3000:]
    rc, _losses, _norms, out = run_training([*SCHEDULE, "--load", save], nproc=2)
    assert rc != 0 and "saved with --use-distributed-optimizer; resume the same way, or add " \
                       "--no-load-optim" in out, out[-3000:]
    rc, losses, _norms, out = run_training([*SCHEDULE, "--load", save, "--no-load-optim"],
                                           nproc=2)
    assert rc == 0 and len(losses) == 3, out[-3000:]
