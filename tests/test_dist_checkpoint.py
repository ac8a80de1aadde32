"""Megatron-Core distributed checkpoints (--ckpt-format torch_dist, the default).

- Resharding: a checkpoint saved at pp=2 resumes at pp=4, tp=2 x pp=2, pp=2 x vpp=2, an uneven
  pp=2 split, with and without --use-dpp, and the losses continue within 1e-5 relative of the
  uninterrupted run.
- Atomic saves: on a tmpfs too small for the next save, the free-space check refuses it before
  writing; the previous checkpoint stays the latest and loadable, with nothing left behind.
- A damaged checkpoint (its checksums, checksums.json, are checked before loading) or one of
  another model: one line saying what and where, exit code 2.
"""
import os
import re
import shutil

import pytest

from _tmpfs import mounted_tmpfs
from _train_util import assert_losses_close, run_training

SCHEDULE = ["--lr-decay-iters", "6"]
PP2 = ["--pipeline-model-parallel-size", "2"]
DPP = ["--use-dpp", "--dpp-timeout", "60"]
ERROR_RE = re.compile(r"^megatron_dpp: error: .*$", re.MULTILINE)


@pytest.fixture(scope="module")
def uninterrupted():
    rc, losses, _norms, out = run_training([*SCHEDULE, *PP2, "--train-iters", "6"], nproc=2)
    assert rc == 0 and len(losses) == 6, out[-3000:]
    return losses


@pytest.fixture(scope="module")
def saved_pp2(tmp_path_factory, uninterrupted):
    save = str(tmp_path_factory.mktemp("pp2") / "ckpt")
    rc, losses, _norms, out = run_training([*SCHEDULE, *PP2, "--train-iters", "3", "--save", save],
                                           nproc=2)
    assert rc == 0, out[-3000:]
    assert losses == uninterrupted[:3]
    directory = os.path.join(save, "iter_0000003")
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "3"
    assert {"metadata.json", "common.pt", ".metadata", "checksums.json"} <= \
        set(os.listdir(directory))
    assert not [name for name in os.listdir(save) if name.endswith(".saving")]
    return save


RESUMES = {
    "pp4": (["--pipeline-model-parallel-size", "4"], 4),
    "tp2xpp2": (["--tensor-model-parallel-size", "2", *PP2], 4),
    "pp2xvpp2": ([*PP2, "--num-virtual-stages-per-pipeline-rank", "2"], 2),
    "pp2-dpp": ([*PP2, *DPP], 2),
    "pp4-dpp": (["--pipeline-model-parallel-size", "4", *DPP], 4),
    # Layers 1 | 3 instead of 2 | 2: each layer found by its global number.
    "pp2-uneven-dpp": ([*PP2, "--decoder-first-pipeline-num-layers", "1", *DPP], 2),
    "pp2-layout": ([*PP2, "--pipeline-model-parallel-layout", "Ett|t|t|L"], 2),
}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", list(RESUMES))
def test_resume_at_another_layout_continues_the_losses(saved_pp2, uninterrupted, layout):
    flags, nproc = RESUMES[layout]
    rc, losses, _norms, out = run_training(
        [*SCHEDULE, *flags, "--train-iters", "6", "--load", saved_pp2], nproc=nproc)
    assert rc == 0, out[-3000:]
    assert "loaded checkpoint" in out and re.search(r" iteration\s+4/", out), out[-3000:]
    assert_losses_close(losses, uninterrupted[3:], rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dpp_save_resumes_without_dpp(tmp_path, uninterrupted):
    save = str(tmp_path / "ckpt")
    rc, losses, _norms, out = run_training(
        [*SCHEDULE, *PP2, *DPP, "--train-iters", "3", "--save", save], nproc=2)
    assert rc == 0, out[-3000:]
    assert_losses_close(losses, uninterrupted[:3], rel=1e-5)
    rc, losses, _norms, out = run_training(
        [*SCHEDULE, "--pipeline-model-parallel-size", "4", "--train-iters", "6", "--load", save],
        nproc=4)
    assert rc == 0, out[-3000:]
    assert_losses_close(losses, uninterrupted[3:], rel=1e-5)


def _one_error(out: str) -> str:
    errors = ERROR_RE.findall(out)
    assert len(errors) == 1, out[-4000:]
    assert re.search(r"exitcode\s*:\s*2\b", out), out[-4000:]  # torchrun's report of the ranks
    assert not re.search(r'File ".*/megatron_dpp/', out), out[-4000:]  # no traceback of ours
    return errors[0]


def _copy(saved: str, tmp_path) -> str:
    target = str(tmp_path / "copy")
    shutil.copytree(saved, target)
    return target


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_damaged_shard_is_one_line_exit_2(saved_pp2, tmp_path):
    load = _copy(saved_pp2, tmp_path)
    directory = os.path.join(load, "iter_0000003")
    shard = sorted(name for name in os.listdir(directory) if name.endswith(".distcp"))[0]
    with open(os.path.join(directory, shard), "r+b") as handle:
        handle.truncate(100)
    rc, _losses, _norms, out = run_training([*SCHEDULE, *PP2, "--train-iters", "6", "--load", load],
                                            nproc=2)
    assert rc != 0
    line = _one_error(out)
    assert f"checkpoint file {os.path.join(directory, shard)} is damaged: truncated" in line, line


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("damage", ["tracker", "metadata", "manifest"])
def test_damaged_tracker_or_metadata_is_one_line_exit_2(saved_pp2, tmp_path, damage):
    load = _copy(saved_pp2, tmp_path)
    if damage == "tracker":
        path = os.path.join(load, "latest_checkpointed_iteration.txt")
        with open(path, "w") as handle:
            handle.write("\x00\x13garbage")
    elif damage == "metadata":
        path = os.path.join(load, "iter_0000003", "common.pt")
        with open(path, "wb") as handle:
            handle.write(b"not a torch file")
    else:  # a deleted manifest: common.pt says the save wrote one
        path = os.path.join(load, "iter_0000003", "checksums.json")
        os.remove(path)
    rc, _losses, _norms, out = run_training([*SCHEDULE, *PP2, "--train-iters", "6", "--load", load],
                                            nproc=2)
    assert rc != 0
    line = _one_error(out)
    says = "is missing" if damage == "manifest" else "is damaged"
    assert f"checkpoint file {path} {says}" in line, line


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", [SCHEDULE, ["--lr-decay-iters", "8"]],
                         ids=["same_schedule", "another_schedule_too"])
def test_checkpoint_of_another_model_is_one_line_exit_2(saved_pp2, schedule):
    """The model's shape is named first, also where the learning-rate schedule differs too
    (docs/failures.md's order)."""
    rc, _losses, _norms, out = run_training(
        [*schedule, *PP2, "--train-iters", "6", "--load", saved_pp2, "--hidden-size", "128"],
        nproc=2)
    assert rc != 0
    line = _one_error(out)
    assert "another model" in line and saved_pp2 in line and "shape" in line, line


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_save_left_unfinished_is_removed_at_the_next_start(tmp_path, uninterrupted):
    """A rank killed during a save leaves iter_N.saving/ (issue: its survivors could not remove
    it): the next start removes it first, in one line, and saves that iteration again."""
    save = str(tmp_path / "ckpt")
    left = os.path.join(save, "iter_0000002.saving")
    os.makedirs(os.path.join(left, "__0_0.distcp.partial"))
    rc, losses, _norms, out = run_training(
        [*SCHEDULE, *PP2, "--train-iters", "2", "--save", save, "--save-interval", "2"], nproc=2)
    assert rc == 0, out[-3000:]
    assert losses == uninterrupted[:2]
    assert (f" removed iter_0000002.saving from {save}: the staging folder of a save that did not "
            f"finish") in out, out[-3000:]
    assert sorted(os.listdir(save)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]


# ----------------------------------------------------------------------------------------------
# atomic saves: a full disk
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def small_tmpfs(tmp_path):
    """A tmpfs of 10 MiB: room for one checkpoint of the tiny GPT at pp=2 (6 MiB written, 7.6
    MiB estimated by the free-space check), not for two."""
    with mounted_tmpfs(tmp_path, "10m") as mount_point:
        yield mount_point


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_full_disk_keeps_the_previous_checkpoint_latest_and_loadable(small_tmpfs, uninterrupted):
    save = os.path.join(small_tmpfs, "ckpt")
    rc, losses, _norms, out = run_training(
        [*SCHEDULE, *PP2, "--train-iters", "4", "--save", save, "--save-interval", "2"], nproc=2)
    assert rc != 0, out[-3000:]
    assert losses == uninterrupted[:4]
    errors = ERROR_RE.findall(out)
    assert len(errors) == 1 and "iteration 4" in errors[0] and \
        f"not enough free space in {save}: the checkpoint needs about" in errors[0] and \
        "latest checkpoint there is still iteration 2" in errors[0], out[-3000:]
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "2"
    assert sorted(os.listdir(save)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]

    rc, losses, _norms, out = run_training(
        [*SCHEDULE, *PP2, "--train-iters", "6", "--load", save], nproc=2)
    assert rc == 0, out[-3000:]
    assert_losses_close(losses, uninterrupted[2:], rel=1e-5)


# ----------------------------------------------------------------------------------------------
# the old per-rank format (--ckpt-format torch): same layout loads, another one is refused
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_old_format_loads_at_its_layout_and_is_refused_at_another(tmp_path, uninterrupted):
    save = str(tmp_path / "old")
    rc, _losses, _norms, out = run_training(
        [*SCHEDULE, *PP2, "--train-iters", "3", "--save", save, "--ckpt-format", "torch"], nproc=2)
    assert rc == 0, out[-3000:]
    assert os.path.isfile(os.path.join(save, "iter_0000003", "rank_00000.pt"))
    rc, losses, _norms, out = run_training([*SCHEDULE, *PP2, "--train-iters", "6", "--load", save],
                                           nproc=2)
    assert rc == 0, out[-3000:]
    assert losses == uninterrupted[3:]
    rc, _losses, _norms, out = run_training(
        [*SCHEDULE, "--pipeline-model-parallel-size", "4", "--train-iters", "6", "--load", save],
        nproc=4)
    line = _one_error(out)
    assert "old per-rank format" in line and "convert it" in line and save in line, line
    rc, _losses, _norms, out = run_training(
        [*SCHEDULE, *PP2, "--decoder-last-pipeline-num-layers", "1", "--train-iters", "6",
         "--load", save], nproc=2)
    line = _one_error(out)
    assert ("layers per pipeline rank even, stage placement interleaved, this run is world 2, "
            "tp 1, pp 2, vpp None, layers per pipeline rank 3 | 1, stage placement "
            "interleaved") in line, line
