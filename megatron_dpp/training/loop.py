"""Pretraining on Megatron-Core: setup, the iteration loop, evaluation (every --eval-interval and
after the last iteration, or alone with --skip-train), logging, checkpoints.

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
import random
import sys
import time
from datetime import datetime, timedelta

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import get_megatron_optimizer, get_standard_config_overrides

from megatron_dpp.comm.nodes import this_node_rank, use_node_network
from megatron_dpp.comm.router import RouteError
from megatron_dpp import kernels
from megatron_dpp.data.datasets import uses_per_split_paths
from megatron_dpp.data.iterators import build_data_iterators
from megatron_dpp.data.tokenizer import build_tokenizer, ignored_tiktoken_pattern
from megatron_dpp.exit_codes import BAD_INPUT, FAILED, OK, SIGNAL_BASE
from megatron_dpp.kernels import cuda_graphs as cuda_graph_choice
from megatron_dpp.kernels import log_kernel_choices
from megatron_dpp.models import ModelSpec
from megatron_dpp.models.pipeline_split import PipelineSplit
from megatron_dpp.platform import Platform, setup_platform
from megatron_dpp.rank_failure import fail, say_failure
from megatron_dpp.runtime.config import DPPConfig
from megatron_dpp.runtime.watchdog import StallWatchdog
from megatron_dpp.trace.recorder import GRADIENT_SYNC, OPTIMIZER_STEP
from megatron_dpp.training.checkpoint.save_load import (
    CheckpointLoadError,
    CheckpointSaveError,
    CheckpointToLoad,
    TrainState,
    find_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from megatron_dpp.training.checkpoint.flags import TRACKER_FILE, same_directory
from megatron_dpp.training.checkpoint.torch_dist import saved_args
from megatron_dpp.training.config import (
    TrainingConfig,
    ddp_config_from_args,
    evaluation_batch_size,
    global_batch_size_at,
    microbatches_of,
    optimizer_config_from_args,
    training_config_from_args,
    transformer_config_from_args,
)
from megatron_dpp.training.pipeline import build_forward_backward, close_forward_backward
from megatron_dpp.training.observe.profiler_window import make_profiler
from megatron_dpp.training.failures import exit_for_lost_peer, is_lost_peer_error, peer_heartbeat
from megatron_dpp.mcore.cudagraphs import eager_layers
from megatron_dpp.mcore.ddp import DistributedDataParallel
from megatron_dpp.mcore.optimizer import (install_foreach_multi_tensor_ops,
                                          set_torch_adam_implementation)
from megatron_dpp.training.lr_schedule import SampleSchedule
from megatron_dpp.training.observe.params_norm import params_l2_norm
from megatron_dpp.mcore.sgd_state import install_sgd_state_init
from megatron_dpp.training.signals import AgreedStop, StopSignals
from megatron_dpp.training.observe.tensorboard_log import TensorBoardLog
from megatron_dpp.training.observe.timers import (DATA_SETUP, EVALUATE, LOAD_CHECKPOINT, MODEL_SETUP,
                                          SAVE_CHECKPOINT, TimedIterator, Timers, attach_timers,
                                          level0_timers, timed, timers_from_args, timers_off,
                                          times_text, timers_to_log)
from megatron_dpp.training.observe.wandb_log import WandbInitError
from megatron_dpp.training.observe.throughput import ModelShape, floating_point_operations, tflops_per_gpu
from megatron_dpp.training.observe.step_tracing import LOSS_ALL_REDUCE, STOP_AGREEMENT, StepTracer
from megatron_dpp.training.observe.tracing import agree_run_directory


def setup_node_network(args: argparse.Namespace) -> bool:
    """--multi-node: make gloo and NCCL use this node's --node-ips interface, before any process
    group exists. False (after one line on stderr) when that address is not on this node."""
    try:
        network = use_node_network(args.node_ips, this_node_rank())
    except ValueError as error:  # NodeNetworkError, or torchrun's GROUP_RANK missing
        say_failure(f"megatron_dpp: error: {error}", exit_code=BAD_INPUT)
        return False
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one line per node
        log(network.describe())
    return True


def initialize_distributed(args: argparse.Namespace, platform: Platform) -> None:
    dist.init_process_group(backend=args.distributed_backend,
                            timeout=timedelta(minutes=args.distributed_timeout_minutes))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
    )


def set_seeds(seed: int, cuda_graphs: bool = False) -> None:
    """Megatron-LM's scheme: the pipeline rank offsets the seed (dropout differs per stage). With
    CUDA graphs the tracker's states are graph-safe generators, which the graphs can replay (as
    Megatron-LM seeds for --cuda-graph-impl)."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=cuda_graphs)


def is_logging_rank() -> bool:
    """The rank that holds the loss and prints: last pipeline stage, first tp and dp rank."""
    return (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
            and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank() == 0)


def log(message: str) -> None:
    # One write, so that another rank's line (on the same terminal) cannot land inside it.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def log_rank0(message: str) -> None:
    if dist.get_rank() == 0:
        log(message)


def log_datetime(label: str) -> None:
    """Megatron-LM's print_datetime: every rank gets there, then rank 0 prints the time."""
    dist.barrier()
    log_rank0(f"[{label}] datetime: {datetime.now().strftime('%Y-%m-%d %H:%M:%S')}")


def wrap_for_mixed_precision(config, chunks: list) -> list:
    """With --bf16 or --fp16, each chunk inside Megatron-Core's Float16Module, as Megatron-LM's
    get_model does: it casts every parameter to 16 bits (torch's own layers, such as the learned
    position embedding and the local spec's layer norms, are built in fp32, and a forward would
    mix dtypes), the first stage's input too, and returns the last stage's outputs in fp32."""
    if not (config.bf16 or config.fp16):
        return chunks
    from megatron.core.transformer.module import Float16Module

    return [Float16Module(config, chunk) for chunk in chunks]


def build_model_and_optimizer(args, platform: Platform, seed: int, spec: ModelSpec):
    config = transformer_config_from_args(args)
    # --timing-log-level: Megatron-Core's schedules, gradient sync and optimizer time themselves.
    timers = timers_from_args(args, platform.device)
    attach_timers(config, timers, args.barrier_with_L1_time)
    chunks = spec.build_chunks(args, config, seed)  # args.padded_vocab_size: set by build_tokenizer
    num_parameters = log_model_size(config, chunks)
    chunks = wrap_for_mixed_precision(config, [chunk.to(platform.device) for chunk in chunks])
    ddp_config = ddp_config_from_args(args, num_parameters)
    # Without Apex / Transformer Engine: torch foreach ops for the gradient norm, clipping and the
    # main-to-model parameter copy instead of Megatron-Core's per-tensor loops, which synchronize
    # with the GPU once per parameter tensor (mcore/optimizer.py).
    install_foreach_multi_tensor_ops()
    model = [
        # Only the first chunk buckets its gradients (Megatron-LM does the same).
        DistributedDataParallel(config, ddp_config, module=chunk, disable_bucketing=index > 0)
        for index, chunk in enumerate(chunks)
    ]
    optimizer_config = optimizer_config_from_args(args)
    attach_timers(optimizer_config, timers, args.barrier_with_L1_time)
    overrides = optimizer_config_overrides(optimizer_config)
    optimizer = get_megatron_optimizer(optimizer_config, model, config_overrides=overrides)
    set_torch_adam_implementation(optimizer, fused=kernels.torch_fused_adam(args.optimizer))
    install_sgd_state_init(optimizer)  # --optimizer sgd: what a torch_dist load calls
    set_sync_funcs(config, model, args)
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return config, model, optimizer


def optimizer_config_overrides(optimizer_config) -> dict:
    """Megatron-Core's default param-group overrides, --decoupled-lr's group marked
    is_decoupled_lr: 0.16.1's optimizer load tells the saved groups apart by (wd_mult, lr_mult,
    is_expert_parallel, is_decoupled_lr) only, and would take the decoupled group's state for the
    default group's (a resume fails on their sizes)."""
    overrides = get_standard_config_overrides(optimizer_config)
    for override in overrides.values():
        if "max_lr" in override:  # the decoupled one (is_embedding_or_output_parameter)
            override["is_decoupled_lr"] = True
    return overrides


def log_model_size(config, chunks: list) -> int:
    """Megatron-LM's parameter count line, from each (tensor, pipeline) rank of the first
    data-parallel replica, and, on rank 0, the pipeline split when a flag made it other than even
    (models/pipeline_split.py). Returns this rank's parameter count."""
    split = PipelineSplit.from_config(config)
    if not split.is_default:
        log_rank0(f" pipeline split: transformer layers per pipeline rank {split.describe()}")
    count = sum(param.nelement() for chunk in chunks for param in chunk.parameters())
    if parallel_state.get_data_parallel_rank() == 0:
        # One write, so that the ranks' lines do not interleave.
        sys.stdout.write(f" > number of parameters on (tensor, pipeline) model parallel rank "
                         f"({parallel_state.get_tensor_model_parallel_rank()}, "
                         f"{parallel_state.get_pipeline_model_parallel_rank()}): {count}\n")
        sys.stdout.flush()
    return count


def set_sync_funcs(config, model: list, args: argparse.Namespace) -> None:
    """The data-parallel hooks the schedules call on `config` (one per model chunk, or the one
    function itself for one chunk), as Megatron-LM sets them: no_sync_func always; grad_sync_func
    with --overlap-grad-reduce unless --no-delay-grad-reduce (the schedule then launches the
    reductions of all but the first pipeline stage after their last backward); param_sync_func
    with --overlap-param-gather and --delay-param-gather."""
    def per_chunk(funcs: list):
        return funcs[0] if len(funcs) == 1 else funcs

    config.no_sync_func = per_chunk([chunk.no_sync for chunk in model])
    if args.overlap_grad_reduce and args.delay_grad_reduce:
        config.grad_sync_func = per_chunk([chunk.start_grad_sync for chunk in model])
    if args.overlap_param_gather and args.delay_param_gather:
        config.param_sync_func = per_chunk([chunk.start_param_sync for chunk in model])


@contextlib.contextmanager
def params_gathered(model: list):
    """With --overlap-param-gather the last optimizer step's parameters are gathered only by the
    next forward's pre-hooks (DDP's use_forward_hook): for what reads the model outside training
    (evaluation, checkpoints), gather them now (disable_forward_pre_hook all-gathers
    synchronously) and turn the hooks back on afterwards, as Megatron-LM does."""
    hooked = [chunk for chunk in model if getattr(chunk, "use_forward_hook", False)]
    for chunk in hooked:
        chunk.disable_forward_pre_hook()
    try:
        yield
    finally:
        for chunk in hooked:
            chunk.enable_forward_pre_hook()


# The loss every model reports first; the spec's loss function may report others after it.
LM_LOSS = "lm loss"


class ReducedLosses:
    """An iteration's losses, summed over its microbatches and data-parallel ranks on the device.
    Reading them (read()) is a host-device synchronization, so the training loop reads them only
    when it logs, not every iteration; the sums are final once the all-reduce is queued."""

    def __init__(self, names: list[str], total: torch.Tensor):
        self.names = names
        self.total = total  # [len(names), 2] float64: (sum, count) per name
        self._values: dict | None = None

    def read(self) -> dict:
        """{name: (mean over the global batch, its count)}, LM_LOSS first."""
        if self._values is None:
            self._values = {name: (loss_sum / max(count, 1.0), count)
                            for name, (loss_sum, count) in zip(self.names, self.total.tolist())}
        return self._values


def reduce_losses_on_device(losses_reduced: list[dict],
                            device: torch.device) -> ReducedLosses | None:
    """reduce_losses without reading the result (no host-device synchronization)."""
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    names = [LM_LOSS] + sorted({name for entry in losses_reduced for name in entry} - {LM_LOSS})
    total = torch.zeros(len(names), 2, dtype=torch.float64, device=device)
    for entry in losses_reduced:
        for index, name in enumerate(names):
            if name in entry:
                total[index] += entry[name].to(device=device, dtype=torch.float64)
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return ReducedLosses(names, total)


def reduce_losses(losses_reduced: list[dict], device: torch.device) -> dict | None:
    """On last-stage ranks: every loss the model reported, {name: (mean over the global batch,
    its count)}, LM_LOSS first; None on the other ranks. A model's loss function reports each loss
    as [sum, count] per microbatch (e.g. tokens for the LM loss, samples for BERT's sentence-order
    loss); the mean is the sum over microbatches and data-parallel ranks over the count."""
    reduced = reduce_losses_on_device(losses_reduced, device)
    return None if reduced is None else reduced.read()


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


def _as_schedule_input(items: list):
    return items if len(items) > 1 else items[0]


class Trainer:
    """Holds the built objects of one run and runs iterations and evaluations."""

    def __init__(self, args: argparse.Namespace, platform: Platform, spec: ModelSpec,
                 level0: Timers | None = None):
        self.args = args
        self.platform = platform
        self.spec = spec
        # Megatron-LM's level-0 timers (set-up, checkpoints, evaluation), at every level.
        self.level0 = level0 if level0 is not None else level0_timers(platform.device)
        self.train = training_config_from_args(args)
        self.config, self.model, self.optimizer = build_model_and_optimizer(
            args, platform, args.seed, spec)
        self.scheduler = SampleSchedule(self.optimizer, self.train)
        self.timers = self.config.timers  # --timing-log-level's, or None
        # --trace and torch.profiler write into one directory per run, agreed on by all ranks.
        writes_files = args.trace or (args.profile and args.use_pytorch_profiler)
        run_directory = agree_run_directory(args) if writes_files else None
        try:
            self.forward_backward = build_forward_backward(args, spec, run_directory)
        except RouteError as error:  # what is installed differs between nodes: one line each
            fail(f"megatron_dpp: error: {error}", exit_code=BAD_INPUT)
        self.step_tracer = _step_tracer(self.forward_backward, self.config)
        if args.nvtx:
            _nvtx_around_gradient_sync(self.config)
        self.profiler = make_profiler(args, dist.get_rank(), run_directory)
        self.forward_step = spec.make_forward_step(args, platform.device)
        self.state = TrainState()
        self.watchdog = _stall_watchdog(args)
        # The last step's count of zero gradient elements (--log-num-zeros-in-grad, else None).
        self.num_zeros_in_grad = None
        try:
            self.tensorboard = (TensorBoardLog(self.train.tensorboard, dist.get_world_size())
                                if self.train.tensorboard is not None and is_logging_rank()
                                else None)
        except WandbInitError as error:  # the logging rank's; the others learn it as a lost peer
            fail(f"megatron_dpp: error: {error}", exit_code=FAILED)
        # --log-throughput: what Megatron-LM's operation count needs of the model.
        self.model_shape = (ModelShape.of(self.config, args.seq_length, args.padded_vocab_size)
                            if self.train.log_throughput else None)
        # The last training iteration's global batch (--rampup-batch-size changes it); before
        # the first, the first's.
        self.last_global_batch_size = global_batch_size_at(self.train, 0)
        self.phase: str | None = None  # what the rank waits in, for reports

    def _run_schedule(self, data_iterators, forward_only: bool,
                      num_microbatches: int) -> list[dict]:
        if self.timers is not None and self.timers.log_level >= 2 and not forward_only:
            data_iterators = [None if source is None else TimedIterator(source, self.timers)
                              for source in data_iterators]
        return self.forward_backward(
            forward_step_func=self.forward_step,
            data_iterator=_as_schedule_input(data_iterators),
            model=self.model,
            num_microbatches=num_microbatches,
            seq_length=self.train.seq_length,
            micro_batch_size=self.train.micro_batch_size,
            decoder_seq_length=self.train.seq_length,
            forward_only=forward_only,
        )

    def train_step(self, data_iterators):
        """One iteration: (ReducedLosses on last-stage ranks else None, grad norm, updated).
        Nothing here waits for the device except what Megatron-Core's optimizer step does (the
        gradient norm's read, with --clip-grad); the losses are read when the loop logs them."""
        if self.profiler is not None:
            self.profiler.iteration_starts(self.state.iteration)
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        # --rampup-batch-size: this iteration's global batch, from the samples trained so far.
        batch = global_batch_size_at(self.train, self.state.consumed_samples)
        self.watch("the pipeline schedule (forward, backward, gradient all-reduces)")
        losses = self._run_schedule(data_iterators, forward_only=False,
                                    num_microbatches=microbatches_of(self.train, batch))
        if self.train.empty_unused_memory_level >= 1:
            torch.cuda.empty_cache()
        self.watch("the optimizer step (gradient-norm all-reduce over the model-parallel group)")
        with self.traced_step(OPTIMIZER_STEP), timed(self.timers, "optimizer", log_level=1,
                                                     barrier=self.args.barrier_with_L1_time):
            updated, grad_norm, self.num_zeros_in_grad = self.optimizer.step()
        if updated:
            self.scheduler.step_after_update(batch)
        if self.train.empty_unused_memory_level >= 2:
            torch.cuda.empty_cache()
        self.state.iteration += 1
        self.state.consumed_samples += batch
        self.last_global_batch_size = batch
        self.watch("the loss all-reduce over the data-parallel group")
        with self.in_collective(LOSS_ALL_REDUCE, parallel_state.is_pipeline_last_stage(ignore_virtual=True)):
            reduced = reduce_losses_on_device(losses, self.platform.device)
        self.unwatch()
        if self.profiler is not None:
            self.profiler.iteration_ended(self.state.iteration)
        return reduced, grad_norm, updated

    def traced_step(self, name: str):
        """With --trace: a span of the training step (training/observe/step_tracing.py); with --nvtx, an
        NVTX range named like it."""
        stack = contextlib.ExitStack()
        if self.args.nvtx:
            stack.enter_context(_nvtx_range(name))
        if self.step_tracer is not None:
            stack.enter_context(self.step_tracer.step(name))
        return stack

    def in_collective(self, what: str, takes_part: bool = True):
        """With --trace, where this rank takes part: a wait in a blocking collective."""
        if self.step_tracer is None or not takes_part:
            return contextlib.nullcontext()
        return self.step_tracer.collective(what)

    def watch(self, phase: str) -> None:
        """Arm the stall watchdog (with --use-dpp) for a phase that blocks on other ranks."""
        self.phase = phase
        if self.watchdog is not None:
            self.watchdog.arm(phase)

    def unwatch(self) -> None:
        self.phase = None
        if self.watchdog is not None:
            self.watchdog.disarm()

    def params_norm(self) -> float:
        """Collective (model-parallel group): --log-params-norm's value after this step."""
        self.watch("the parameters' norm (all-reduce over the model-parallel group)")
        with params_gathered(self.model):
            norm = params_l2_norm(self.model, bf16=self.args.bf16,
                                  sharded_main_params=self.args.use_distributed_optimizer,
                                  device=self.platform.device)
        self.unwatch()
        return norm

    def evaluate(self, data_iterators, split: str | None = None,
                 to_tensorboard: bool = True) -> None:
        """Collective. As Megatron-LM's evaluate_and_print_results: the 'evaluate' timer's block,
        then the loss line. `split` ("validation set", "test set"): the evaluation after
        training, whose line names it and which, verbose as Megatron-LM's, counts its samples
        and steps on rank 0. Megatron-LM's line and TensorBoard tag say validation for the test
        split too; to_tensorboard is False under --skip-train (its write_to_tensorboard)."""
        self.level0(EVALUATE, log_level=0).start(barrier=True)
        with params_gathered(self.model):
            loss = self._evaluate(data_iterators, verbose=split is not None)
        self.level0(EVALUATE).stop()
        self.log_times([EVALUATE])
        if is_logging_rank():
            at = f"iteration {self.state.iteration}" + (f" on {split}" if split else "")
            log(f" validation loss at {at} | lm loss value: "
                f"{loss:.10E} | lm loss PPL: {math.exp(min(20.0, loss)):.6E} |")
            if self.tensorboard is not None and to_tensorboard:
                self.tensorboard.validation(self.state.iteration, self.state.consumed_samples,
                                            loss)

    def log_times(self, names) -> None:
        """Collective: Megatron-LM's timers.log(names) for level-0 timers, printed by the rank
        that prints the log line."""
        self.watch("the timers' all-gather (every rank)")
        text = times_text(self.level0, names, self.train.timing_log_option)
        self.unwatch()
        if text is not None and is_logging_rank():
            log(text)

    def _evaluate(self, data_iterators, verbose: bool = False) -> float:
        """The loss over --eval-iters batches (the logging rank's; 0 elsewhere)."""
        manual_gc = self.train.manual_gc and self.train.manual_gc_eval
        if manual_gc:
            gc.collect()
        for chunk in self.model:
            chunk.eval()
        loss_sum = tokens = 0.0
        steps = self.train.eval_iters
        if verbose:
            log_rank0(f"Evaluating on {steps * evaluation_batch_size(self.train)} samples")
        # As Megatron-LM: the timers count training only.
        with torch.no_grad(), eager_layers(self.config), timers_off(self.config):
            for step in range(1, steps + 1):
                if verbose:
                    log_rank0(f"Evaluating iter {step}/{steps}")
                self.watch("an evaluation step (forward-only schedule, loss all-reduce)")
                reduced = reduce_losses(
                    self._run_schedule(data_iterators, forward_only=True,
                                       num_microbatches=self.train.num_microbatches),
                    self.platform.device)
                self.unwatch()
                self.state.consumed_valid_samples += evaluation_batch_size(self.train)
                if reduced is not None:
                    loss, count = reduced[LM_LOSS]
                    loss_sum += loss * count
                    tokens += count
        for chunk in self.model:
            chunk.train()
        if manual_gc:
            gc.collect()
        return loss_sum / max(tokens, 1.0)

    def tflops_per_gpu(self, iteration_seconds: float) -> float | None:
        """--log-throughput's TFLOP/s per rank of the last iteration's batch (None without it)."""
        if self.model_shape is None:
            return None
        operations = floating_point_operations(self.model_shape, self.last_global_batch_size)
        return tflops_per_gpu(operations, iteration_seconds, dist.get_world_size())

    def report_timers(self, iteration: int, iteration_seconds: float) -> None:
        """At a logged iteration, after its line: the timers' block (--timing-log-level 1 or 2;
        collective: every rank takes part in their all-gather) and, with
        --log-timers-to-tensorboard, their scalars, as Megatron-LM."""
        report = None
        if self.timers is not None:
            self.watch("the timers' all-gather (every rank)")
            report = self.timers.gather(timers_to_log(self.timers.log_level),
                                        normalizer=self.train.log_interval)
            self.unwatch()
        if not is_logging_rank():
            return
        text = report.text(self.train.timing_log_option) if report is not None else None
        if text is not None:
            log(text)
        if self.tensorboard is not None and self.train.tensorboard.timers:
            self.tensorboard.timers(
                iteration, iteration_seconds, self.tflops_per_gpu(iteration_seconds),
                {name: report.min_max(name)[1] for name in report.names} if report else {})

    def close(self) -> None:
        """Collective: every rank calls it after the same iteration (end or agreed stop)."""
        if self.profiler is not None:
            self.profiler.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        close_forward_backward(self.forward_backward)

    def save(self) -> None:
        """Collective. A failed save (full disk...) leaves the previous checkpoint the latest;
        the run then ends with one line and exit code 1 (every rank learns of the failure)."""
        self.level0(SAVE_CHECKPOINT, log_level=0).start(barrier=True)
        try:
            with params_gathered(self.model):
                path = save_checkpoint(self.train.save, self.state, self.model, self.optimizer,
                                       self.scheduler, args=self.args,
                                       ckpt_format=getattr(self.args, "ckpt_format", "torch_dist"))
        except CheckpointSaveError as error:  # the same one line on every rank: rank 0 says it
            say_failure(f"megatron_dpp: error: {error}", exit_code=FAILED,
                        printed=dist.get_rank() == 0)
            self.close()
            raise SystemExit(FAILED) from None
        self.level0(SAVE_CHECKPOINT).stop(barrier=True)
        log_rank0(f" saved checkpoint at iteration {self.state.iteration} to {path}")
        self.log_times([SAVE_CHECKPOINT])


@contextlib.contextmanager
def _nvtx_range(name: str):
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


def _nvtx_around_gradient_sync(config) -> None:
    """--nvtx: an NVTX range GRADIENT_SYNC around config.finalize_model_grads_func, the hook both
    the DPP runtime and Megatron's schedules call once an iteration's last backward ran."""
    finalize = config.finalize_model_grads_func
    if finalize is None:
        return

    def finalize_model_grads(*args, **kwargs):
        with _nvtx_range(GRADIENT_SYNC):
            return finalize(*args, **kwargs)

    config.finalize_model_grads_func = finalize_model_grads


def _step_tracer(forward_backward, config) -> StepTracer | None:
    """With --trace (the schedule's RunTrace on forward_backward): the recorder of the parts of the
    step around the schedule, its gradient sync hooked through config.finalize_model_grads_func."""
    trace = getattr(forward_backward, "trace", None)
    if trace is None:
        return None
    tracer = StepTracer(trace.recorder)
    if config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func = tracer.traced_finalize(config, config.finalize_model_grads_func)
    return tracer


def _stall_watchdog(args: argparse.Namespace) -> StallWatchdog | None:
    """With --use-dpp, --dpp-timeout also bounds the blocking collectives of a training step: a
    peer that stops while this rank waits in one ends the job with a report instead of a hang. It
    fires a little after the runtime's own deadline, whose report (awaited tags, ready tasks) is
    more precise when the stall is inside the schedule."""
    if not getattr(args, "use_dpp", False):
        return None
    margin_s = max(2.0, 0.25 * args.dpp_timeout)
    return StallWatchdog(args.dpp_timeout + margin_s, DPPConfig.timeout_exit_code)


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


def _pretrain(args: argparse.Namespace, platform: Platform, spec: ModelSpec,
              started: float) -> int:
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
