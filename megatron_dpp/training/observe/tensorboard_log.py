"""Megatron-LM's TensorBoard scalars (--tensorboard-dir), and the same ones to Weights & Biases
(--wandb-project, training/observe/wandb_log.py): the same tags, written by the rank that prints the log line (the last pipeline stage's first tensor- and data-parallel rank; Megatron-LM
writes from the last rank, which holds the same values).

Every --tensorboard-log-interval iterations: each reported loss (`lm loss`, BERT's `sop loss`),
`learning-rate`, `loss-scale`, `grad-norm` (with --clip-grad), `num-zeros` (with
--log-num-zeros-in-grad), `params-norm` (with --log-params-norm), `batch-size` (with
--log-batch-size-to-tensorboard), `world-size` (with --log-world-size-to-tensorboard), and GPU
memory (`mem-reserved-bytes`, `mem-allocated-bytes`, `mem-max-allocated-bytes`,
`mem-allocated-count`, with --log-memory-to-tensorboard), each also as `<tag> vs samples` over the
consumed samples (W&B: the iteration's only, as Megatron-LM). At each logged iteration, with
--log-timers-to-tensorboard: `iteration-time`, `throughput` (with --log-throughput) and
`<timer>-time` for each timer of --timing-log-level (training/observe/timers.py). After each
evaluation: `lm loss validation` (and `lm loss validation ppl` with
--log-validation-ppl-to-tensorboard), with their `vs samples`; after training, as Megatron-LM,
the test split's loss under the same tags, and under --skip-train nothing. Reading the losses every interval
makes the host wait for the device once per written iteration, as in Megatron-LM.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from megatron_dpp.training.observe.wandb_log import WandbConfig, WandbRun


@dataclass(frozen=True)
class TensorBoardConfig:
    """--tensorboard-dir, --wandb-project and the flags that choose what they get."""

    directory: Optional[str]  # --tensorboard-dir (None: W&B only)
    wandb: Optional[WandbConfig]  # --wandb-project (None: TensorBoard only)
    log_interval: int  # --tensorboard-log-interval
    queue_size: int  # --tensorboard-queue-size: events buffered before a write to disk
    learning_rate: bool  # not --no-log-learnig-rate-to-tensorboard (Megatron-LM's spelling)
    loss_scale: bool  # not --no-log-loss-scale-to-tensorboard
    batch_size: bool  # --log-batch-size-to-tensorboard
    world_size: bool  # --log-world-size-to-tensorboard
    memory: bool  # --log-memory-to-tensorboard (CUDA only)
    validation_ppl: bool  # --log-validation-ppl-to-tensorboard
    timers: bool  # --log-timers-to-tensorboard (written at logged iterations)

    def wants(self, iteration: int) -> bool:
        """Whether this iteration's scalars are written (every rank knows it: collectives such
        as --log-params-norm's run where they are)."""
        return iteration % self.log_interval == 0


class TensorBoardLog:
    def __init__(self, config: TensorBoardConfig, world_size: int):
        self.config = config
        self.world_size = world_size
        self.writer = None
        if config.directory is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=config.directory, max_queue=config.queue_size)
        self.wandb = WandbRun(config.wandb) if config.wandb is not None else None

    def _scalar(self, tag: str, value: float, iteration: int,
                samples: Optional[int] = None) -> None:
        """The scalar at the iteration, and in TensorBoard also `<tag> vs samples`."""
        if self.writer is not None:
            self.writer.add_scalar(tag, value, iteration)
            if samples is not None:
                self.writer.add_scalar(f"{tag} vs samples", value, samples)
        if self.wandb is not None:
            self.wandb.scalar(tag, value, iteration)

    def wants(self, iteration: int) -> bool:
        return self.config.wants(iteration)

    def training(self, iteration: int, samples: int, losses: dict, learning_rate: float,
                 loss_scale: float, grad_norm: Optional[float], batch_size: int,
                 num_zeros: Optional[float] = None,
                 params_norm: Optional[float] = None) -> None:
        """losses: {name: (mean, count)}, as ReducedLosses.read gives them."""
        config = self.config
        if config.learning_rate:
            self._scalar("learning-rate", learning_rate, iteration, samples)
        if config.batch_size:
            self._scalar("batch-size", batch_size, iteration, samples)
        for name, (value, _count) in losses.items():
            self._scalar(name, value, iteration, samples)
        if config.loss_scale:
            self._scalar("loss-scale", loss_scale, iteration, samples)
        if config.world_size:
            self._scalar("world-size", self.world_size, iteration, samples)
        if grad_norm is not None:
            self._scalar("grad-norm", grad_norm, iteration, samples)
        if num_zeros is not None:
            self._scalar("num-zeros", num_zeros, iteration, samples)
        if params_norm is not None:
            self._scalar("params-norm", params_norm, iteration, samples)
        if config.memory:
            import torch

            stats = torch.cuda.memory_stats()
            for tag, key in (("mem-reserved-bytes", "reserved_bytes.all.current"),
                             ("mem-allocated-bytes", "allocated_bytes.all.current"),
                             ("mem-max-allocated-bytes", "allocated_bytes.all.peak"),
                             ("mem-allocated-count", "allocation.all.current")):
                self._scalar(tag, stats.get(key, 0), iteration)

    def timers(self, iteration: int, iteration_seconds: float, throughput: Optional[float],
               timer_seconds: dict) -> None:
        """--log-timers-to-tensorboard at a logged iteration, as Megatron-LM: iteration-time,
        throughput (with --log-throughput, TFLOP/s per GPU) and `<timer>-time` for each timer
        (its max over the ranks), in seconds per iteration."""
        self._scalar("iteration-time", iteration_seconds, iteration)
        if throughput is not None:
            self._scalar("throughput", throughput, iteration)
        for name, seconds in timer_seconds.items():
            self._scalar(f"{name}-time", seconds, iteration)

    def validation(self, iteration: int, samples: int, lm_loss: float) -> None:
        self._scalar("lm loss validation", lm_loss, iteration, samples)
        if self.config.validation_ppl:
            self._scalar("lm loss validation ppl", math.exp(min(20.0, lm_loss)), iteration,
                         samples)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
