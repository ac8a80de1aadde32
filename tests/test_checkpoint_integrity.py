"""Checkpoints that are never silently wrong: checksums recorded at save and verified at load,
--load never silent, saves that fail cleanly (megatron_dpp/training/checkpoint/integrity.py and
the save transaction of training/checkpoint/save_load.py).

- In this process: the manifest and every kind of damage; the save transaction on a one-rank gloo
  group (too little space, a real ENOSPC on a small tmpfs, a torch_dist write failing, publishing
  failing) and on two forked ranks (a failure on one rank ends the save on both at once).
- The real trainer, its ranks started as processes of their own (as torchrun does, but each
  rank's exit code and stderr is seen; forked from the preloaded servers of _forked_ranks.py
  where there is no GPU): a table of damaged checkpoints (one line naming the file, exit code 2
  on every rank, no traceback, no training step), --load of an iteration folder, --load = --save
  without a checkpoint (starts from scratch, and says so), a checkpoint saved before checksums
  (a warning).
"""
import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import uuid
import zlib

import pytest
import torch
import torch.distributed as dist

from _forked_ranks import run_forked_apart
from _ports import free_local_port
from _tmpfs import mounted_tmpfs
from _train_util import PYTHON, REPO_ROOT, TINY_GPT_ARGS, _env, data_args
from megatron_dpp.training.checkpoint import save_load as checkpointing
from megatron_dpp.training.checkpoint.integrity import (
    MANIFEST_FILE,
    SAVED_WITH_CHECKSUMS,
    SPACE_MARGIN_BYTES,
    CheckpointDamaged,
    bytes_needed,
    check_file,
    check_listing,
    file_entry,
    owner_rank,
    read_manifest,
    save_with_checksum,
    space_problem,
    write_manifest,
)
from megatron_dpp.training.checkpoint.save_load import CheckpointLoadError, CheckpointSaveError

TRACKER = "latest_checkpointed_iteration.txt"
ERROR_RE = re.compile(r"^megatron_dpp: error: .*$", re.MULTILINE)


# ----------------------------------------------------------------------------------------------
# the manifest
# ----------------------------------------------------------------------------------------------
def _folder(tmp_path, files=None) -> str:
    """An iteration folder with a manifest: rank_00000.pt written through save_with_checksum,
    the other files read back, as the two formats do."""
    directory = tmp_path / "iter_0000004"
    directory.mkdir()
    entries = {"rank_00000.pt": save_with_checksum({"w": torch.arange(1000.0)},
                                                   str(directory / "rank_00000.pt"))}
    for name, content in (files or {"rank_00001.pt": os.urandom(4096), ".metadata": b"{}"}).items():
        (directory / name).write_bytes(content)
        entries[name] = file_entry(str(directory / name))
    write_manifest(str(directory), entries)
    return str(directory)


def _verify_all(directory: str) -> None:
    recorded = read_manifest(directory)
    check_listing(directory, recorded)
    for name, entry in recorded.items():
        check_file(directory, name, entry)


def test_the_manifest_records_every_file_as_written(tmp_path):
    directory = _folder(tmp_path)
    recorded = read_manifest(directory)
    assert sorted(recorded) == [".metadata", "rank_00000.pt", "rank_00001.pt"]
    for name, entry in recorded.items():  # checksummed while written = read back from disk
        data = open(os.path.join(directory, name), "rb").read()
        assert entry == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}, name
    _verify_all(directory)
    assert read_manifest(str(tmp_path)) is None  # no manifest: a checkpoint saved without one


def _flip(path, count=64):
    with open(path, "r+b") as handle:
        handle.seek(os.path.getsize(path) // 2)
        data = handle.read(count)
        handle.seek(os.path.getsize(path) // 2)
        handle.write(bytes(byte ^ 0xA5 for byte in data))


# case: (what is done to the folder, the file the line names, what it says)
DAMAGE = {
    "flipped_bytes": (lambda d: _flip(f"{d}/rank_00001.pt"), "rank_00001.pt",
                      r"is damaged: checksum mismatch \(crc32 recorded [0-9a-f]{8}, found [0-9a-f]{8}\)"),
    "truncated": (lambda d: os.truncate(f"{d}/rank_00000.pt", 100), "rank_00000.pt",
                  r"is damaged: truncated \(\d+ bytes recorded, 100 found\)"),
    "empty": (lambda d: os.truncate(f"{d}/rank_00001.pt", 0), "rank_00001.pt",
              r"is damaged: it is empty \(4096 bytes recorded\)"),
    "grown": (lambda d: open(f"{d}/.metadata", "ab").write(b"x"), ".metadata",
              r"is damaged: longer than saved \(2 bytes recorded, 3 found\)"),
    "deleted": (lambda d: os.remove(f"{d}/rank_00001.pt"), "rank_00001.pt",
                r"is missing \(recorded in checksums.json\)"),
    "added": (lambda d: open(f"{d}/rank_00002.pt", "wb").write(b"x"), "rank_00002.pt",
              r"is not recorded in checksums.json"),
    "manifest_garbage": (lambda d: open(f"{d}/{MANIFEST_FILE}", "wb").write(b"\x00\xff{"),
                         MANIFEST_FILE, r"is damaged: not a JSON manifest"),
    "manifest_other_version": (
        lambda d: json.dump({"format": "megatron_dpp checksums", "version": 9, "algorithm": "md5",
                             "files": {}}, open(f"{d}/{MANIFEST_FILE}", "w")),
        MANIFEST_FILE, r"is damaged: version 9 with algorithm 'md5'; this program reads version 1"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damage_is_one_line_naming_the_file(tmp_path, case):
    damage, name, says = DAMAGE[case]
    directory = _folder(tmp_path)
    damage(directory)
    with pytest.raises(CheckpointDamaged) as caught:
        _verify_all(directory)
    line = str(caught.value)
    assert "\n" not in line
    assert re.fullmatch(rf"checkpoint file {re.escape(os.path.join(directory, name))} {says}.*",
                        line), line


def test_each_file_has_one_owner_rank():
    assert [owner_rank(f"rank_{r:05d}.pt", 4) for r in range(4)] == [0, 1, 2, 3]
    assert owner_rank("__3_0.distcp", 4) == owner_rank("__3_1.distcp", 4) == 3
    assert owner_rank("__3_0.distcp", 2) == 1  # loaded on fewer ranks than saved it
    assert {owner_rank(name, 4) for name in (".metadata", "common.pt", "metadata.json")} == {0}


def test_space_needed_and_the_refusal():
    assert bytes_needed(0) == SPACE_MARGIN_BYTES
    assert bytes_needed(100 << 20) == int((100 << 20) * 1.05) + SPACE_MARGIN_BYTES
    assert space_problem("/ck", 10, 10) is None
    assert space_problem("/ck", 3 << 30, 1 << 20) == (
        "not enough free space in /ck: the checkpoint needs about 3.0 GiB (every rank's tensors "
        "plus 5% and 1.0 MiB a rank), 1.0 MiB are free")


# ----------------------------------------------------------------------------------------------
# --load: what it names, checked before launch and at run time
# ----------------------------------------------------------------------------------------------
def _flag_check(argv, monkeypatch, capsys):
    from megatron_dpp.arguments import parse_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    try:
        parse_args([*data_args(), *TINY_GPT_ARGS, *argv], prog="megatron_dpp.pretrain_gpt")
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def test_load_without_a_checkpoint_starts_from_scratch_unless_asked_to_exit(tmp_path, monkeypatch,
                                                                            capsys):
    """Megatron-LM's load_checkpoint: a --load without a checkpoint (or not there) warns and starts
    from random weights; --exit-on-missing-checkpoint refuses it in one line before launch."""
    empty = str(tmp_path / "empty")
    os.mkdir(empty)
    for directory in (empty, str(tmp_path / "not_yet")):
        assert _flag_check(["--load", directory], monkeypatch, capsys)[0] == 0
        # The same directory as --save (Megatron-LM's scripts): the first run starts from scratch.
        assert _flag_check(["--load", directory, "--save", directory], monkeypatch, capsys)[0] == 0
    code, err = _flag_check(["--load", empty, "--exit-on-missing-checkpoint"], monkeypatch, capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"megatron_dpp.pretrain_gpt: error: --load {empty} holds no checkpoint "
                          f"(no {TRACKER}, no iter_NNNNNNN folder)"), err
    # A tracker, an iteration folder, or iteration folders without a tracker: left to the run.
    os.mkdir(os.path.join(empty, "iter_0000007"))
    for argv in (["--load", empty], ["--load", os.path.join(empty, "iter_0000007")]):
        assert _flag_check([*argv, "--exit-on-missing-checkpoint"], monkeypatch, capsys)[0] == 0


def test_iteration_folders_without_a_tracker_ask_which_one(tmp_path):
    for name in ("iter_0000002", "iter_0000004"):
        (tmp_path / name).mkdir()
    with pytest.raises(CheckpointLoadError, match=re.escape(
            f"--load {tmp_path} has iteration folders (iter_0000002, iter_0000004) but no "
            f"{TRACKER}; name the one to load: --load {tmp_path}/iter_0000004")):
        checkpointing._directory_to_load(str(tmp_path), None)
    assert checkpointing._directory_to_load(f"{tmp_path}/iter_0000002", None) == \
        f"{tmp_path}/iter_0000002"
    (tmp_path / TRACKER).write_text("6\n")
    with pytest.raises(CheckpointLoadError, match="names iteration 6, but .*iter_0000006 does not"):
        checkpointing._directory_to_load(str(tmp_path), None)


# ----------------------------------------------------------------------------------------------
# the save transaction, in this process (one rank) and on two forked ranks
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def one_rank(tmp_path):
    store = dist.FileStore(str(tmp_path / f"store-{uuid.uuid4().hex[:8]}"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _prepare(payload, fail_with=None):
    """A rank's part as the torch format's: one file, checksummed as written."""
    def prepare():
        def write(directory):
            name = f"rank_{dist.get_rank():05d}.pt"
            if fail_with is not None:
                raise fail_with
            return {name: save_with_checksum(payload, os.path.join(directory, name))}
        return checkpointing.tensor_bytes(payload), write
    return prepare


def _assert_previous_is_latest(root, iteration=2):
    assert open(os.path.join(root, TRACKER)).read().strip() == str(iteration)
    assert sorted(os.listdir(root)) == [f"iter_{iteration:07d}", TRACKER]  # no .saving, no .tmp
    _verify_all(os.path.join(root, f"iter_{iteration:07d}"))


def test_too_little_space_writes_nothing(one_rank, tmp_path, monkeypatch):
    root = str(tmp_path / "ck")
    checkpointing._save_atomically(root, 2, _prepare({"w": torch.zeros(100)}))
    monkeypatch.setattr(checkpointing, "free_bytes", lambda path: 3 << 20)
    with pytest.raises(CheckpointSaveError) as caught:
        checkpointing._save_atomically(root, 4, _prepare(
            {"w": torch.zeros(1 << 20)}, fail_with=AssertionError("must not write")))
    assert str(caught.value) == (
        f"saving the checkpoint of iteration 4 to {root} failed (not enough free space in {root}: "
        f"the checkpoint needs about 5.2 MiB (every rank's tensors plus 5% and 1.0 MiB a rank), "
        f"3.0 MiB are free); the latest checkpoint there is still iteration 2")
    _assert_previous_is_latest(root)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs (root only; skipped elsewhere), unmounted after the test."""
    with mounted_tmpfs(tmp_path, "2m") as mount_point:
        yield mount_point


def test_a_full_disk_while_writing_names_the_file_and_errno(one_rank, small_tmpfs, monkeypatch):
    """A real ENOSPC: the estimate said it fits (another process filled the disk meanwhile)."""
    root = os.path.join(small_tmpfs, "ck")
    checkpointing._save_atomically(root, 2, _prepare({"w": torch.zeros(1000)}))
    monkeypatch.setattr(checkpointing, "bytes_needed", lambda tensors: 0)
    with pytest.raises(CheckpointSaveError) as caught:
        checkpointing._save_atomically(root, 4, _prepare({"w": torch.zeros(1 << 20)}))
    assert str(caught.value) == (
        f"saving the checkpoint of iteration 4 to {root} failed (rank 0 could not write "
        f"{root}/iter_0000004.saving/rank_00000.pt: [Errno 28] No space left on device); the "
        f"latest checkpoint there is still iteration 2")
    _assert_previous_is_latest(root)


def test_a_failed_torch_dist_write_names_the_folder_and_errno(one_rank, tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    root = str(tmp_path / "ck")
    checkpointing._save_atomically(root, 2, _prepare({"w": torch.zeros(10)}))
    failure = CheckpointException("write", {0: OSError(28, "No space left on device")})
    with pytest.raises(CheckpointSaveError, match=re.escape(
            f"failed (rank 0 could not write {root}/iter_0000004.saving: [Errno 28] No space left "
            f"on device); the latest checkpoint there is still iteration 2")):
        checkpointing._save_atomically(root, 4, _prepare({}, fail_with=failure))
    _assert_previous_is_latest(root)


def test_a_torch_dist_save_starts_no_manager_process(one_rank, tmp_path):
    """Megatron-Core's writer hands its results back through a multiprocessing Manager's queue by
    default, a process per rank that outlives a rank killed during the save; the synchronous save
    here (mcore/checkpoint_writer.py) starts none, and what it wrote loads."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    from megatron_dpp.mcore.checkpoint_writer import in_process_write_results
    from megatron_dpp.training.checkpoint.torch_dist import _cpu_patches

    _cpu_patches()
    assert not multiprocessing.active_children()
    weights = torch.arange(8.0)
    with in_process_write_results():
        dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", weights)},
                                str(tmp_path), get_default_save_sharded_strategy("torch_dist"))
    assert not multiprocessing.active_children()  # the bucket writers ended, no Manager started
    loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8))},
                                     str(tmp_path))
    assert torch.equal(loaded["w"], weights)


def test_a_failed_publish_keeps_the_previous_checkpoint_latest(one_rank, tmp_path, monkeypatch):
    root = str(tmp_path / "ck")
    checkpointing._save_atomically(root, 2, _prepare({"w": torch.zeros(10)}))

    def full_disk(path, text):
        raise OSError(28, "No space left on device", path)
    monkeypatch.setattr(checkpointing, "_write_synced", full_disk)
    with pytest.raises(CheckpointSaveError, match=re.escape(
            f"failed (could not publish it: {root}/{TRACKER}.tmp: [Errno 28] No space left on "
            f"device); the latest checkpoint there is still iteration 2")):
        checkpointing._save_atomically(root, 4, _prepare({"w": torch.zeros(10)}))
    _assert_previous_is_latest(root)


def _rank_saves(rank, store_path, root, failing_rank, report):
    """A forked rank: a good save at iteration 2, then one at 4 whose write fails on failing_rank;
    writes what it raised to report.RANK."""
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        checkpointing._save_atomically(root, 2, _prepare({"w": torch.full((10,), rank)}))
        error = OSError(28, "No space left on device", f"{root}/iter_0000004.saving/x")
        try:
            checkpointing._save_atomically(root, 4, _prepare(
                {"w": torch.zeros(10)}, fail_with=error if rank == failing_rank else None))
            outcome = "saved"
        except CheckpointSaveError as caught:
            outcome = str(caught)
        with open(f"{report}.{rank}", "w") as handle:
            handle.write(outcome)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_failure_on_one_rank_ends_the_save_on_every_rank(tmp_path, failing_rank):
    assert not dist.is_initialized()
    root, report = str(tmp_path / "ck"), str(tmp_path / "report")
    context = multiprocessing.get_context("fork")  # the parent's imports: a start in milliseconds
    ranks = [context.Process(target=_rank_saves, args=(rank, str(tmp_path / "store"), root,
                                                      failing_rank, report)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=45)
    alive = [process.pid for process in ranks if process.is_alive()]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, "a rank still waits for the others"
    assert [process.exitcode for process in ranks] == [0, 0]
    outcomes = [open(f"{report}.{rank}").read() for rank in (0, 1)]
    assert outcomes[0] == outcomes[1] == (
        f"saving the checkpoint of iteration 4 to {root} failed (rank {failing_rank} could not "
        f"write {root}/iter_0000004.saving/x: [Errno 28] No space left on device); the latest "
        f"checkpoint there is still iteration 2")
    assert open(os.path.join(root, TRACKER)).read().strip() == "2"
    assert sorted(os.listdir(root)) == ["iter_0000002", TRACKER]


# ----------------------------------------------------------------------------------------------
# the real trainer
# ----------------------------------------------------------------------------------------------
PP2 = ["--pipeline-model-parallel-size", "2", "--lr-decay-iters", "6"]


def run_ranks(args, nproc=2, timeout=120):
    """megatron_dpp.pretrain_gpt on `nproc` ranks, each a process of its own with torchrun's
    variables: (each rank's exit code, stdout of all ranks, stderr of all ranks). Forked from
    the preloaded servers (each rank's imports skip 4-7 s of CPU), started directly where the
    environment shows a GPU."""
    command_args = [*data_args(), *TINY_GPT_ARGS, *args]
    forked = run_forked_apart("megatron_dpp.pretrain_gpt", command_args, nproc, _env(),
                              REPO_ROOT, timeout)
    if forked is not None:
        codes, outs, errs = forked
        return codes, "".join(outs), "".join(errs)
    env = _env()
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_local_port()),
               WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
    command = [PYTHON, "-m", "megatron_dpp.pretrain_gpt", *command_args]
    ranks = [subprocess.Popen(command, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                              cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True) for rank in range(nproc)]
    outputs = []
    try:
        for process in ranks:
            outputs.append(process.communicate(timeout=timeout))
    finally:
        for process in ranks:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    assert len(outputs) == nproc, "a rank did not finish in time"
    return ([process.returncode for process in ranks], "".join(out for out, _ in outputs),
            "".join(err for _, err in outputs))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The torch format at pp=2, iterations 1 and 2, from --load = --save without a checkpoint."""
    root = str(tmp_path_factory.mktemp("saved") / "ck")
    codes, out, err = run_ranks([*PP2, "--train-iters", "2", "--ckpt-format", "torch",
                                 "--save", root, "--save-interval", "1", "--load", root])
    assert codes == [0, 0], err[-3000:]
    assert f" no checkpoint in {root} yet (it is also --save): training starts from scratch" in out
    assert open(os.path.join(root, TRACKER)).read().strip() == "2"
    assert sorted(os.listdir(os.path.join(root, "iter_0000002"))) == \
        [MANIFEST_FILE, "rank_00000.pt", "rank_00001.pt"]
    return root


def _damaged_copy(saved, tmp_path, damage) -> str:
    root = str(tmp_path / "ck")
    shutil.copytree(saved, root)
    damage(root, os.path.join(root, "iter_0000002"))
    return root


def _strip_checksums(root, directory):
    """What a save before checksums left: no manifest, and no word of one in the state."""
    os.remove(os.path.join(directory, MANIFEST_FILE))
    for name in ("rank_00000.pt", "rank_00001.pt"):
        state = torch.load(os.path.join(directory, name), weights_only=False)
        del state[SAVED_WITH_CHECKSUMS]
        torch.save(state, os.path.join(directory, name))


# case: (damage(root, iteration folder), how the line starts ({root}: the copy), extra flags,
# ranks)
LOADS = {
    "flipped_bytes": (lambda r, d: _flip(f"{d}/rank_00001.pt"),
                      "checkpoint file {root}/iter_0000002/rank_00001.pt is damaged: checksum "
                      "mismatch (crc32 recorded ", [], 2),
    "truncated": (lambda r, d: os.truncate(f"{d}/rank_00000.pt", 1000),
                  "checkpoint file {root}/iter_0000002/rank_00000.pt is damaged: truncated (", [],
                  2),
    "empty": (lambda r, d: os.truncate(f"{d}/rank_00001.pt", 0),
              "checkpoint file {root}/iter_0000002/rank_00001.pt is damaged: it is empty (", [], 2),
    "rank_file_deleted": (lambda r, d: os.remove(f"{d}/rank_00001.pt"),
                          "checkpoint file {root}/iter_0000002/rank_00001.pt is missing (recorded "
                          "in checksums.json)", [], 2),
    "manifest_deleted": (lambda r, d: os.remove(f"{d}/{MANIFEST_FILE}"),
                         "checkpoint file {root}/iter_0000002/checksums.json is missing: the "
                         "checkpoint was saved with checksums", [], 2),
    "tracker_forty": (lambda r, d: open(f"{r}/{TRACKER}", "w").write("forty\n"),
                      "checkpoint file {root}/" + TRACKER + " is damaged: 'forty' is not an "
                      "iteration number", [], 2),
    "layout_changed": (lambda r, d: None,
                       "checkpoint {root}/iter_0000002/rank_00000.pt (old per-rank format) was "
                       "saved at layout world 2, tp 1, pp 2", ["--pipeline-model-parallel-size",
                                                               "1"], 1),
}
ITERATION_RE = re.compile(r" iteration\s+(\d+)/")


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", list(LOADS))
def test_a_damaged_checkpoint_stops_every_rank_with_one_line(saved, tmp_path, case):
    damage, starts, flags, nproc = LOADS[case]
    root = _damaged_copy(saved, tmp_path, damage)
    codes, out, err = run_ranks([*PP2, "--train-iters", "4", "--load", root, *flags], nproc=nproc)
    assert codes == [2] * nproc, err[-3000:]
    (line,) = ERROR_RE.findall(err)  # one line: every rank agreed on it, rank 0 says it
    assert line.startswith("megatron_dpp: error: " + starts.format(root=root)), line
    assert "Traceback" not in err and not ITERATION_RE.search(out), err[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_load_of_an_iteration_folder_loads_that_iteration(saved):
    folder = os.path.join(saved, "iter_0000001")  # not the latest
    codes, out, err = run_ranks([*PP2, "--train-iters", "2", "--load", folder])
    assert codes == [0, 0], err[-3000:]
    assert f" loaded checkpoint from {folder} at iteration 1" in out, out[-3000:]
    assert ITERATION_RE.findall(out) == ["2"], out[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_checkpoint_saved_before_checksums_loads_with_a_warning(saved, tmp_path):
    root = _damaged_copy(saved, tmp_path, _strip_checksums)
    codes, out, err = run_ranks([*PP2, "--train-iters", "3", "--load", root])
    assert codes == [0, 0], err[-3000:]
    warnings = re.findall(r"^megatron_dpp: warning: .*$", err, re.MULTILINE)
    assert warnings == [f"megatron_dpp: warning: checkpoint {root}/iter_0000002 has no "
                        f"{MANIFEST_FILE} (saved before checksums were recorded, or by "
                        f"Megatron-LM): no checksums recorded; not verified"], err[-3000:]
    assert ITERATION_RE.findall(out) == ["3"], out[-3000:]
