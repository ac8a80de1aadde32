"""--rampup-batch-size START INCREMENT SAMPLES, as Megatron-LM: the global batch of each iteration
against Megatron-Core's RampupBatchsizeNumMicroBatchesCalculator, the iteration count against
Megatron-LM's update_train_iters (driven here through that calculator), the flags' one-line
errors, and training: the ramp's batches in the log, --use-dpp against Megatron's schedule, and a
resume in the middle of the ramp continuing the uninterrupted run."""
import re

import pytest

from _train_util import TINY_GPT_ARGS, data_args, flag_error, run_training, without_flags
from megatron_dpp.training.batch_ramp import BatchSizeRamp

RAMPS = [(16, 16, 1000, 64), (8, 8, 100, 8 * 7), (2, 2, 24, 8), (4, 2, 7, 10)]


def _megatron_calculator(ramp: BatchSizeRamp):
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

    return RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size=ramp.final, micro_batch_size=1, data_parallel_size=1,
        decrease_batch_size_if_needed=False, rank=1, start_global_batch_size=ramp.start,
        batch_size_increment=ramp.increment, ramup_samples=ramp.samples)


@pytest.mark.parametrize("start, increment, samples, final", RAMPS)
def test_the_batch_of_each_iteration_is_megatron_cores(start, increment, samples, final):
    ramp = BatchSizeRamp(start, increment, samples, final)
    calculator = _megatron_calculator(ramp)
    for consumed in range(0, 2 * samples + final):
        calculator.update(consumed, consistency_check=False)
        assert ramp.global_batch_size(consumed) == calculator.get_current_global_batch_size(), \
            consumed


@pytest.mark.parametrize("start, increment, samples, final", RAMPS)
def test_the_iteration_count_is_megatron_lms(start, increment, samples, final):
    ramp = BatchSizeRamp(start, increment, samples, final)
    calculator = _megatron_calculator(ramp)
    for train_samples in (start, samples // 2 + 1, samples, samples + 1, 3 * samples + 5):
        # megatron/training/training.py's update_train_iters, at core_v0.16.1.
        iterations = consumed = 0
        while consumed <= samples and consumed <= train_samples:
            calculator.update(consumed, consistency_check=False)
            consumed += calculator.get_current_global_batch_size()
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // final
        assert ramp.train_iters(train_samples) == iterations
        assert ramp.samples_consumed(iterations) >= min(train_samples, consumed)


def _error(monkeypatch, capsys, *flags, base=TINY_GPT_ARGS):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    return flag_error(capsys, [*data_args(), *base, *flags])


def _samples_base():
    return [*without_flags(TINY_GPT_ARGS, "--train-iters", "--lr-warmup-iters"),
            "--train-samples", "64"]


def test_flag_errors(monkeypatch, capsys):
    samples = _samples_base()  # global batch 8, micro-batch 1; two ranks: data-parallel 2
    cases = [
        (["--rampup-batch-size", "2", "2", "24"], TINY_GPT_ARGS,
         "--rampup-batch-size counts samples: give --train-samples"),
        (["--rampup-batch-size", "8", "2", "24"], samples,
         "--rampup-batch-size starts at 8, not below --global-batch-size 8"),
        (["--rampup-batch-size", "2", "4", "24"], samples,
         "INCREMENT 4 does not divide --global-batch-size 8 - START 2 = 6"),
        (["--rampup-batch-size", "3", "5", "24"], samples,
         "reaches a global batch of 3, not divisible by --micro-batch-size 1 x data-parallel "
         "size 2"),
        (["--rampup-batch-size", "0", "2", "24"], samples, "must be positive, got 0 2 24"),
        (["--rampup-batch-size", "2", "2"], samples, "expected 3 arguments"),
    ]
    for flags, base, line in cases:
        assert line in _error(monkeypatch, capsys, *flags, base=base), flags


def _batches(out):
    return [int(x) for x in re.findall(r"\| global batch size: +(\d+) \|", out)]


def _consumed(out):
    return [int(x) for x in re.findall(r"consumed samples: +(\d+) \|", out)]


@pytest.mark.timeout(400)
def test_training_through_the_ramp(tmp_path):
    # Global batch 2 from 0 samples, 4 from 8, 6 from 16, 8 past 24: 12 iterations for 64
    # samples (Megatron-LM's count: 2 2 2 2 4 4 6 6 8 8 8 8). Micro-batch 1 at pp=2.
    flags = ["--rampup-batch-size", "2", "2", "24", "--pipeline-model-parallel-size", "2"]
    base = _samples_base()
    rc, megatron, _n, out = run_training(flags, nproc=2, base_args=base)
    assert rc == 0, out[-3000:]
    ramp = BatchSizeRamp(2, 2, 24, 8)
    iterations = ramp.train_iters(64)
    assert len(megatron) == iterations == 12
    expected = [ramp.global_batch_size(ramp.samples_consumed(i)) for i in range(iterations)]
    assert _batches(out) == expected and expected[0] == 2 and expected[-1] == 8
    assert len(set(expected)) == 4  # every size of the ramp trained
    assert _consumed(out) == [ramp.samples_consumed(i + 1) for i in range(iterations)]
    assert " ramping up batch size from 2 to 4" in out
    rc, dpp, _n, out = run_training([*flags, "--use-dpp"], nproc=2, base_args=base)
    assert rc == 0, out[-3000:]
    assert dpp == pytest.approx(megatron, rel=1e-6)
    assert _batches(out) == expected

    # Saved in the middle of the ramp (after iteration 3: 12 samples), resumed to the end.
    save = str(tmp_path / "ckpt")
    rc, first, _n, out = run_training([*flags, "--save", save, "--exit-interval", "3"], nproc=2,
                                      base_args=base)
    assert rc == 0 and len(first) == 3, out[-3000:]
    rc, rest, _n, out = run_training([*flags, "--load", save], nproc=2, base_args=base)
    assert rc == 0, out[-3000:]
    assert _batches(out) == expected[3:]
    assert first + rest == pytest.approx(megatron, rel=1e-6)
