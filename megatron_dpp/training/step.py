"""One training step and evaluation: `Trainer` runs the schedule (Megatron's or DPP's), the
optimizer step and the learning-rate schedule, reduces the losses, and saves checkpoints."""
from __future__ import annotations

import argparse
import contextlib
import gc
import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dpp.comm import collectives
from megatron_dpp.comm.router import RouteError
from megatron_dpp.exit_codes import BAD_INPUT, FAILED
from megatron_dpp.mcore.cudagraphs import eager_layers
from megatron_dpp.models import ModelSpec
from megatron_dpp.platform import Platform
from megatron_dpp.rank_failure import fail, say_failure
from megatron_dpp.trace.recorder import OPTIMIZER_STEP
from megatron_dpp.training.checkpoint.save_load import (
    CheckpointSaveError,
    TrainState,
    save_checkpoint,
)
from megatron_dpp.training.config import (
    evaluation_batch_size,
    global_batch_size_at,
    microbatches_of,
    training_config_from_args,
)
from megatron_dpp.training.lr_schedule import SampleSchedule
from megatron_dpp.training.observe.params_norm import params_l2_norm
from megatron_dpp.training.observe.profiler_window import make_profiler
from megatron_dpp.training.observe.step_tracing import LOSS_ALL_REDUCE
from megatron_dpp.training.observe.tensorboard_log import TensorBoardLog
from megatron_dpp.training.observe.throughput import (
    ModelShape,
    floating_point_operations,
    tflops_per_gpu,
)
from megatron_dpp.training.observe.timers import (
    EVALUATE,
    SAVE_CHECKPOINT,
    TimedIterator,
    Timers,
    level0_timers,
    timed,
    timers_off,
    timers_to_log,
    times_text,
)
from megatron_dpp.training.observe.tracing import agree_run_directory
from megatron_dpp.training.observe.wandb_log import WandbInitError
from megatron_dpp.training.pipeline import build_forward_backward, close_forward_backward
from megatron_dpp.training.rank_log import is_logging_rank, log, log_rank0
from megatron_dpp.stage_placement import holds_the_loss
from megatron_dpp.training.setup import (
    build_model_and_optimizer,
    nvtx_around_gradient_sync,
    nvtx_range,
    params_gathered,
    stall_watchdog,
    step_tracer,
)

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
    if not holds_the_loss():
        return None
    names = [LM_LOSS] + sorted({name for entry in losses_reduced for name in entry} - {LM_LOSS})
    total = torch.zeros(len(names), 2, dtype=torch.float64, device=device)
    for entry in losses_reduced:
        for index, name in enumerate(names):
            if name in entry:
                total[index] += entry[name].to(device=device, dtype=torch.float64)
    # Under gloo on CUDA ranks (ranks sharing a GPU) staged through the host (comm/collectives.py).
    collectives.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return ReducedLosses(names, total)


def reduce_losses(losses_reduced: list[dict], device: torch.device) -> dict | None:
    """On last-stage ranks: every loss the model reported, {name: (mean over the global batch,
    its count)}, LM_LOSS first; None on the other ranks. A model's loss function reports each loss
    as [sum, count] per microbatch (e.g. tokens for the LM loss, samples for BERT's sentence-order
    loss); the mean is the sum over microbatches and data-parallel ranks over the count."""
    reduced = reduce_losses_on_device(losses_reduced, device)
    return None if reduced is None else reduced.read()


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
        self.step_tracer = step_tracer(self.forward_backward, self.config)
        if args.nvtx:
            nvtx_around_gradient_sync(self.config)
        self.profiler = make_profiler(args, dist.get_rank(), run_directory)
        self.forward_step = spec.make_forward_step(args, platform.device)
        self.state = TrainState()
        self.watchdog = stall_watchdog(args)
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
        seq_length, micro_batch_size = self.train.seq_length, self.train.micro_batch_size
        if getattr(self.args, "dataloader_inter_document_masking", False):
            # Each micro-batch is one packed row (data/iterators.py, THD): the stages pass
            # [seq_length * micro_batch_size, 1, hidden] activations, as in Megatron-LM.
            seq_length, micro_batch_size = seq_length * micro_batch_size, 1
        return self.forward_backward(
            forward_step_func=self.forward_step,
            data_iterator=_as_schedule_input(data_iterators),
            model=self.model,
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            decoder_seq_length=seq_length,
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
        with self.in_collective(LOSS_ALL_REDUCE, holds_the_loss()):
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
            stack.enter_context(nvtx_range(name))
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
