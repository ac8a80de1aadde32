"""Parsed flags -> config dataclasses (Megatron-Core's and our TrainingConfig).

Every flag the training path uses is read here, so "is this flag wired?" has one place to look,
but for Megatron-Core's TransformerConfig: megatron_dpp.models.transformer_config builds it, for
training (transformer_config_from_args, imported here) and for the search's profiler alike.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig

from megatron_dpp.training.batch_ramp import BatchSizeRamp, running_batch
from megatron_dpp.training.checkpoint.flags import LoadScope
from megatron_dpp.training.flags import batch_ramp_from_args
from megatron_dpp.training.observe.tensorboard_log import TensorBoardConfig
from megatron_dpp.training.observe.wandb_log import wandb_config_from_args
# transformer_config_from_args: the training loop imports it from here.
from megatron_dpp.models.transformer_config import (params_dtype_from_args,
                                                    transformer_config_from_args)


@dataclass(frozen=True)
class TrainingConfig:
    """What the training loop needs beyond Megatron-Core's own configs."""

    train_iters: int
    skip_train: bool  # --skip-train: no iteration, only the evaluation after them
    micro_batch_size: int
    global_batch_size: int  # --global-batch-size: after --rampup-batch-size's ramp, if any
    # micro-batch size x data-parallel size: a trained batch is a multiple of it (with
    # --decrease-batch-size-if-needed the largest one up to the batch asked for)
    micro_batch_times_data_parallel: int
    num_microbatches: int  # per data-parallel rank, of global_batch_size as trained; evaluation's
    batch_ramp: Optional[BatchSizeRamp]  # --rampup-batch-size
    seq_length: int
    seed: int
    lr: float
    min_lr: float
    # --decoupled-lr (None: off) and its floor: the embedding's and output layer's param groups
    decoupled_lr: Optional[float]
    decoupled_min_lr: Optional[float]
    lr_decay_style: str
    # The schedule's lengths in samples, as Megatron-LM counts them (training/lr_schedule.py);
    # a warmup given as a fraction of the decay may be fractional.
    lr_warmup_samples: float
    lr_decay_samples: int
    wd_incr_samples: int
    weight_decay: float
    # On --load, where the checkpoint's schedule differs from the flags: take the flags
    # (--override-opt_param-scheduler), keep the checkpoint's (--use-checkpoint-...), or stop.
    override_opt_param_scheduler: bool
    use_checkpoint_opt_param_scheduler: bool
    log_interval: int
    eval_interval: int
    eval_iters: int
    save: Optional[str]
    load: Optional[str]
    save_interval: Optional[int]
    tensorboard: Optional[TensorBoardConfig]  # --tensorboard-dir, --wandb-project; what they get
    log_num_zeros_in_grad: bool  # the optimizer counts them (OptimizerConfig's field too)
    log_params_norm: bool  # the parameters' L2 norm at logged iterations (training/observe/params_norm.py)
    log_throughput: bool  # TFLOP/s per rank in the log line (training/observe/throughput.py)
    timing_log_option: str  # --timing-log-option: how the timers' block shows the ranks
    # stop at the first NaN or Inf gradient norm or logged loss (not --no-check-for-nan-in-
    # loss-and-grad; off under --fp16's dynamic loss scale)
    check_for_nan: bool
    load_scope: LoadScope  # what --load restores beyond the model
    exit_interval: Optional[int]  # stop after a multiple of it (Megatron-LM's)
    exit_duration_in_mins: Optional[float]  # stop after the first iteration past it
    manual_gc: bool
    manual_gc_interval: int
    manual_gc_eval: bool  # with manual_gc: collect at the start and end of each evaluation
    empty_unused_memory_level: int
    distributed_timeout_minutes: int


def global_batch_size_at(train: TrainingConfig, consumed_samples: int) -> int:
    """The global batch trained by the iteration that starts after consumed_samples (the flag
    check made every batch asked for a multiple of micro_batch_times_data_parallel, or, with
    --decrease-batch-size-if-needed, at least one, and it is rounded down)."""
    asked = (train.global_batch_size if train.batch_ramp is None
             else train.batch_ramp.global_batch_size(consumed_samples))
    return running_batch(asked, train.micro_batch_times_data_parallel)


def evaluation_batch_size(train: TrainingConfig) -> int:
    """Samples of one evaluation step: the final global batch, as trained."""
    return train.num_microbatches * train.micro_batch_times_data_parallel


def microbatches_of(train: TrainingConfig, global_batch_size: int) -> int:
    """Micro-batches per data-parallel rank of a trained global batch."""
    return global_batch_size // train.micro_batch_times_data_parallel


def training_config_from_args(args: argparse.Namespace) -> TrainingConfig:
    return TrainingConfig(
        train_iters=args.train_iters,
        skip_train=args.skip_train,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        micro_batch_times_data_parallel=args.micro_batch_size * args.parallel.data_parallel_size,
        num_microbatches=args.num_microbatches,
        batch_ramp=batch_ramp_from_args(args),
        seq_length=args.seq_length,
        seed=args.seed,
        lr=args.lr,
        min_lr=args.min_lr,
        decoupled_lr=args.decoupled_lr,
        decoupled_min_lr=args.decoupled_min_lr,
        lr_decay_style=args.lr_decay_style,
        lr_warmup_samples=args.lr_warmup_steps,
        lr_decay_samples=args.lr_decay_steps,
        wd_incr_samples=args.wd_incr_steps,
        weight_decay=args.weight_decay,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        log_interval=args.log_interval,
        eval_interval=args.eval_interval,
        eval_iters=args.eval_iters,
        save=args.save,
        load=args.load,
        save_interval=args.save_interval,
        tensorboard=_tensorboard_config(args),
        log_num_zeros_in_grad=args.log_num_zeros_in_grad,
        log_params_norm=args.log_params_norm,
        log_throughput=args.log_throughput,
        timing_log_option=args.timing_log_option,
        check_for_nan=args.check_for_nan_in_loss_and_grad,
        load_scope=LoadScope.from_args(args),
        exit_interval=args.exit_interval,
        exit_duration_in_mins=args.exit_duration_in_mins,
        manual_gc=args.manual_gc,
        manual_gc_interval=args.manual_gc_interval,
        manual_gc_eval=args.manual_gc_eval,
        empty_unused_memory_level=args.empty_unused_memory_level,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
    )


def _tensorboard_config(args: argparse.Namespace) -> Optional[TensorBoardConfig]:
    """--tensorboard-dir's scalars, also for --wandb-project (which gets the same ones)."""
    wandb = wandb_config_from_args(args)
    if args.tensorboard_dir is None and wandb is None:
        return None
    return TensorBoardConfig(
        directory=args.tensorboard_dir, wandb=wandb, log_interval=args.tensorboard_log_interval,
        queue_size=args.tensorboard_queue_size,
        learning_rate=args.log_learning_rate_to_tensorboard,
        loss_scale=args.log_loss_scale_to_tensorboard,
        batch_size=args.log_batch_size_to_tensorboard,
        world_size=args.log_world_size_to_tensorboard, memory=args.log_memory_to_tensorboard,
        validation_ppl=args.log_validation_ppl_to_tensorboard,
        timers=args.log_timers_to_tensorboard)


def optimizer_config_from_args(args: argparse.Namespace) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer=args.optimizer,
        sgd_momentum=args.sgd_momentum,
        lr=args.lr,
        min_lr=args.min_lr,
        # get_megatron_optimizer gives is_embedding_or_output_parameter their own param groups
        decoupled_lr=args.decoupled_lr,
        decoupled_min_lr=args.decoupled_min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        fp16=args.fp16,
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        params_dtype=params_dtype_from_args(args),
        use_distributed_optimizer=args.use_distributed_optimizer,
        log_num_zeros_in_grad=args.log_num_zeros_in_grad,
    )


def ddp_config_from_args(args: argparse.Namespace,
                         num_parameters: int = 0) -> DistributedDataParallelConfig:
    """num_parameters: this rank's, which --ddp-num-buckets divides (as Megatron-LM's get_model)."""
    bucket_size = getattr(args, "ddp_bucket_size", None)  # None: Megatron-Core's default
    if getattr(args, "ddp_num_buckets", None) is not None:
        bucket_size = max(1, num_parameters // args.ddp_num_buckets)
    return DistributedDataParallelConfig(
        # Megatron-LM's accumulate_allreduce_grads_in_fp32 (always for fp16 here); bf16 unless
        # --grad-reduce-in-bf16, which Megatron-LM ignores without --bf16.
        grad_reduce_in_fp32=args.fp16 or (args.bf16 and not args.grad_reduce_in_bf16),
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        align_param_gather=args.delay_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        bucket_size=bucket_size,
        pad_buckets_for_high_nccl_busbw=getattr(args, "ddp_pad_buckets_for_high_nccl_busbw",
                                                False),
    )
