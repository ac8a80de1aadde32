"""Per-rank checkpoints that resume the exact loss trajectory.

Layout: SAVE/iter_NNNNNNN/rank_RRRRR.pt (one file per global rank: its model chunks, optimizer
state including a distributed optimizer's shard, LR scheduler, RNG states, iteration, consumed
samples) and SAVE/latest_checkpointed_iteration.txt, written by rank 0 once every rank's file is on
disk. Resuming needs the same parallel layout as saving (checked, with a one-line error).
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

TRACKER_FILE = "latest_checkpointed_iteration.txt"


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0


class CheckpointError(RuntimeError):
    pass


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
        raise CheckpointError(f"checkpoint has {len(states)} optimizers, the model has {len(subs)}")
    for sub, entry in zip(subs, states):
        sub.load_state_dict(entry["state_dict"])
        if "param_state" in entry:
            sub.load_parameter_state_from_dp_reshardable(entry["param_state"])


def _iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _rank_file(root: str, iteration: int, rank: int) -> str:
    return os.path.join(_iteration_dir(root, iteration), f"rank_{rank:05d}.pt")


def save_checkpoint(root: str, state: TrainState, model_chunks, optimizer, scheduler) -> str:
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
    torch.save(payload, path + ".tmp")
    os.replace(path + ".tmp", path)
    dist.barrier()
    if rank == 0:
        tracker = os.path.join(root, TRACKER_FILE)
        with open(tracker + ".tmp", "w") as handle:
            handle.write(f"{state.iteration}\n")
        os.replace(tracker + ".tmp", tracker)
    dist.barrier()
    return _iteration_dir(root, state.iteration)


def latest_iteration(root: str) -> int | None:
    tracker = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(tracker):
        return None
    with open(tracker) as handle:
        return int(handle.read().strip())


def load_checkpoint(root: str, model_chunks, optimizer, scheduler) -> TrainState | None:
    """Restore everything saved; None when `root` holds no checkpoint yet (start from scratch)."""
    iteration = latest_iteration(root)
    if iteration is None:
        return None
    path = _rank_file(root, iteration, dist.get_rank())
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing; was the checkpoint saved with "
                              f"{dist.get_world_size()} ranks?")
    payload = torch.load(path, map_location="cpu", weights_only=False)
    if payload["layout"] != _layout():
        raise CheckpointError(f"checkpoint layout {payload['layout']} differs from this run's "
                              f"{_layout()}; resume with the same parallel sizes")
    for chunk, chunk_state in zip(model_chunks, payload["model"], strict=True):
        chunk.load_state_dict(chunk_state)
    _load_optimizer_state(optimizer, payload["optimizer"])
    scheduler.load_state_dict(payload["scheduler"])
    _set_rng_state(payload["rng"])
    return TrainState(iteration=payload["iteration"],
                      consumed_samples=payload["consumed_samples"])
