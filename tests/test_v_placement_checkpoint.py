"""Checkpoints of the v placement (--dpp-stage-placement v), against the interleaved one.

The v placement puts stage 2P-1-r on chunk 1 of rank r (rank 0: the first stage, with the
embedding, and the last, with the output layer and the loss), so a rank's `model0`/`model1` are
other stages than under the interleaved placement; torch_dist stores every tensor under its
global name, so a checkpoint loads across placements:

- v saved at iteration 3, resumed as v (losses equal to the uninterrupted v run's, exactly) and as
  interleaved under Megatron's own schedule (within 1e-5 relative: another schedule);
- an interleaved checkpoint (Megatron's schedule, a layout string) resumed as v with that layout
  string, where Megatron-Core takes chunk 1's layer offset from parallel_state;
- v at dp=2 (tied embeddings: both copies on rank 0 under one key) resumed as interleaved at
  dp=1;
- untied embeddings with the distributed optimizer: v resumed as interleaved with --use-dpp;
- tied embeddings with the distributed optimizer at dp=2: v resumed as v (equal losses) and as
  interleaved. Stage 0's one layer does not fill whole buckets, so the tied embedding's bucket
  follows a padded one: before mcore/distributed_optimizer.py's aligned_state_gather its saved
  state was shifted, a row short, and the resumed losses 0.7-1.8% off;
- the per-rank format (--ckpt-format torch): v resumes as v, and as interleaved it stops in one
  line naming both placements.

Every model here is the same tiny GPT, so the interleaved runs' losses match the v run's within
1e-5 (tests/test_dpp_parity.py) and one uninterrupted run per embedding setting is the reference.
"""
import os
import re

import pytest

from _train_util import assert_losses_close, run_training

SCHEDULE = ["--lr-decay-iters", "6"]
PP2 = ["--pipeline-model-parallel-size", "2"]
VPP2 = ["--num-virtual-stages-per-pipeline-rank", "2"]
V = ["--use-dpp", "--dpp-timeout", "60", "--dpp-stage-placement", "v"]
# Stages 0..3 of 1, 2, 1, 0 layers: under v rank 0 holds stages 0 and 3 (the embedding, the loss).
LAYOUT = ["--pipeline-model-parallel-layout", "Et|tt|t|L"]
UNTIED = ["--untie-embeddings-and-output-weights", "--use-distributed-optimizer"]
ERROR_RE = re.compile(r"^megatron_dpp: error: .*$", re.MULTILINE)

pytestmark = [pytest.mark.slow]


def _train(flags, iters, save=None, load=None, expect_rc=0, nproc=2):
    args = [*SCHEDULE, *PP2, *flags, "--train-iters", str(iters)]
    if save:
        args += ["--save", save]
    if load:
        args += ["--load", load]
    rc, losses, _norms, out = run_training(args, nproc=nproc)
    if expect_rc == 0:
        assert rc == 0, out[-3000:]
        if load:
            assert "loaded checkpoint" in out and re.search(r" iteration\s+4/", out), out[-3000:]
    return rc, losses, out


@pytest.fixture(scope="module")
def uninterrupted():
    """Six iterations as v, tied embeddings (GPT's default)."""
    _rc, losses, out = _train([*VPP2, *V], 6)
    assert len(losses) == 6, out[-3000:]
    return losses


@pytest.fixture(scope="module")
def saved_v(tmp_path_factory, uninterrupted):
    save = str(tmp_path_factory.mktemp("v") / "ckpt")
    _rc, losses, _out = _train([*VPP2, *V], 3, save=save)
    assert losses == uninterrupted[:3]
    assert os.path.isfile(os.path.join(save, "iter_0000003", "metadata.json"))
    return save


@pytest.mark.timeout(240)
def test_v_checkpoint_resumes_as_v(saved_v, uninterrupted):
    _rc, losses, _out = _train([*VPP2, *V], 6, load=saved_v)
    assert losses == uninterrupted[3:]


@pytest.mark.timeout(240)
def test_v_checkpoint_resumes_as_interleaved(saved_v, uninterrupted):
    """Megatron's interleaved 1F1B: rank 0's model1 is stage 2 here, stage 3 in the checkpoint's
    run; rank 1 gets the output layer, saved on rank 0 as the embedding's tied copy."""
    _rc, losses, _out = _train(VPP2, 6, load=saved_v)
    assert_losses_close(losses, uninterrupted[3:], rel=1e-5)


@pytest.mark.timeout(240)
def test_v_checkpoint_at_dp2_resumes_as_interleaved_at_dp1(tmp_path, uninterrupted):
    """At dp=2 rank 0's two copies of the tied embedding (one key) are written by each
    data-parallel group's first rank: the fully parallel save would make both the main replica."""
    save = str(tmp_path / "ckpt")
    _rc, losses, _out = _train([*VPP2, *V], 3, save=save, nproc=4)
    assert_losses_close(losses, uninterrupted[:3], rel=1e-5)
    _rc, losses, _out = _train(VPP2, 6, load=save)
    assert_losses_close(losses, uninterrupted[3:], rel=1e-5)


@pytest.mark.timeout(240)
def test_interleaved_checkpoint_with_a_layout_resumes_as_v(tmp_path, uninterrupted):
    save = str(tmp_path / "ckpt")
    _rc, losses, _out = _train(LAYOUT, 3, save=save)
    assert_losses_close(losses, uninterrupted[:3], rel=1e-5)
    _rc, losses, _out = _train([*LAYOUT, *V], 6, load=save)
    assert_losses_close(losses, uninterrupted[3:], rel=1e-5)


@pytest.mark.timeout(300)
def test_untied_v_checkpoint_with_the_distributed_optimizer_resumes_as_interleaved(tmp_path):
    _rc, reference, out = _train([*VPP2, *UNTIED, *V], 6)
    assert len(reference) == 6, out[-3000:]
    save = str(tmp_path / "ckpt")
    _rc, losses, _out = _train([*VPP2, *UNTIED, *V], 3, save=save)
    assert losses == reference[:3]
    _rc, losses, _out = _train([*VPP2, *UNTIED, "--use-dpp", "--dpp-timeout", "60"], 6,
                               load=save)
    assert_losses_close(losses, reference[3:], rel=1e-5)


@pytest.mark.timeout(360)
def test_tied_v_checkpoint_with_the_distributed_optimizer_at_dp2_resumes(tmp_path):
    dist_opt = "--use-distributed-optimizer"
    _rc, reference, out = _train([*VPP2, dist_opt, *V], 6, nproc=4)
    assert len(reference) == 6, out[-3000:]
    save = str(tmp_path / "ckpt")
    _rc, losses, _out = _train([*VPP2, dist_opt, *V], 3, save=save, nproc=4)
    assert losses == reference[:3]
    _rc, losses, _out = _train([*VPP2, dist_opt, *V], 6, load=save, nproc=4)
    assert losses == reference[3:]
    _rc, losses, _out = _train([*VPP2, dist_opt], 6, load=save, nproc=4)
    assert_losses_close(losses, reference[3:], rel=1e-5)


@pytest.mark.timeout(300)
def test_per_rank_format_resumes_as_v_only(tmp_path, uninterrupted):
    save = str(tmp_path / "old")
    _rc, losses, _out = _train([*VPP2, *V, "--ckpt-format", "torch"], 3, save=save)
    assert losses == uninterrupted[:3]
    assert os.path.isfile(os.path.join(save, "iter_0000003", "rank_00000.pt"))
    _rc, losses, _out = _train([*VPP2, *V], 6, load=save)
    assert losses == uninterrupted[3:]
    rc, _losses, out = _train(VPP2, 6, load=save, expect_rc=2)
    assert rc != 0
    errors = ERROR_RE.findall(out)
    assert len(errors) == 1, out[-4000:]
    assert ("old per-rank format" in errors[0] and "stage placement v, this run is" in errors[0]
            and errors[0].endswith("stage placement interleaved; to load it here, convert it: "
                                   "resume it at the layout that saved it for one more iteration "
                                   "with --save NEW_DIR (--ckpt-format torch_dist, the default), "
                                   "then load NEW_DIR")), errors[0]
