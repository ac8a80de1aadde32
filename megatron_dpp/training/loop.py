"""Pretraining on Megatron-Core: the iteration loop, evaluation (every --eval-interval and after
the last iteration, or alone with --skip-train), logging, exits. The run's setup is setup.py's,
one step (and evaluation, and a save) step.py's Trainer.

The model comes from a ModelSpec (megatron_dpp.models): its chunks, forward step, datasets and
CPU patches. `pretrain(args, spec)` returns the process exit code: 0 when training (or
--skip-train's evaluation) finished (or --exit-interval / --exit-duration-in-mins ended it), 128 + signal number when SIGINT/SIGTERM stopped it at an iteration boundary (after saving, if
--save is given), 2 when --multi-node finds this node's --node-ips address on none of its interfaces
or the checkpoint --load names cannot be loaded; a failed save ends the run with exit code 1.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dpp import kernels
from megatron_dpp.data.datasets import uses_per_split_paths
from megatron_dpp.data.iterators import build_data_iterators
from megatron_dpp.data.tokenizer import build_tokenizer, ignored_tiktoken_pattern
from megatron_dpp.exit_codes import BAD_INPUT, FAILED, OK, SIGNAL_BASE
from megatron_dpp.kernels import cuda_graphs as cuda_graph_choice
from megatron_dpp.kernels import log_kernel_choices
from megatron_dpp.mcore.optimizer import set_torch_adam_implementation
from megatron_dpp.models import ModelSpec
from megatron_dpp.platform import Platform, setup_platform
from megatron_dpp.rank_failure import say_failure
from megatron_dpp.training.checkpoint.flags import TRACKER_FILE, same_directory
from megatron_dpp.training.checkpoint.save_load import (
    CheckpointLoadError,
    CheckpointToLoad,
    TrainState,
    find_checkpoint,
    load_checkpoint,
    remove_unfinished_saves,
)
from megatron_dpp.training.checkpoint.torch_dist import saved_args
from megatron_dpp.training.config import (
    TrainingConfig,
    evaluation_batch_size,
    global_batch_size_at,
)
from megatron_dpp.training.failures import exit_for_lost_peer, is_lost_peer_error, peer_heartbeat
from megatron_dpp.training.observe.step_tracing import STOP_AGREEMENT
from megatron_dpp.training.observe.timers import (
    DATA_SETUP,
    LOAD_CHECKPOINT,
    MODEL_SETUP,
    level0_timers,
)
from megatron_dpp.training.rank_log import is_logging_rank, log, log_datetime, log_rank0
from megatron_dpp.training.setup import initialize_distributed, set_seeds, setup_node_network
from megatron_dpp.training.signals import AgreedStop, StopSignals
from megatron_dpp.training.step import LM_LOSS, Trainer


def _iterators_per_chunk(args, train_ds, valid_ds, consumed_train: int, consumed_valid: int,
                         num_chunks: int):
    """One train and one valid iterator per model chunk, all over the same sample stream."""
    train, valid = [], []
    for _ in range(num_chunks):
        train_iter, valid_iter, _test = build_data_iterators(
            args, train_ds, valid_ds, None, consumed_train_samples=consumed_train,
            consumed_valid_samples=consumed_valid)
        train.append(train_iter)
        valid.append(valid_iter)
    return train, (valid if valid[0] is not None else None)


def consumed_valid_samples_at_start(args, train: TrainingConfig, state: TrainState) -> int:
    """Where the validation stream goes on: the checkpoint's count, or, as Megatron-LM's
    build_train_valid_test_data_loaders, for an iteration-based run whose checkpoint says 0 (saved
    before the count was kept), what its interval evaluations read at --global-batch-size."""
    if state.iteration > 0 and state.consumed_valid_samples == 0 and args.train_samples is None:
        return (state.iteration // train.eval_interval) * train.eval_iters * \
            train.global_batch_size
    return state.consumed_valid_samples


def _test_iterators_per_chunk(args, test_ds, num_chunks: int):
    """One test iterator per model chunk, from the split's start (Megatron-LM evaluates it once,
    after training); None without test data (--split 98,2,0, no --test-data-path)."""
    test = [build_data_iterators(args, None, None, test_ds)[2] for _ in range(num_chunks)]
    return test if test[0] is not None else None


def _write_tensorboard(trainer: Trainer, reduced, grad_norm, params_norm) -> None:
    """This iteration's scalars (the logging rank holds the losses)."""
    trainer.tensorboard.training(
        trainer.state.iteration, trainer.state.consumed_samples, reduced.read(),
        learning_rate=trainer.scheduler.get_lr(trainer.optimizer.param_groups[0]),
        loss_scale=float(trainer.optimizer.get_loss_scale()),
        grad_norm=(float(grad_norm) if grad_norm is not None and train_clip_enabled(trainer)
                   else None),
        batch_size=trainer.last_global_batch_size,
        num_zeros=(float(trainer.num_zeros_in_grad) if trainer.train.log_num_zeros_in_grad
                   else None),
        params_norm=params_norm)


def _decoupled_lr(trainer: Trainer) -> float:
    """--decoupled-lr's rate now, as Megatron-LM logs it: of the param group whose max_lr it
    overrides (Megatron-Core's default_config False; every rank has it, empty or not)."""
    group = next(group for group in trainer.optimizer.param_groups
                 if not group.get("default_config", True))
    return trainer.scheduler.get_lr(group)


def _format_iteration(trainer: Trainer, reduced, grad_norm, params_norm, elapsed_ms: float,
                      skipped: int) -> str:
    train = trainer.train
    loss, tokens = reduced[LM_LOSS]
    fields = [
        f" iteration {trainer.state.iteration:8d}/{train.train_iters:8d}",
        f"consumed samples: {trainer.state.consumed_samples:12d}",
        f"elapsed time per iteration (ms): {elapsed_ms:.1f}",
    ]
    tflops = trainer.tflops_per_gpu(elapsed_ms / 1000.0)
    if tflops is not None:
        # Megatron-LM's one decimal; below 1 TFLOP/s (a CPU run) three significant digits.
        shown = format(tflops, ".1f" if tflops >= 1.0 else ".3g")
        fields.append(f"throughput per GPU (TFLOP/s/GPU): {shown}")
    fields += [
        f"learning rate: {trainer.scheduler.get_lr(trainer.optimizer.param_groups[0]):.6E}",
        *([f"decoupled learning rate: {_decoupled_lr(trainer):.6E}"]
          if train.decoupled_lr is not None else []),
        f"global batch size: {trainer.last_global_batch_size:5d}",
        f"lm loss: {loss:.10E}",
        *(f"{name}: {value:.10E}" for name, (value, _count) in reduced.items() if name != LM_LOSS),
        # As Megatron-LM: 1.0 but with --fp16, whose scale falls at every overflow (skipped step).
        f"loss scale: {float(trainer.optimizer.get_loss_scale()):.1f}",
    ]
    if grad_norm is not None and train_clip_enabled(trainer):
        fields.append(f"grad norm: {float(grad_norm):.10E}")
    if train.log_num_zeros_in_grad:
        fields.append(f"num zeros: {float(trainer.num_zeros_in_grad):.1f}")
    if params_norm is not None:
        fields.append(f"params norm: {params_norm:.10E}")
    fields.append(f"number of skipped iterations: {skipped:3d}")
    fields.append(f"tokens/s: {tokens / max(elapsed_ms / 1000.0, 1e-9):.1f}")
    return " | ".join(fields) + " |"


def _not_finite(trainer: Trainer, signals: StopSignals, grad_norm, logged: bool,
                logged_losses: dict | None) -> str | None:
    """What of this iteration is NaN or Inf, or None (collective at logged iterations). The
    gradient norm, which Megatron-Core's optimizer reads at every step (every rank holds the same
    all-reduced value; 0.0 or None where it computes none), costs nothing more; the loss, at logged
    iterations, where the logging rank has just read it: the ranks agree on it (one all-reduce of
    a flag). Megatron-LM checks each micro-batch's loss and each gradient bucket instead, a
    host-device wait each."""
    if grad_norm is not None and not math.isfinite(float(grad_norm)):
        return f"the gradient norm is {float(grad_norm)} (a NaN or Inf in the gradients)"
    if not logged:
        return None
    bad = logged_losses is not None and any(not math.isfinite(value)
                                            for value, _count in logged_losses.values())
    trainer.watch("agreeing on a NaN or Inf loss (all-reduce over every rank)")
    found = signals.any_rank(bad)
    trainer.unwatch()
    return "the loss is NaN or Inf" if found else None


def memory_report(cuda, rank: int, iteration: int) -> str:
    """Megatron-LM's report_memory line: the caching allocator's counters (host-side, no device
    synchronization), in MB; `cuda` is torch.cuda."""
    mega_bytes = 1024.0 * 1024.0
    return (f"[Rank {rank}] (after {iteration} iterations) memory (MB)"
            f" | allocated: {cuda.memory_allocated() / mega_bytes}"
            f" | max allocated: {cuda.max_memory_allocated() / mega_bytes}"
            f" | reserved: {cuda.memory_reserved() / mega_bytes}"
            f" | max reserved: {cuda.max_memory_reserved() / mega_bytes}")


def train_clip_enabled(trainer: Trainer) -> bool:
    return trainer.args.clip_grad > 0.0


def pretrain(args: argparse.Namespace, spec: ModelSpec) -> int:
    started = time.monotonic()  # --exit-duration-in-mins counts from here, as Megatron-LM's
    if args.multi_node and not setup_node_network(args):
        return BAD_INPUT
    platform = setup_platform(spec.cpu_patched_modules)
    initialize_distributed(args, platform)
    try:
        # Heartbeats with every rank from now on: a peer that stops answering is named within
        # --heartbeat-timeout, whatever this rank waits in (training/failures.py).
        with peer_heartbeat(args):
            return _pretrain(args, platform, spec, started)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _remove_unfinished_saves(save: str | None) -> None:
    """What a save left in --save when a rank died during it (iter_N.saving/), removed before
    anything else: one line saying so, and one warning for a folder that could not be."""
    removed, problems = remove_unfinished_saves(save)
    if removed:
        log_rank0(f" removed {', '.join(removed)} from {save}: the staging folder of a save that "
                  f"did not finish (a rank ended during it); the latest checkpoint is unchanged")
    for problem in problems:
        print(f"megatron_dpp: warning: could not remove an unfinished save: {problem}",
              file=sys.stderr, flush=True)


def _pretrain(args: argparse.Namespace, platform: Platform, spec: ModelSpec,
              started: float) -> int:
    if dist.get_rank() == 0:
        _remove_unfinished_saves(args.save)
    set_seeds(args.seed, cuda_graphs=cuda_graph_choice(args).on)
    if args.deterministic_mode:  # as Megatron-LM: every op from here on has to be deterministic
        torch.use_deterministic_algorithms(True)
        log_rank0(" deterministic mode: torch's deterministic algorithms and Megatron-Core's "
                  "deterministic_mode are on")
    # A --load without a checkpoint starts from scratch (Megatron-LM's), --save or not, unless
    # --exit-on-missing-checkpoint: find_checkpoint's directory that may hold none yet.
    may_hold_none = None if args.exit_on_missing_checkpoint else args.load
    try:  # before the slow setup: a damaged checkpoint fails in seconds
        checkpoint = find_checkpoint(args.load, may_hold_none) if args.load is not None else None
    except CheckpointLoadError as error:  # the same one line on every rank: rank 0 says it
        say_failure(f"megatron_dpp: error: {error}", exit_code=BAD_INPUT,
                    printed=dist.get_rank() == 0)
        return BAD_INPUT
    if args.load is not None and checkpoint is None:
        if same_directory(args.load, args.save):
            what = ("the model is evaluated as initialized" if args.skip_train
                    else "training starts from scratch")
            log_rank0(f" no checkpoint in {args.load} yet (it is also --save): {what}")
        elif dist.get_rank() == 0:  # Megatron-LM's warning, in one line
            print(f"megatron_dpp: warning: could not find the metadata file "
                  f"{os.path.join(args.load, TRACKER_FILE)}: will not load any checkpoint, "
                  f"the model starts from randomly initialized weights (--exit-on-missing-"
                  f"checkpoint stops instead)", file=sys.stderr, flush=True)
    ignored = ignored_tiktoken_pattern(args.tokenizer_type, getattr(args, "tiktoken_pattern", None))
    if ignored is not None and dist.get_rank() == 0:
        print(f"megatron_dpp: warning: {ignored}", file=sys.stderr, flush=True)
    log_kernel_choices(args, log_rank0)  # one `kernels:` line per optional kernel or backend
    if args.unused_optimizer_flags:
        log_rank0(f" {', '.join(args.unused_optimizer_flags)}: Adam's, unused by --optimizer "
                  f"{args.optimizer}")
    tokenizer = build_tokenizer(args)
    # Megatron-LM's line, with the tokenizer named: which vocabulary the embedding is sized for.
    log_rank0(f" > {args.tokenizer_type} vocab (size: {tokenizer.vocab_size}) padded with "
              f"{args.padded_vocab_size - tokenizer.vocab_size} dummy tokens (new size: "
              f"{args.padded_vocab_size})")
    level0 = level0_timers(platform.device)  # Megatron-LM's set-up timers, as it counts them
    level0(DATA_SETUP, log_level=0).start(barrier=True)
    train_ds, valid_ds, test_ds = spec.build_datasets(args, tokenizer)
    level0(DATA_SETUP).stop()
    level0(MODEL_SETUP, log_level=0).start(barrier=True)
    trainer = Trainer(args, platform, spec, level0)
    try:
        return _train(args, trainer, train_ds, valid_ds, test_ds, checkpoint, started)
    finally:
        # Joins the watchdog thread on every path, an exception included (close() is idempotent).
        if trainer.watchdog is not None:
            trainer.watchdog.close()


def stop_signals(platform: Platform) -> StopSignals:
    """The stop agreement after each iteration. On GPUs it goes over a gloo group of every rank
    with a CPU flag: over NCCL the flag's copy to the GPU and its read back would each wait for
    all the work queued on the GPU, every iteration. Collective (creates a group) on CUDA."""
    if platform.is_cuda:
        return StopSignals(torch.device("cpu"), group=dist.new_group(backend="gloo"))
    return StopSignals(platform.device)


def _load_scope_words(scope) -> str:
    """What the load line adds about flags that left part of the checkpoint out."""
    if not scope.position:
        return " (--finetune: the model only, from iteration 0 and the data's start)"
    left = [what for what, loaded in (("the optimizer and the learning-rate schedule",
                                       scope.optimizer), ("the RNG states", scope.rng))
            if not loaded]
    return f" (not loaded: {' and '.join(left)})" if left else ""


def _exit_reason(train: TrainingConfig, iteration: int, stop: AgreedStop | None,
                 minutes: float) -> str | None:
    """Why the run ends after this iteration (a signal first), or None."""
    if stop is not None and stop.signal:
        return f"stopped by signal {stop.signal}"
    if stop is not None and stop.out_of_time:
        return (f"exiting: --exit-duration-in-mins {train.exit_duration_in_mins:g} passed "
                f"({minutes:.2f} minutes since the start on this rank)")
    if train.exit_interval and iteration % train.exit_interval == 0:
        return f"exiting: --exit-interval {train.exit_interval}"
    return None


def _warn_of_setting_differences(directory: str, spec: ModelSpec,
                                 args: argparse.Namespace) -> None:
    """One line where the checkpoint was saved with other values of the model's settings that no
    shape shows (e.g. a Llama 3.1 checkpoint trained without --use-rope-scaling): it loads, but
    its weights then compute another function. Meant changes (a longer context's rotary base)
    stay possible, hence a warning, not an error."""
    from megatron_dpp.models.families import checkpoint_setting_differences

    saved = saved_args(directory)
    differences = (checkpoint_setting_differences(spec.family, saved, args)
                   if saved is not None else [])
    if differences:
        def words(values):
            return ", ".join(f"{flag} {value}" for flag, value in values)
        print(f"megatron_dpp: warning: checkpoint {directory} was saved with "
              f"{words((flag, saved_value) for flag, saved_value, _ in differences)}; this run "
              f"has {words((flag, value) for flag, _, value in differences)}, so the loaded "
              f"weights compute another function than the one they were trained for (give the "
              f"checkpoint's values unless the change is meant)", file=sys.stderr, flush=True)


def _train(args: argparse.Namespace, trainer: Trainer, train_ds, valid_ds, test_ds,
           checkpoint: CheckpointToLoad | None, started: float) -> int:
    train = trainer.train
    if checkpoint is not None:
        trainer.level0(LOAD_CHECKPOINT, log_level=0).start(barrier=True)
        try:
            trainer.state = load_checkpoint(checkpoint, trainer.model, trainer.optimizer,
                                            trainer.scheduler, train.load_scope)
            # The load gave torch's Adam the saved run's implementation: this run's again.
            set_torch_adam_implementation(
                trainer.optimizer, fused=kernels.torch_fused_adam(args.optimizer))
        except CheckpointLoadError as error:  # the same one line on every rank: rank 0 says it
            say_failure(f"megatron_dpp: error: {error}", exit_code=BAD_INPUT,
                        printed=dist.get_rank() == 0)
            trainer.close()
            return BAD_INPUT
        trainer.level0(LOAD_CHECKPOINT).stop(barrier=True)
        log_rank0(f" loaded checkpoint from {checkpoint.directory} at iteration "
                  f"{trainer.state.iteration}{_load_scope_words(train.load_scope)}")
        if dist.get_rank() == 0:
            _warn_of_setting_differences(checkpoint.directory, trainer.spec, args)
        trainer.log_times([LOAD_CHECKPOINT])
    trainer.level0(MODEL_SETUP).stop()
    log_datetime("after model, optimizer, and learning rate scheduler are built")
    trainer.last_global_batch_size = global_batch_size_at(train, trainer.state.consumed_samples)
    ramp = train.batch_ramp
    ramp_words = (f" after a ramp from {ramp.start} by {ramp.increment} over {ramp.samples} samples"
                  if ramp is not None else "")
    trained = evaluation_batch_size(train)
    if trained != train.global_batch_size:  # Megatron-Core's line, its typos mended
        data_parallel = train.micro_batch_times_data_parallel // train.micro_batch_size
        log_rank0(f" decreasing batch size from {train.global_batch_size} to {trained} to keep "
                  f"divisibility by micro_batch_size={train.micro_batch_size} * "
                  f"data_parallel_size={data_parallel} (--decrease-batch-size-if-needed)")
    if valid_ds is None and train.eval_iters > 0 and uses_per_split_paths(args):
        off = ("evaluation off" if test_ds is None
               else "validation off (the test split is evaluated after training)")
        log_rank0(f" {off}: no --valid-data-path (with --train-data-path each split reads its "
                  f"own documents)")
    trainer.level0(DATA_SETUP).start(barrier=True)
    trainer.state.consumed_valid_samples = consumed_valid_samples_at_start(args, train,
                                                                           trainer.state)
    # --skip-train draws no training batch (Megatron-LM builds no training data loader then) and
    # reads the validation split from its start (as Megatron-LM's loader then); a resumed run
    # goes on where the saved run's validation stream had reached.
    train_iters, valid_iters = _iterators_per_chunk(
        args, None if train.skip_train else train_ds, valid_ds, trainer.state.consumed_samples,
        0 if train.skip_train else trainer.state.consumed_valid_samples, len(trainer.model))
    test_iters = _test_iterators_per_chunk(args, test_ds, len(trainer.model))
    trainer.level0(DATA_SETUP).stop()
    log_datetime("after dataloaders are built")
    if not train.skip_train:
        log_rank0(f" training: {train.train_iters} iterations, global batch {trained}"
                  f"{ramp_words}, {train.num_microbatches} micro-batches of "
                  f"{train.micro_batch_size} per data-parallel rank, device "
                  f"{trainer.platform.device}, backend {trainer.platform.backend}")
    # Rank 0 says it before the timers' all-gather; the logging rank prints their block after.
    log_rank0("done with setup ...")
    trainer.log_times([MODEL_SETUP, DATA_SETUP])
    if train.skip_train:  # Megatron-LM's line: the model stays at the loaded iteration
        log_rank0("skipping training (--skip-train is on) ...")
    else:
        ended = _train_iterations(args, trainer, train_iters, valid_iters, started)
        if ended is not None:  # a stop before --train-iters: no evaluation after it, as Megatron-LM
            return ended
    _evaluate_after_training(trainer, valid_iters, test_iters)
    trainer.close()
    return OK


def _train_iterations(args: argparse.Namespace, trainer: Trainer, train_iters, valid_iters,
                      started: float) -> int | None:
    """The iterations up to --train-iters with their logging, interval evaluations and saves,
    then the save at the end. The exit code (the trainer closed) where the run stopped before
    the end (a signal, --exit-interval, a NaN...); None once every iteration ran."""
    train = trainer.train
    if train.manual_gc:
        gc.disable()
        gc.collect()
    skipped = 0
    interval_ms = 0.0
    memory_reported = False
    last_saved = trainer.state.iteration if train.load else None
    with stop_signals(trainer.platform) as signals:
        # A peer that dies while this rank waits in a collective (the training step's, an
        # evaluation's, a save's or the stop agreement's): say who, then end at once (interpreter
        # shutdown could block on the same dead peer).
        try:
            while trainer.state.iteration < train.train_iters:
                start = time.perf_counter()
                batch = trainer.last_global_batch_size
                reduced, grad_norm, updated = trainer.train_step(train_iters)
                if trainer.last_global_batch_size != batch:  # as Megatron-Core's calculator
                    log_rank0(f" ramping up batch size from {batch} to "
                              f"{trainer.last_global_batch_size}")
                skipped += 0 if updated else 1
                interval_ms += (time.perf_counter() - start) * 1000.0
                iteration = trainer.state.iteration
                logged = iteration % train.log_interval == 0
                # Every rank takes part in the norm's all-reduce wherever a rank reports it.
                tensorboard_writes = (train.tensorboard is not None
                                      and train.tensorboard.wants(iteration))
                params_norm = (trainer.params_norm() if train.log_params_norm
                               and (logged or tensorboard_writes) else None)
                if trainer.tensorboard is not None and trainer.tensorboard.wants(iteration):
                    _write_tensorboard(trainer, reduced, grad_norm, params_norm)
                logged_losses = None  # the logging rank's, at a logged iteration
                if logged:
                    iteration_ms = interval_ms / train.log_interval
                    if reduced is not None and is_logging_rank():
                        logged_losses = reduced.read()
                        log(_format_iteration(trainer, logged_losses, grad_norm, params_norm,
                                              iteration_ms, skipped))
                    interval_ms = 0.0
                    skipped = 0  # as Megatron-LM: the skipped iterations of each log interval
                    # As Megatron-LM: once, at the first logged iteration, every GPU rank of the
                    # first data-parallel replica reports its memory.
                    if not memory_reported and trainer.platform.is_cuda and \
                            parallel_state.get_data_parallel_rank() == 0:
                        log(memory_report(torch.cuda, dist.get_rank(), iteration))
                    memory_reported = True
                    trainer.report_timers(iteration, iteration_ms / 1000.0)
                if train.check_for_nan:
                    found = _not_finite(trainer, signals, grad_norm, logged, logged_losses)
                    if found is not None:  # before evaluating or saving anything of this step
                        say_failure(f"megatron_dpp: error: iteration {iteration}: {found}; the "
                                    f"run stops and saves nothing from this iteration on (as "
                                    f"Megatron-LM; --no-check-for-nan-in-loss-and-grad trains "
                                    f"on)", exit_code=FAILED, printed=is_logging_rank())
                        trainer.close()
                        return FAILED
                if train.manual_gc and train.manual_gc_interval and \
                        iteration % train.manual_gc_interval == 0:
                    gc.collect()
                if valid_iters is not None and train.eval_iters > 0 and \
                        iteration % train.eval_interval == 0:
                    trainer.evaluate(valid_iters)
                if train.save and train.save_interval and iteration % train.save_interval == 0:
                    trainer.save()
                    last_saved = iteration
                minutes = (time.monotonic() - started) / 60.0
                trainer.watch("agreeing on a stop signal (all-reduce over every rank)")
                with trainer.in_collective(STOP_AGREEMENT):
                    stop = signals.agreed_stop(out_of_time=train.exit_duration_in_mins is not None
                                               and minutes > train.exit_duration_in_mins)
                trainer.unwatch()
                reason = _exit_reason(train, iteration, stop, minutes)
                if reason is not None:
                    if train.save and last_saved != iteration:
                        trainer.save()
                    log_rank0(f" {reason} after iteration {iteration}")
                    trainer.close()
                    return SIGNAL_BASE + stop.signal if stop is not None and stop.signal else OK
        except RuntimeError as error:
            if not is_lost_peer_error(error):
                raise
            exit_for_lost_peer(error, trainer.phase, getattr(args, "node_ips", None))
    log_datetime("after training is done")
    if train.save and last_saved != trainer.state.iteration:
        trainer.save()
    if train.manual_gc:
        gc.enable()
    return None


def _evaluate_after_training(trainer: Trainer, valid_iters, test_iters) -> None:
    """Megatron-LM's evaluation after the last iteration (or in place of training, --skip-train)
    at the model's iteration, with its prefixes: the validation split, its stream going on
    after the interval evaluations' batches (samples_per_split sized the split for one more),
    then the test split from its start. A split without data is left out, as with
    --eval-iters 0 both are; --skip-train writes nothing to TensorBoard, as Megatron-LM."""
    if trainer.train.eval_iters == 0:
        return
    to_tensorboard = not trainer.train.skip_train
    with _lost_peer_ends_the_run(trainer):
        for iterators, split in ((valid_iters, "validation set"), (test_iters, "test set")):
            if iterators is not None:
                trainer.evaluate(iterators, split=split, to_tensorboard=to_tensorboard)


@contextlib.contextmanager
def _lost_peer_ends_the_run(trainer: Trainer):
    """A peer that dies while this rank waits in a collective: say who, then end at once
    (interpreter shutdown could block on the same dead peer)."""
    try:
        yield
    except RuntimeError as error:
        if not is_lost_peer_error(error):
            raise
        exit_for_lost_peer(error, trainer.phase, getattr(trainer.args, "node_ips", None))
