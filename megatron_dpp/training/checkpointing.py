"""Checkpoints that resume the exact loss trajectory: save_checkpoint / load_checkpoint.

Two formats (--ckpt-format), both in Megatron-LM's layout SAVE/iter_NNNNNNN/ plus
SAVE/latest_checkpointed_iteration.txt (written once every rank's part is on disk):

- torch_dist (default): Megatron-Core's distributed checkpoint (training/dist_checkpoint.py).
  Megatron-LM reads it, and it resumes at another tensor/pipeline/virtual-pipeline layout, with
  or without --use-dpp.
- torch: this project's earlier per-rank files, iter_NNNNNNN/rank_RRRRR.pt (one per global rank:
  its model chunks, optimizer state including a distributed optimizer's shard, LR scheduler, RNG
  states, iteration, consumed samples). Resumes only at the layout that saved it; at another one
  the load is refused in one line saying how to convert it (resume once at its layout with
  --save: the default format is torch_dist).

load_checkpoint tells the formats apart by their files. A checkpoint that cannot be loaded
(damaged, another model, another layout for the old format) raises CheckpointLoadError: one line
saying what and where, the same on every rank (the training loop exits with code 2).
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megatron_dpp.training.dist_checkpoint import (
    OLD_FORMAT_CONVERTER,
    TRACKER_FILE,
    CheckpointLoadError,
    CheckpointSaveError,
    checkpoint_format,
    load_dist_checkpoint,
    read_tracker,
    save_dist_checkpoint,
)

__all__ = ["TrainState", "CheckpointError", "CheckpointLoadError", "CheckpointSaveError",
           "save_checkpoint", "load_checkpoint", "latest_iteration", "TRACKER_FILE"]


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0


# The old name: what a refused or damaged checkpoint raises.
CheckpointError = CheckpointLoadError


def _layout() -> dict[str, int | None]:
    return {
        "world_size": dist.get_world_size(),
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size":
            parallel_state.get_virtual_pipeline_model_parallel_world_size(),
    }


def _rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


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
            sub.load_parameter_state_from_dp_reshardable(entry["param_state"])


def _iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _rank_file(root: str, iteration: int, rank: int) -> str:
    return os.path.join(_iteration_dir(root, iteration), f"rank_{rank:05d}.pt")


def save_checkpoint(root: str, state: TrainState, model_chunks, optimizer, scheduler,
                    args=None, ckpt_format: str = "torch_dist") -> str:
    """Collective; returns the iteration directory. Raises CheckpointSaveError when a rank failed
    (the tracker still names the previous checkpoint, which stays loadable)."""
    if ckpt_format == "torch_dist":
        return save_dist_checkpoint(root, state.iteration, state.consumed_samples, model_chunks,
                                    optimizer, scheduler, args)
    if ckpt_format != "torch":
        raise ValueError(f"unknown checkpoint format {ckpt_format!r}")
    return _save_torch(root, state, model_chunks, optimizer, scheduler)


def _save_torch(root: str, state: TrainState, model_chunks, optimizer, scheduler) -> str:
    """Collective: every rank writes its file, then rank 0 moves the tracker to this iteration."""
    rank = dist.get_rank()
    os.makedirs(_iteration_dir(root, state.iteration), exist_ok=True)
    payload = {
        "iteration": state.iteration,
        "consumed_samples": state.consumed_samples,
        "layout": _layout(),
        "model": [chunk.state_dict() for chunk in model_chunks],
        "optimizer": _optimizer_state(optimizer),
        "scheduler": scheduler.state_dict(),
        "rng": _rng_state(),
    }
    path = _rank_file(root, state.iteration, rank)
    error = None
    try:
        torch.save(payload, path + ".tmp")
        os.replace(path + ".tmp", path)
    except OSError as exc:
        error = f"rank {rank}: {exc}"
    error = _agree(error)
    if error is None and rank == 0:
        try:
            tracker = os.path.join(root, TRACKER_FILE)
            with open(tracker + ".tmp", "w") as handle:
                handle.write(f"{state.iteration}\n")
            os.replace(tracker + ".tmp", tracker)
        except OSError as exc:
            error = f"tracker: {exc}"
    error = _agree(error)
    if error is not None:
        raise CheckpointSaveError(f"saving the checkpoint of iteration {state.iteration} to "
                                  f"{root} failed ({' '.join(error.split())})")
    return _iteration_dir(root, state.iteration)


def _agree(message):
    messages: list = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    return next((m for m in messages if m), None)


def latest_iteration(root: str) -> int | None:
    return read_tracker(root)


def load_checkpoint(root: str, model_chunks, optimizer, scheduler) -> TrainState | None:
    """Collective: restore everything saved; None when `root` holds no checkpoint yet (start from
    scratch). Raises CheckpointLoadError (one line, the same on every rank)."""
    iteration = read_tracker(root)
    if iteration is None:
        return None
    directory = _iteration_dir(root, iteration)
    if not os.path.isdir(directory):
        raise CheckpointLoadError(f"{os.path.join(root, TRACKER_FILE)} names iteration "
                                  f"{iteration} but {directory} does not exist")
    fmt = checkpoint_format(directory)
    if fmt == "torch_dist":
        loaded = load_dist_checkpoint(directory, model_chunks, optimizer, scheduler)
        return TrainState(iteration=loaded.iteration, consumed_samples=loaded.consumed_samples)
    if fmt == "torch":
        return _load_torch(root, iteration, model_chunks, optimizer, scheduler)
    if fmt == "megatron_torch":
        raise CheckpointLoadError(f"{directory} is in Megatron-LM's legacy 'torch' format "
                                  f"(mp_rank_*); convert it to torch_dist with Megatron-LM first")
    raise CheckpointLoadError(f"checkpoint {directory} is damaged: it has neither Megatron-Core's "
                              f"metadata.json nor per-rank rank_RRRRR.pt files")


def _load_torch(root: str, iteration: int, model_chunks, optimizer, scheduler) -> TrainState:
    """Our per-rank format, at the layout that saved it only."""
    path = _rank_file(root, iteration, dist.get_rank())
    error = payload = None
    if not os.path.isfile(path):
        error = (f"{path} is missing: the checkpoint was saved with another number of ranks; "
                 f"to load it at another layout, convert it: {OLD_FORMAT_CONVERTER}")
    else:
        try:
            payload = torch.load(path, map_location="cpu", weights_only=False)
            if payload["layout"] != _layout():
                error = (f"checkpoint {path} (old per-rank format) was saved at layout "
                         f"{_short(payload['layout'])}, this run is {_short(_layout())}; to load "
                         f"it here, convert it: {OLD_FORMAT_CONVERTER}")
        except Exception as exc:  # truncated or overwritten file
            error = f"checkpoint {path} is damaged: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    error = _agree(error)
    if error is None:
        try:
            for chunk, chunk_state in zip(model_chunks, payload["model"], strict=True):
                chunk.load_state_dict(chunk_state)
            _load_optimizer_state(optimizer, payload["optimizer"])
            scheduler.load_state_dict(payload["scheduler"])
            _set_rng_state(payload["rng"])
        except Exception as exc:
            error = (f"checkpoint {path} does not fit this model: {type(exc).__name__}: "
                     f"{' '.join(str(exc).split())[:200]}")
        error = _agree(error)
    if error is not None:
        raise CheckpointLoadError(error)
    return TrainState(iteration=payload["iteration"],
                      consumed_samples=payload["consumed_samples"])


def _short(layout: dict) -> str:
    return (f"world {layout['world_size']}, tp {layout['tensor_model_parallel_size']}, pp "
            f"{layout['pipeline_model_parallel_size']}, vpp "
            f"{layout['virtual_pipeline_model_parallel_size']}")
