"""Checkpoints that resume the exact loss trajectory: save_checkpoint / find_checkpoint +
load_checkpoint.

Two formats (--ckpt-format), both in Megatron-LM's layout SAVE/iter_NNNNNNN/ plus
SAVE/latest_checkpointed_iteration.txt:

- torch_dist (default): Megatron-Core's distributed checkpoint (training/checkpoint/torch_dist.py).
  Megatron-LM reads it, and it resumes at another tensor/pipeline/virtual-pipeline layout, with
  or without --use-dpp.
- torch: this project's earlier per-rank files, iter_NNNNNNN/rank_RRRRR.pt (one per global rank:
  its model chunks, optimizer state including a distributed optimizer's shard, LR scheduler, RNG
  states, iteration, consumed samples). Resumes only at the layout that saved it (stage placement
  included: a rank's chunks are other stages on another one); at another one
  the load is refused in one line saying how to convert it (resume once at its layout with
  --save: the default format is torch_dist).

Both formats save through one transaction (save_checkpoint), every step agreed by all ranks so
that a failure on one rank ends the save on every rank at once:
  1. room: every rank's estimate of its bytes (tensors plus a margin) against the free space of
     --save; too little and nothing is written;
  2. rank 0 makes SAVE/iter_NNNNNNN.saving/, every rank writes its files into it;
  3. checksums: each rank's files (training/checkpoint/integrity.py), into the folder's manifest
     checksums.json (rank 0);
  4. rank 0 publishes: .saving -> iter_NNNNNNN, then the tracker.
Any failure (a full disk, errno 28...) removes the .saving folder and raises CheckpointSaveError,
the same one line on every rank; the tracker still names the previous checkpoint, complete.

Loading is in two steps: find_checkpoint (collective, before the model is built: --load resolved,
every file checked against the manifest) and load_checkpoint (the state into the model,
optimizer, scheduler and RNGs; it tells the formats apart by their files). A checkpoint that
cannot be loaded raises CheckpointLoadError: one line saying what and where, the same on every
rank (the training loop exits with code 2).
"""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dpp.mcore import distributed_optimizer
from megatron_dpp.parallel.split import PipelineSplit
from megatron_dpp.pipeline.placement import INTERLEAVED
from megatron_dpp.training.checkpoint import scheduler_state
from megatron_dpp.training.checkpoint.flags import (
    CHECKPOINT_FORMATS,
    TRACKER_FILE,
    LoadScope,
    iteration_folders,
    iteration_of_folder,
    no_checkpoint_words,
    same_directory,
)
from megatron_dpp.training.checkpoint.integrity import (
    MANIFEST_FILE,
    SAVED_WITH_CHECKSUMS,
    CheckpointDamaged,
    bytes_needed,
    check_file,
    check_listing,
    checkpoint_files,
    file_entry,
    free_bytes,
    missing_manifest,
    owner_rank,
    read_manifest,
    save_with_checksum,
    space_problem,
    tensor_bytes,
    unverified_warning,
    write_manifest,
)
from megatron_dpp.stage_placement import job_placement_name
from megatron_dpp.training.checkpoint.torch_dist import (
    OLD_FORMAT_CONVERTER,
    CheckpointLoadError,
    CheckpointSaveError,
    _debug_traceback,
    _one_line,
    agree,
    checkpoint_format,
    iteration_dir,
    load_dist_checkpoint,
    read_tracker,
    prepare_dist_checkpoint,
    RngKeys,
    rng_state,
    set_rng_state,
)

__all__ = ["TrainState", "CheckpointToLoad", "CheckpointLoadError", "CheckpointSaveError",
           "save_checkpoint", "find_checkpoint", "load_checkpoint", "remove_unfinished_saves",
           "TRACKER_FILE"]

SAVING_SUFFIX = ".saving"  # the folder a save writes into, renamed once complete
REPLACED_SUFFIX = ".replaced"  # a re-saved iteration's previous folder, until the tracker moved


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    # The validation samples the interval evaluations have read (Megatron-LM's
    # args.consumed_valid_samples): a resumed run's validation stream goes on from there.
    consumed_valid_samples: int = 0


@dataclass(frozen=True)
class CheckpointToLoad:
    directory: str  # the iteration folder
    verified: bool  # its files matched its manifest; False: it has none (saved before checksums)


def _layout(model_chunks) -> dict[str, int | str | None]:
    """What the per-rank format must find again to load: the parallel sizes, when a flag made
    it uneven the pipeline split (absent for the default even split, as in files saved before
    the split flags), and a stage placement other than the interleaved one."""
    layout = {
        "world_size": dist.get_world_size(),
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size":
            parallel_state.get_virtual_pipeline_model_parallel_world_size(),
    }
    split = PipelineSplit.from_config(model_chunks[0].config)
    if not split.is_default:
        layout["pipeline_split"] = split.describe()
    # A rank's chunks are other stages on another placement; absent for the interleaved one, as
    # in files saved before --dpp-stage-placement.
    if job_placement_name() != INTERLEAVED:
        layout["stage_placement"] = job_placement_name()
    return layout


# The per-rank format's names for the RNG states (torch_dist.py's rng_state captures them).
PER_RANK_RNG_KEYS = RngKeys(python="python", numpy="numpy", torch="torch", tracker="tracker",
                            cuda="cuda")


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _optimizer_state(optimizer) -> list[dict]:
    states = []
    for sub in _sub_optimizers(optimizer):
        entry = {"state_dict": sub.state_dict()}
        if hasattr(sub, "get_parameter_state_dp_reshardable"):
            # A distributed optimizer keeps its shard of Adam state outside state_dict().
            entry["param_state"] = sub.get_parameter_state_dp_reshardable()
        states.append(entry)
    return states


def _load_optimizer_state(optimizer, states: list[dict]) -> None:
    subs = _sub_optimizers(optimizer)
    if len(subs) != len(states):
        raise CheckpointLoadError(f"checkpoint has {len(states)} optimizers, the model has {len(subs)}")
    for sub, entry in zip(subs, states):
        sub.load_state_dict(entry["state_dict"])
        if "param_state" in entry:
            with torch.no_grad():  # in fp32 the main parameters are views of the model's
                sub.load_parameter_state_from_dp_reshardable(
                    distributed_optimizer.flagged_unpadded(entry["param_state"]))
    distributed_optimizer.after_load(optimizer)


def _rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _gather(value) -> list:
    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


# ----------------------------------------------------------------------------------------------
# save: one transaction for both formats
# ----------------------------------------------------------------------------------------------
def save_checkpoint(root: str, state: TrainState, model_chunks, optimizer, scheduler,
                    args=None, ckpt_format: str = "torch_dist") -> str:
    """Collective; returns the iteration directory. Raises CheckpointSaveError when it failed on
    some rank (the tracker still names the previous checkpoint, which stays loadable)."""
    if ckpt_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"unknown checkpoint format {ckpt_format!r}")
    if ckpt_format == "torch_dist":
        def prepare():
            size, write = prepare_dist_checkpoint(
                state.iteration, state.consumed_samples, model_chunks, optimizer, scheduler, args,
                consumed_valid_samples=state.consumed_valid_samples)

            def write_dist(directory: str) -> dict:
                write(directory)
                return {}  # checksummed once written (Megatron-Core writes the files)
            return size, write_dist
    else:
        def prepare():
            return _prepare_torch(state, model_chunks, optimizer, scheduler)
    return _save_atomically(root, state.iteration, prepare)


def _save_atomically(root: str, iteration: int, prepare) -> str:
    """Collective: the save transaction (module docstring). prepare() gathers this rank's state
    and returns (the bytes of its tensors, write); write(directory) writes this rank's files into
    the staging directory and returns the checksums it computed on the way ({name: entry}; the
    other files of this rank's share are read back)."""
    rank = dist.get_rank()
    final = iteration_dir(root, iteration)
    staging = final + SAVING_SUFFIX
    write, error = _room_problem(root, staging, prepare)
    if error is None:
        error = agree(_make_staging(root, staging) if rank == 0 else None)
    if error is None:
        written, error = _write_part(write, staging)
        error = agree(error)
    if error is None:
        entries, error = _checksum_share(staging, written)
    if error is None:
        error = agree(_finish(root, iteration, staging, entries) if rank == 0 else None)
    if error is not None:
        if rank == 0:
            _rmtree(staging)  # give the space back; the previous checkpoint stays the latest
        dist.barrier()
        raise CheckpointSaveError(f"saving the checkpoint of iteration {iteration} to {root} "
                                  f"failed ({error}); {_latest_words(root)}")
    return final


def remove_unfinished_saves(root: str | None) -> tuple[list[str], list[str]]:
    """Rank 0, at start: the iter_N.saving folders a save left in `root` (--save) when a rank died
    during it (its survivors could not remove it). Returns (the folders removed, one line for each
    that could not be: path and reason). The published checkpoints and the tracker are untouched;
    a save of the same iteration would otherwise find its staging folder taken."""
    if not root or not os.path.isdir(root):
        return [], []
    removed, problems = [], []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not (name.startswith("iter_") and name.endswith(SAVING_SUFFIX)) or \
                not os.path.isdir(path):
            continue
        try:
            shutil.rmtree(path)
            removed.append(name)
        except OSError as exc:
            problems.append(_os_error_words(exc, path))
    return removed, problems


def _room_problem(root: str, staging: str, prepare) -> tuple:
    """Collective: (write, None) when every rank gathered its state and all their bytes fit in
    the free space (the least any rank sees: --save is one filesystem shared by the ranks, as the
    formats need); else (None, the problem)."""
    if dist.get_rank() == 0:
        _rmtree(staging)  # an earlier save's leftovers (it crashed) are not in the way
    write = error = None
    needed = free = 0
    try:
        tensors, write = prepare()
        needed = bytes_needed(tensors)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        _debug_traceback()
        error = f"rank {dist.get_rank()} could not gather its state: {_one_line(exc)}"
    if error is None:
        try:
            free = free_bytes(root)
        except OSError as exc:
            error = f"cannot measure the free space of {root}: {_one_line(exc)}"
    reports = _gather((needed, free, error))
    error = next((problem for _needed, _free, problem in reports if problem), None)
    if error is None:
        error = space_problem(root, sum(r[0] for r in reports), min(r[1] for r in reports))
    return (write, None) if error is None else (None, error)


def _make_staging(root: str, staging: str) -> str | None:
    try:
        os.makedirs(root, exist_ok=True)
        os.makedirs(staging)
    except OSError as exc:
        return f"cannot create {staging}: {_os_error_words(exc, staging)}"
    return None


def _write_part(write, staging: str) -> tuple[dict, str | None]:
    try:
        return write(staging), None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # torch.distributed.checkpoint's CheckpointException too
        _debug_traceback()
        return {}, f"rank {dist.get_rank()} could not write {_os_error_words(exc, staging)}"


def _checksum_share(staging: str, written: dict) -> tuple[dict, str | None]:
    """Collective: this rank's files not checksummed while written are read back; every rank
    gets all entries."""
    rank, world = dist.get_rank(), dist.get_world_size()
    entries, error = dict(written), None
    try:
        for name in checkpoint_files(staging):
            if owner_rank(name, world) == rank and name not in entries:
                entries[name] = file_entry(os.path.join(staging, name))
    except OSError as exc:
        error = f"rank {rank} could not read back {_os_error_words(exc, staging)}"
    reports = _gather((entries, error))
    merged: dict = {}
    for part, _error in reports:
        merged.update(part)
    return merged, next((problem for _entries, problem in reports if problem), None)


def _finish(root: str, iteration: int, staging: str, entries: dict) -> str | None:
    """Rank 0: the manifest into the staging folder, then the folder published."""
    try:
        write_manifest(staging, entries)
        _publish(root, iteration)
    except OSError as exc:
        return f"could not publish it: {_os_error_words(exc, staging)}"
    return None


def _publish(root: str, iteration: int) -> None:
    """iter_N.saving -> iter_N (a previous iter_N aside until the tracker moved), then the
    tracker. The tracker's new content is written first, the one step that needs space; then
    each step is a rename, and a crash leaves the tracker on a complete checkpoint."""
    final = iteration_dir(root, iteration)
    staging, replaced = final + SAVING_SUFFIX, final + REPLACED_SUFFIX
    tracker = os.path.join(root, TRACKER_FILE)
    _write_synced(tracker + ".tmp", f"{iteration}\n")
    _rmtree(replaced)
    moved_aside = os.path.exists(final)
    try:
        if moved_aside:
            os.replace(final, replaced)
        os.replace(staging, final)
    except OSError:
        if moved_aside and not os.path.exists(final):
            os.replace(replaced, final)
        _remove(tracker + ".tmp")
        raise
    _fsync_dir(root)
    os.replace(tracker + ".tmp", tracker)
    _fsync_dir(root)
    _rmtree(replaced)


def _write_synced(path: str, text: str) -> None:
    try:
        with open(path, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError:
        _remove(path)  # a full disk leaves no half-written temporary file
        raise


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _rmtree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _os_error_words(error: BaseException, where: str) -> str:
    """'PATH: [Errno N] reason' from the OSError behind `error` (torch.distributed.checkpoint
    wraps each rank's); `where` when it names no file."""
    found = _os_error_in(error, depth=0)
    if found is None:
        return f"{where}: {_one_line(error)}"
    return f"{found.filename or where}: [Errno {found.errno}] {found.strerror}"


def _os_error_in(error, depth: int) -> OSError | None:
    if isinstance(error, OSError) and error.errno is not None:
        return error
    if not isinstance(error, BaseException) or depth > 8:
        return None
    inner = list((getattr(error, "failures", None) or {}).values())
    inner = [item[0] if isinstance(item, tuple) else item for item in inner]
    for candidate in [*inner, error.__cause__, error.__context__]:
        found = _os_error_in(candidate, depth + 1)
        if found is not None:
            return found
    return None


def _latest_words(root: str) -> str:
    try:
        latest = read_tracker(root)
    except CheckpointLoadError:
        latest = None
    return ("no checkpoint there is marked latest" if latest is None else
            f"the latest checkpoint there is still iteration {latest}")


def _prepare_torch(state: TrainState, model_chunks, optimizer, scheduler) -> tuple:
    """This rank's rank_RRRRR.pt: (the bytes of its tensors, write), checksummed as written."""
    payload = {
        "iteration": state.iteration,
        "consumed_samples": state.consumed_samples,
        "consumed_valid_samples": state.consumed_valid_samples,
        "layout": _layout(model_chunks),
        "model": [chunk.state_dict() for chunk in model_chunks],
        "optimizer": _optimizer_state(optimizer),
        "scheduler": scheduler.state_dict(),
        scheduler_state.SAMPLES_MARKER: True,
        "rng": rng_state(PER_RANK_RNG_KEYS),
        SAVED_WITH_CHECKSUMS: MANIFEST_FILE,
    }
    name = _rank_file_name(dist.get_rank())

    def write(directory: str) -> dict:
        return {name: save_with_checksum(payload, os.path.join(directory, name))}
    return tensor_bytes(payload), write


# ----------------------------------------------------------------------------------------------
# load: find and verify (before the model is built), then load
# ----------------------------------------------------------------------------------------------
def find_checkpoint(load: str, save: str | None = None) -> CheckpointToLoad | None:
    """Collective: the iteration folder --load names (an iteration folder itself, or the
    tracker's), every file checked against its manifest, each rank its share. None: --load holds
    no checkpoint yet and is also --save (start from scratch). Raises CheckpointLoadError (the
    same one line on every rank)."""
    directory = error = None
    try:
        directory = _directory_to_load(load, save)
    except CheckpointLoadError as exc:
        error = str(exc)
    error = agree(error)
    if error is not None:
        raise CheckpointLoadError(error)
    if directory is None:
        return None
    return CheckpointToLoad(directory, _verify(directory))


def _directory_to_load(load: str, save: str | None) -> str | None:
    if iteration_of_folder(load) is not None:
        return load
    iteration = read_tracker(load)
    if iteration is None:
        folders = iteration_folders(load)
        if folders:
            raise CheckpointLoadError(
                f"--load {load} has iteration folders ({', '.join(folders[-3:])}) but no "
                f"{TRACKER_FILE}; name the one to load: --load {os.path.join(load, folders[-1])}")
        if same_directory(load, save):
            return None
        raise CheckpointLoadError(no_checkpoint_words(load))
    directory = iteration_dir(load, iteration)
    if not os.path.isdir(directory):
        raise CheckpointLoadError(f"checkpoint file {os.path.join(load, TRACKER_FILE)} names "
                                  f"iteration {iteration}, but {directory} does not exist")
    return directory


def _verify(directory: str) -> bool:
    """Collective: True when every file matched the manifest, False when there is none."""
    recorded = error = None
    try:
        recorded = read_manifest(directory)
        if recorded is not None:
            check_listing(directory, recorded)
            rank, world = dist.get_rank(), dist.get_world_size()
            for name, entry in sorted(recorded.items()):
                if owner_rank(name, world) == rank:
                    check_file(directory, name, entry)
    except CheckpointDamaged as exc:
        error = str(exc)
    except OSError as exc:  # the folder itself cannot be listed
        error = f"checkpoint {directory} cannot be read: {_os_error_words(exc, directory)}"
    error = agree(error)
    if error is not None:
        raise CheckpointLoadError(error)
    return recorded is not None


def load_checkpoint(checkpoint: CheckpointToLoad, model_chunks, optimizer,
                    scheduler, scope: LoadScope = LoadScope()) -> TrainState:
    """Collective: restore the model, and what `scope` asks for, from the folder find_checkpoint
    returned; without scope.position the state is iteration 0 (--finetune). Raises
    CheckpointLoadError (one line, the same on every rank)."""
    directory = checkpoint.directory
    fmt = checkpoint_format(directory)
    if fmt == "torch_dist":
        loaded = load_dist_checkpoint(directory, model_chunks, optimizer, scheduler,
                                      checkpoint.verified, scope)
        state = TrainState(iteration=loaded.iteration, consumed_samples=loaded.consumed_samples,
                           consumed_valid_samples=loaded.consumed_valid_samples)
    elif fmt == "torch":
        state = _load_torch(directory, checkpoint.verified, model_chunks, optimizer, scheduler,
                            scope)
    elif fmt == "megatron_torch":
        raise CheckpointLoadError(f"{directory} is in Megatron-LM's legacy 'torch' format "
                                  f"(mp_rank_*); convert it to torch_dist with Megatron-LM first")
    else:
        raise CheckpointLoadError(f"checkpoint {directory} is damaged: it has neither "
                                  f"Megatron-Core's metadata.json nor per-rank rank_RRRRR.pt files")
    if not checkpoint.verified and dist.get_rank() == 0:
        print(f"megatron_dpp: warning: {unverified_warning(directory)}", file=sys.stderr,
              flush=True)
    return state if scope.position else TrainState()


def _load_torch(directory: str, verified: bool, model_chunks, optimizer,
                scheduler, scope: LoadScope) -> TrainState:
    """Our per-rank format, at the layout that saved it only."""
    path = os.path.join(directory, _rank_file_name(dist.get_rank()))
    error = payload = None
    if not os.path.isfile(path):
        error = (f"{path} is missing: the checkpoint was saved with another number of ranks; "
                 f"to load it at another layout, convert it: {OLD_FORMAT_CONVERTER}")
    else:
        try:
            payload = torch.load(path, map_location="cpu", weights_only=False)
            if not verified and payload.get(SAVED_WITH_CHECKSUMS):
                error = missing_manifest(directory)
            elif payload["layout"] != _layout(model_chunks):
                error = (f"checkpoint {path} (old per-rank format) was saved at layout "
                         f"{_short(payload['layout'])}, this run is "
                         f"{_short(_layout(model_chunks))}; to load "
                         f"it here, convert it: {OLD_FORMAT_CONVERTER}")
        except Exception as exc:  # an unverified checkpoint's truncated or overwritten file
            error = f"checkpoint file {path} is damaged: {_one_line(exc)}"
    converted = None
    if error is None and scope.optimizer:
        try:
            schedule, converted = scheduler_state.state_in_samples(
                payload["scheduler"], payload.get(scheduler_state.SAMPLES_MARKER, False),
                payload["iteration"], payload["consumed_samples"])
            difference = scheduler.schedule_difference(schedule)
            if difference is not None:
                error = f"checkpoint {directory}: {difference}"
        except Exception as exc:
            error = f"checkpoint {path}: {_one_line(exc)}"
    error = agree(error)
    if error is None:
        try:
            for chunk, chunk_state in zip(model_chunks, payload["model"], strict=True):
                chunk.load_state_dict(chunk_state)
            if scope.optimizer:
                _load_optimizer_state(optimizer, payload["optimizer"])
                scheduler.load_state_dict(schedule)
            else:  # fp32 main parameters (bf16/fp16) from the loaded model, as Megatron-LM
                optimizer.reload_model_params()
            if scope.rng:
                set_rng_state(payload["rng"], PER_RANK_RNG_KEYS)
        except Exception as exc:
            error = f"checkpoint {path} does not fit this model: {_one_line(exc)}"
        error = agree(error)
    if error is not None:
        raise CheckpointLoadError(error)
    if converted is not None and dist.get_rank() == 0:
        print(f"megatron_dpp: checkpoint {directory}: {converted}", flush=True)
    return TrainState(iteration=payload["iteration"],
                      consumed_samples=payload["consumed_samples"],
                      # 0 in a checkpoint saved before it was kept: the loop's fallback then
                      consumed_valid_samples=payload.get("consumed_valid_samples", 0))


def _short(layout: dict) -> str:
    return (f"world {layout['world_size']}, tp {layout['tensor_model_parallel_size']}, pp "
            f"{layout['pipeline_model_parallel_size']}, vpp "
            f"{layout['virtual_pipeline_model_parallel_size']}, layers per pipeline rank "
            f"{layout.get('pipeline_split', 'even')}, stage placement "
            f"{layout.get('stage_placement', INTERLEAVED)}")
