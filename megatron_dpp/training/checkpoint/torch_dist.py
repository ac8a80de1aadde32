"""Checkpoints in Megatron-Core's distributed format (megatron.core.dist_checkpointing, torch_dist).

Layout, as Megatron-LM's: SAVE/iter_NNNNNNN/ (Megatron-Core's files: metadata.json, common.pt,
the torch_dist shards *.distcp and .metadata) and SAVE/latest_checkpointed_iteration.txt. The
state dict is Megatron-LM's (checkpoint_version 3.0): `model` (one chunk) or `model0`, `model1`...
(one per virtual-pipeline chunk), `optimizer`, `opt_param_scheduler`, `rng_state`, `iteration`,
`args` (with consumed_train_samples and consumed_valid_samples, the data positions), so
Megatron-LM's loader reads it.

Every tensor is stored under its global name and shape (a GPTModel/BertModel chunk's sharded state
dict carries its global layer offsets), so a checkpoint saved at one tensor/pipeline/virtual-pipeline
layout loads at another, with or without --use-dpp (DPP runs the same chunks). The RNG states are
per (pipeline, tensor) rank and are restored only at the layout that saved them (its tensor and
pipeline sizes and its stage placement). The model's keys `model0`, `model1`... are a rank's local
chunks, which are other stages on another placement (--dpp-stage-placement v); the tensors in them
carry their global names, so a checkpoint of one placement loads at the other.

Saves are atomic and checksummed, as in both formats (save_load.py's save transaction): this
module writes the files into SAVE/iter_NNNNNNN.saving/; the transaction records their checksums
and publishes the folder. A load here comes after the transaction's checks of the files.
"""
from __future__ import annotations

import argparse
import os
import random
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megatron_dpp.mcore import distributed_optimizer
from megatron_dpp.mcore.checkpoint_writer import in_process_write_results
from megatron_dpp.parallel.layout import flags_and_layout
from megatron_dpp.pipeline.placement import INTERLEAVED
from megatron_dpp.training.checkpoint import scheduler_state
from megatron_dpp.training.checkpoint.flags import TRACKER_FILE, LoadScope
from megatron_dpp.stage_placement import (as_megatron_builds_chunk, job_placement,
                                                   job_placement_name)
from megatron_dpp.training.checkpoint.integrity import (MANIFEST_FILE, SAVED_WITH_CHECKSUMS,
                                                        missing_manifest)

CHECKPOINT_VERSION = 3.0  # Megatron-LM's
# How an old per-rank checkpoint becomes a torch_dist one: the training run itself converts it.
OLD_FORMAT_CONVERTER = ("resume it at the layout that saved it for one more iteration with --save "
                        "NEW_DIR (--ckpt-format torch_dist, the default), then load NEW_DIR")

# Megatron-Core modules of the save/load path that call torch.cuda (patched on CPU).
_CPU_PATCHED = (
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.validation",
)


class CheckpointLoadError(RuntimeError):
    """A checkpoint that cannot be loaded here: one line saying what and where (exit code 2)."""


class CheckpointSaveError(RuntimeError):
    """A save that failed on some rank; the tracker still names the previous checkpoint."""


@dataclass
class LoadedState:
    iteration: int
    consumed_samples: int
    consumed_valid_samples: int = 0  # 0: a checkpoint saved before it was kept (loop.py's fallback)


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _cpu_patches() -> None:
    """On CPU, Megatron-Core's torch.cuda calls of the save/load path (platform.py's patches)."""
    if not torch.cuda.is_available():
        from megatron_dpp.mcore.cpu_patches import apply_cpu_patches

        apply_cpu_patches(_CPU_PATCHED)


# ----------------------------------------------------------------------------------------------
# agreement: every rank learns the first failure of any rank, so all raise together (no hang)
# ----------------------------------------------------------------------------------------------
def agree(message: str | None) -> str | None:
    """Collective: the message of the lowest rank that has one, on every rank (None: none has)."""
    messages: list = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    return next((m for m in messages if m), None)


def _one_line(error: BaseException) -> str:
    failures = getattr(error, "failures", None)  # torch.distributed.checkpoint's, per rank
    if isinstance(failures, dict) and failures:
        ranks = sorted(failures)
        first = failures[ranks[0]]
        first = first[0] if isinstance(first, tuple) else first
        if isinstance(first, BaseException):
            where = "rank" if len(ranks) == 1 else "ranks"
            return f"{where} {', '.join(map(str, ranks))}: {_one_line(first)}"
    text = " ".join(str(error).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


# ----------------------------------------------------------------------------------------------
# the state dict
# ----------------------------------------------------------------------------------------------
def _layout() -> dict:
    return {
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "data_parallel_size": parallel_state.get_data_parallel_world_size(),
        "stage_placement": job_placement_name(),
    }


def _uses_distributed_optimizer(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(isinstance(sub, DistributedOptimizer) for sub in subs)


def sharded_sd_metadata(optimizer) -> dict:
    """Megatron-LM's content metadata: how the sharded state dict was built. The distributed
    optimizer's state is saved 'fully_reshardable' (per model parameter, like a plain optimizer's),
    so it too loads at another tensor/pipeline/data-parallel layout. optimizer None: a model-only
    checkpoint."""
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if optimizer is not None and _uses_distributed_optimizer(optimizer):
        metadata["distrib_optim_sharding_type"] = "fully_reshardable"
    return metadata


@dataclass(frozen=True)
class RngKeys:
    """The key each RNG state is stored under in one checkpoint format."""
    python: str
    numpy: str
    torch: str
    tracker: str
    cuda: str


# Megatron-LM's names, which its loader reads (save_load.py's per-rank format has its own).
MEGATRON_RNG_KEYS = RngKeys(python="random_rng_state", numpy="np_rng_state",
                            torch="torch_rng_state", tracker="rng_tracker_states",
                            cuda="cuda_rng_state")


def rng_state(keys: RngKeys) -> dict:
    """Python's, NumPy's, torch's and the model-parallel tracker's RNG states, and CUDA's where
    there is a GPU, under `keys`: one capture for both checkpoint formats, which differ only in
    the names they store the states under."""
    state = {
        keys.python: random.getstate(),
        keys.numpy: np.random.get_state(),
        keys.torch: torch.get_rng_state(),
        keys.tracker: tracker_states(),
    }
    if torch.cuda.is_available():
        state[keys.cuda] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict, keys: RngKeys) -> None:
    """Restores what rng_state(keys) saved (CUDA's only where this run has a GPU and the file
    has it)."""
    random.setstate(state[keys.python])
    np.random.set_state(state[keys.numpy])
    torch.set_rng_state(state[keys.torch])
    if torch.cuda.is_available() and keys.cuda in state:
        torch.cuda.set_rng_state(state[keys.cuda])
    set_tracker_states(state[keys.tracker])


def tracker_states() -> dict:
    """The model-parallel RNG tracker's states as byte tensors. With --cuda-graph-impl local the
    tracker is graph-safe and holds torch.Generator objects, which the captured graphs refer to:
    their states are saved, so that the file is the same with graphs or without."""
    return {name: state.get_state() if isinstance(state, torch.Generator) else state
            for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items()}


def set_tracker_states(saved: dict) -> None:
    """Restores what tracker_states saved. A graph-safe tracker's Generator objects get the saved
    states written into them (replacing them would leave the graphs on the old ones)."""
    tracker = tensor_parallel.get_cuda_rng_tracker()
    current = tracker.get_states()
    generators = {name: state for name, state in current.items()
                  if isinstance(state, torch.Generator)}
    if not generators:
        tracker.set_states(saved)
        return
    for name, state in saved.items():
        if name not in generators:
            raise CheckpointLoadError(
                f"the checkpoint's RNG tracker has a state {name!r} this run's does not "
                f"(it has {sorted(generators)})")
        generators[name].set_state(state)


def _sharded_rng_state():
    """Megatron-LM's: one object per (pipeline rank, tensor rank), data-parallel ranks replicas."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    return ShardedObject("rng_state", [rng_state(MEGATRON_RNG_KEYS)], (pp_size, tp_size),
                         (pp_rank, tp_rank), replica_id=parallel_state.get_data_parallel_rank())


def _model_key(index: int, count: int) -> str:
    return "model" if count == 1 else f"model{index}"


def unwrap(chunk):
    """The model chunk inside DistributedDataParallel and Float16Module (Megatron-LM's
    unwrap_model): its state dict keys carry no `module.` prefix."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    while isinstance(chunk, (DistributedDataParallel, Float16Module)):
        chunk = chunk.module
    return chunk


def _model_state_dict(model_chunks, metadata: dict) -> dict:
    """`model0`, `model1`... per local chunk, whichever stages they are (the tensors inside carry
    the global names). A chunk of another placement's stage is read as the rank Megatron-Core's
    placement gives that stage (its layer offsets with a layout string)."""
    state = {}
    for i, chunk in enumerate(model_chunks):
        with as_megatron_builds_chunk(i):
            state[_model_key(i, len(model_chunks))] = unwrap(chunk).sharded_state_dict(
                metadata=metadata)
    return state


def _args_for_checkpoint(args: argparse.Namespace | None, consumed_samples: int,
                         consumed_valid_samples: int = 0):
    """Megatron-LM keeps the run's args, the data positions among them (consumed_train_samples,
    consumed_valid_samples), and the derived parallel layout under Megatron-LM's names
    (data_parallel_size, virtual_pipeline_model_parallel_size, ...: args.parallel's fields)."""
    values = flags_and_layout(args or argparse.Namespace())
    saved = argparse.Namespace(**{k: v for k, v in values.items() if _picklable(v)})
    saved.consumed_train_samples = consumed_samples
    saved.consumed_valid_samples = consumed_valid_samples
    return saved


def _picklable(value) -> bool:
    return isinstance(value, (type(None), bool, int, float, str, list, tuple, dict))


def _state_dict(iteration: int, consumed_samples: int, args, model_chunks, optimizer, scheduler,
                metadata: dict, is_loading: bool, with_rng: bool = True,
                with_optimizer: bool = True, consumed_valid_samples: int = 0) -> dict:
    state = {"checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
             "consumed_samples": consumed_samples,
             "args": _args_for_checkpoint(args, consumed_samples, consumed_valid_samples),
             "megatron_dpp_layout": _layout()}
    state.update(_model_state_dict(model_chunks, metadata))
    if with_optimizer:
        distributed_optimizer.aligned_state_gather(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading,
                                                          metadata=metadata)
        state["opt_param_scheduler"] = scheduler.state_dict()
        state[scheduler_state.SAMPLES_MARKER] = True
    if with_rng:
        state["rng_state"] = _sharded_rng_state()
    return state


def _no_rank_differences(common: dict) -> dict:
    """What save compares across ranks for consistency: all of the common state but `args` (as
    Megatron-LM leaves its args out of that check)."""
    return {k: v for k, v in common.items() if k != "args"}


# ----------------------------------------------------------------------------------------------
# save (save_load.py's save transaction calls it: the staging folder, checksums, publishing)
# ----------------------------------------------------------------------------------------------
def prepare_dist_checkpoint(iteration: int, consumed_samples: int, model_chunks, optimizer,
                            scheduler, args=None, consumed_valid_samples: int = 0):
    """This rank's part of the checkpoint: (the bytes of tensors it will write, write), where
    write(directory) is the collective save into the (empty) `directory`; it raises what the write
    raised (torch.distributed.checkpoint's CheckpointException, an OSError...). optimizer and
    scheduler None: the model only, without RNG states (a converted checkpoint, which a run
    loads with --finetune)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    _cpu_patches()
    metadata = sharded_sd_metadata(optimizer)
    model_only = optimizer is None
    state = _state_dict(iteration, consumed_samples, args, model_chunks, optimizer, scheduler,
                        metadata, is_loading=False, with_rng=not model_only,
                        with_optimizer=not model_only,
                        consumed_valid_samples=consumed_valid_samples)
    state[SAVED_WITH_CHECKSUMS] = MANIFEST_FILE
    tied_copies_share_a_rank = _tied_copies_share_a_rank(model_chunks)

    def write(directory: str) -> None:
        strategy = get_default_save_sharded_strategy("torch_dist")
        if parallel_state.get_data_parallel_world_size() > 1 and not tied_copies_share_a_rank:
            # Data-parallel replicas split the writing, as Megatron-LM's
            # --ckpt-fully-parallel-save (its default).
            strategy = FullyParallelSaveStrategyWrapper(
                strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))
        with in_process_write_results():  # no Manager process per rank (mcore/checkpoint_writer.py)
            dist_checkpointing.save(state, directory, strategy, content_metadata=metadata,
                                    preprocess_common_before_consistancy_check=_no_rank_differences)

    return _main_replica_bytes(state), write


def _tied_copies_share_a_rank(model_chunks) -> bool:
    """Both copies of a tied word embedding on one rank (the v placement's rank 0), the same on
    every rank. Their tensors share the embedding's key, the output layer's as a replica; the
    fully parallel save makes every tensor of a key that a rank is to write its main replica, two
    of them there, and Megatron-Core's check of the save refuses that. Each data-parallel group's
    first rank then writes the replicas, as at one data-parallel rank."""
    tied = any(getattr(unwrap(chunk), "share_embeddings_and_output_weights", False)
               for chunk in model_chunks)
    placement = job_placement()
    holders = [placement.location(stage)[0] for stage in placement.embedding_stages(tied)]
    return len(set(holders)) < len(holders)


def _main_replica_bytes(state: dict) -> int:
    """Bytes of the tensors this rank holds the main replica of: summed over the ranks, the
    tensors a save writes (replicas are written once, whichever rank writes them)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (ShardedTensor, ShardedTensorFactory,
                                                          is_main_replica)

    return sum(item.data.nbytes for item in nested_values(state)
               if isinstance(item, (ShardedTensor, ShardedTensorFactory))
               and isinstance(item.data, torch.Tensor) and is_main_replica(item.replica_id))


# ----------------------------------------------------------------------------------------------
# load
# ----------------------------------------------------------------------------------------------
def read_tracker(root: str) -> int | None:
    tracker = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(tracker):
        return None
    try:
        with open(tracker) as handle:
            text = handle.read().strip()
    except OSError as exc:
        raise CheckpointLoadError(f"checkpoint file {tracker} cannot be read: "
                                  f"{_one_line(exc)}") from None
    if text == "release":
        raise CheckpointLoadError(f"{tracker}: 'release' checkpoints are not supported; name an "
                                  f"iteration")
    try:
        iteration = int(text)
    except ValueError:
        raise CheckpointLoadError(f"checkpoint file {tracker} is damaged: {text[:40]!r} is not "
                                  f"an iteration number") from None
    if iteration < 0:
        raise CheckpointLoadError(f"checkpoint file {tracker} is damaged: negative iteration "
                                  f"{iteration}")
    return iteration


def saved_args(directory: str) -> argparse.Namespace | None:
    """The args of the run that saved a torch_dist checkpoint (as Megatron-LM keeps them), None
    for another format or a common state without them."""
    from megatron.core import dist_checkpointing

    if checkpoint_format(directory) != "torch_dist":
        return None
    saved = dist_checkpointing.load_common_state_dict(directory).get("args")
    return saved if isinstance(saved, argparse.Namespace) else None


def checkpoint_format(directory: str) -> str | None:
    """'torch_dist' (Megatron-Core's metadata.json), 'torch' (our per-rank rank_RRRRR.pt files),
    or None (neither)."""
    if os.path.isfile(os.path.join(directory, "metadata.json")):
        return "torch_dist"
    try:
        names = os.listdir(directory)
    except OSError:
        return None
    if any(name.startswith("rank_") and name.endswith(".pt") for name in names):
        return "torch"
    if any(name.startswith("mp_rank_") for name in names):
        return "megatron_torch"
    return None


def _model_mismatch(run_state: dict, directory: str, tensors_metadata: dict) -> str | None:
    """The first model tensor of this run that the checkpoint lacks or holds at another shape."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for key in sorted(k for k in run_state if k.startswith("model")):
        for item in nested_values(run_state[key]):
            if isinstance(item, ShardedTensorFactory):
                name, shape = item.key, None
            elif isinstance(item, ShardedTensor):
                name, shape = item.key, tuple(item.global_shape)
            else:
                continue
            saved = tensors_metadata.get(name)
            if saved is None:
                if not any(k.startswith(name + ".") or k.startswith(name + "/")
                           for k in tensors_metadata):
                    return (f"checkpoint {directory} is of another model: it has no tensor "
                            f"{name!r}")
                continue
            saved_shape = tuple(getattr(saved, "global_shape", ()) or ())
            if shape is not None and saved_shape and saved_shape != shape:
                return (f"checkpoint {directory} is of another model: tensor {name!r} has shape "
                        f"{list(saved_shape)} there and {list(shape)} in this model")
    return None


def _debug_traceback() -> None:
    """MEGATRON_DPP_CHECKPOINT_DEBUG=1: the full traceback behind a one-line checkpoint error."""
    if os.environ.get("MEGATRON_DPP_CHECKPOINT_DEBUG"):
        import traceback

        traceback.print_exc()


@contextmanager
def _errors_as(prefix: str):
    try:
        yield
    except (CheckpointLoadError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # torch.distributed.checkpoint's CheckpointException too
        _debug_traceback()
        raise CheckpointLoadError(f"{prefix}: {_one_line(exc)}") from None


def load_dist_checkpoint(directory: str, model_chunks, optimizer, scheduler,
                         verified: bool, scope: LoadScope = LoadScope()) -> LoadedState:
    """Collective: restore a torch_dist checkpoint directory, at any layout: the model, and what
    `scope` asks for. verified: its files matched its manifest (False: it has none). Raises
    CheckpointLoadError (the same one line on every rank)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import (
        get_default_load_sharded_strategy,
        load_tensors_metadata,
    )

    _cpu_patches()
    # 1. Read-only checks every rank makes alone (same files, so the same verdict on each rank).
    common = metadata = tensors = None
    error = None
    try:
        with _errors_as(f"checkpoint {directory} is damaged (metadata.json/common.pt)"):
            common = dist_checkpointing.load_common_state_dict(directory)
            metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {}
        if not isinstance(common, dict) or "iteration" not in common:
            raise CheckpointLoadError(f"checkpoint {directory} is damaged: its common.pt holds no "
                                      f"iteration")
        if not verified and common.get(SAVED_WITH_CHECKSUMS):
            raise CheckpointLoadError(missing_manifest(directory))
        if "opt_param_scheduler" not in common and (scope.optimizer or scope.rng):
            # A converted checkpoint (tools/convert_hf_llama.py's, or Megatron-LM's converters').
            raise CheckpointLoadError(f"checkpoint {directory} holds the model only (no optimizer, "
                                      f"learning-rate schedule or RNG states, as a converted "
                                      f"checkpoint): load it with --finetune, or with "
                                      f"--no-load-optim --no-load-rng")
        consumed = _consumed_samples(common)
        schedule = converted = schedule_error = None
        if scope.optimizer:
            with _errors_as(f"checkpoint {directory}"):
                schedule, converted = scheduler_state.state_in_samples(
                    common["opt_param_scheduler"], _schedule_in_samples(common),
                    int(common["iteration"]), consumed, common.get("args"))
            difference = scheduler.schedule_difference(schedule)
            if difference is not None:  # said after the model's and the optimizer's problems
                schedule_error = f"checkpoint {directory}: {difference}"
        with _errors_as(f"checkpoint {directory} is damaged (.metadata)"):
            tensors = load_tensors_metadata(directory)
        run_metadata = sharded_sd_metadata(optimizer)
        if scope.optimizer and bool(metadata.get("distrib_optim_sharding_type")) != \
                bool(run_metadata.get("distrib_optim_sharding_type")):
            raise CheckpointLoadError(
                f"checkpoint {directory} was saved "
                f"{'with' if metadata.get('distrib_optim_sharding_type') else 'without'} "
                f"--use-distributed-optimizer; resume the same way, or add --no-load-optim")
        with _errors_as(f"checkpoint {directory}: building this run's state dict"):
            if scope.optimizer:
                distributed_optimizer.before_sharded_load(optimizer)
            # RNG states are per (pipeline, tensor) rank: restored at the saving layout only.
            run_state = _state_dict(int(common["iteration"]), 0, None, model_chunks, optimizer,
                                    scheduler, run_metadata, is_loading=True,
                                    with_rng=scope.rng and _same_model_parallel(
                                        common.get("megatron_dpp_layout", {})),
                                    with_optimizer=scope.optimizer)
        # docs/failures.md's order: the model's tensors and shapes, the optimizer, then the
        # learning-rate schedule.
        error = _model_mismatch(run_state, directory, tensors) or schedule_error
    except CheckpointLoadError as exc:
        error = str(exc)
    error = agree(error)
    if error is not None:
        raise CheckpointLoadError(error)

    # 2. The collective load (torch.distributed.checkpoint gathers every rank's exceptions).
    loaded = None
    try:
        with _errors_as(f"checkpoint {directory} is damaged"):
            loaded = dist_checkpointing.load(run_state, directory,
                                             get_default_load_sharded_strategy(directory))
    except CheckpointLoadError as exc:
        error = str(exc)
    error = agree(error)
    if error is not None:
        raise CheckpointLoadError(error)

    # 3. Into the model, optimizer, scheduler and RNGs.
    try:
        with _errors_as(f"checkpoint {directory} does not fit this model"):
            for i, chunk in enumerate(model_chunks):
                unwrap(chunk).load_state_dict(loaded[_model_key(i, len(model_chunks))], strict=True)
            if scope.optimizer:
                optimizer.load_state_dict(loaded["optimizer"])
                distributed_optimizer.after_load(optimizer)
                scheduler.load_state_dict(schedule)
            else:  # fp32 main parameters (bf16/fp16) from the loaded model, as Megatron-LM
                optimizer.reload_model_params()
            if "rng_state" in run_state:
                rng = loaded["rng_state"]
                set_rng_state(rng[0] if isinstance(rng, list) else rng, MEGATRON_RNG_KEYS)
    except CheckpointLoadError as exc:
        error = str(exc)
    error = agree(error)
    if error is not None:
        raise CheckpointLoadError(error)
    if converted is not None and dist.get_rank() == 0:
        print(f"megatron_dpp: checkpoint {directory}: {converted}", flush=True)
    return LoadedState(iteration=int(common["iteration"]), consumed_samples=consumed,
                       consumed_valid_samples=int(
                           getattr(common.get("args"), "consumed_valid_samples", 0) or 0))


def _consumed_samples(common: dict) -> int:
    consumed = common.get("consumed_samples")
    if consumed is None:  # a Megatron-LM checkpoint (it counts samples in args)
        consumed = getattr(common.get("args"), "consumed_train_samples", 0)
    return int(consumed)


def _schedule_in_samples(common: dict) -> bool:
    """Ours since the marker, and Megatron-LM's (which has no layout of ours), count samples; ours
    before it counted iterations."""
    return bool(common.get(scheduler_state.SAMPLES_MARKER)) or "megatron_dpp_layout" not in common


def _same_model_parallel(saved: dict) -> bool:
    """The saving run's tensor and pipeline sizes and stage placement (a pipeline rank's RNG
    streams serve the stages it holds); a checkpoint saved before the placement was recorded is
    of the interleaved one."""
    here = _layout()
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size")
    return bool(saved) and all(saved.get(k) == here[k] for k in keys) and \
        saved.get("stage_placement", INTERLEAVED) == here["stage_placement"]

