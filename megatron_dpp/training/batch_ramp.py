"""--rampup-batch-size START INCREMENT SAMPLES: the global batch grows from START by INCREMENT to
--global-batch-size over the first SAMPLES samples, by the rule of Megatron-Core's
RampupBatchsizeNumMicroBatchesCalculator (megatron/core/num_microbatches_calculator.py), and the
run's iteration count is Megatron-LM's update_train_iters (megatron/training/training.py): the
ramp's iterations, then --train-samples' remaining full batches.

tests/test_batch_ramp.py compares the sizes with Megatron-Core's calculator. Standard library
only: the flag check before launch uses it.
"""
from __future__ import annotations

from dataclasses import dataclass


def running_batch(global_batch_size: int, micro_batch_times_data_parallel: int) -> int:
    """The batch trained for a global batch asked for: itself where micro-batches on every
    data-parallel rank make it up, else (--decrease-batch-size-if-needed) the largest multiple
    below it, as Megatron-Core's calculators round it (0: not even one)."""
    return global_batch_size // micro_batch_times_data_parallel * micro_batch_times_data_parallel


@dataclass(frozen=True)
class BatchSizeRamp:
    start: int  # the first iterations' global batch
    increment: int  # added at each step of the ramp
    samples: int  # consumed samples over which the batch reaches `final`
    final: int  # --global-batch-size

    @property
    def sizes(self) -> range:
        """Every global batch size the run trains with."""
        return range(self.start, self.final + 1, self.increment)

    def global_batch_size(self, consumed_samples: int) -> int:
        """The global batch of the iteration that starts after `consumed_samples` samples."""
        if consumed_samples > self.samples:
            return self.final
        samples_per_increment = self.samples / ((self.final - self.start) // self.increment)
        return self.start + int(consumed_samples / samples_per_increment) * self.increment

    def train_iters(self, train_samples: int) -> int:
        """Megatron-LM's iteration count for --train-samples: the iterations of the ramp (the
        last may end past SAMPLES, or past train_samples), then the full batches that fit in the
        rest (a partial last batch is dropped)."""
        iterations = consumed = 0
        while consumed <= self.samples and consumed <= train_samples:
            consumed += self.global_batch_size(consumed)
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.final
        return iterations

    def samples_consumed(self, iterations: int) -> int:
        """Samples that `iterations` iterations from the start train on."""
        consumed = 0
        for _ in range(iterations):
            consumed += self.global_batch_size(consumed)
        return consumed
