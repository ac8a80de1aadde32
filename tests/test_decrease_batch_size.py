"""--decrease-batch-size-if-needed, as Megatron-LM: a global batch (or a --rampup-batch-size step)
that micro-batches on every data-parallel rank cannot make up is trained as the largest multiple
below it. Checked: the batch of each iteration against Megatron-Core's calculators with the
option on; the flags' one-line errors; in training at dp=2, the line, the log's batch size and the
same losses as a run asked for the decreased batch (the learning-rate schedule counted in
samples)."""
import types

import pytest

from _train_util import TINY_GPT_ARGS, flag_error, run_training, without_flags
from megatron_dpp.training.batch_ramp import BatchSizeRamp
from megatron_dpp.training.config import global_batch_size_at


def _train(global_batch_size: int, micro_batch_times_data_parallel: int, ramp=None):
    """What global_batch_size_at reads of a TrainingConfig."""
    return types.SimpleNamespace(global_batch_size=global_batch_size, batch_ramp=ramp,
                                 micro_batch_times_data_parallel=micro_batch_times_data_parallel)


@pytest.mark.parametrize("global_batch_size, micro_batch_size, data_parallel_size",
                         [(10, 2, 2), (16, 1, 3), (7, 7, 1), (100, 4, 6)])
def test_a_constant_batch_decreases_as_megatron_cores(global_batch_size, micro_batch_size,
                                                      data_parallel_size):
    from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator

    calculator = ConstantNumMicroBatchesCalculator(
        global_batch_size, micro_batch_size, data_parallel_size,
        decrease_batch_size_if_needed=True, rank=1)
    train = _train(global_batch_size, micro_batch_size * data_parallel_size)
    assert global_batch_size_at(train, 0) == calculator.get_current_running_global_batch_size()


@pytest.mark.parametrize("start, increment, samples, final, micro_batch_size, data_parallel_size",
                         [(4, 2, 7, 10, 1, 3), (5, 5, 60, 45, 2, 2), (16, 16, 1000, 64, 2, 3)])
def test_a_ramps_batches_decrease_as_megatron_cores(start, increment, samples, final,
                                                    micro_batch_size, data_parallel_size):
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

    calculator = RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size=final, micro_batch_size=micro_batch_size,
        data_parallel_size=data_parallel_size, decrease_batch_size_if_needed=True, rank=1,
        start_global_batch_size=start, batch_size_increment=increment, ramup_samples=samples)
    train = _train(final, micro_batch_size * data_parallel_size,
                   BatchSizeRamp(start, increment, samples, final))
    consumed = 0
    while consumed <= 2 * samples:  # the run's own walk: each iteration adds the batch trained
        calculator.update(consumed, consistency_check=True)
        batch = global_batch_size_at(train, consumed)
        assert batch == calculator.get_current_running_global_batch_size(), consumed
        consumed += batch


def test_flag_errors(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    batch = ["--micro-batch-size", "2", "--global-batch-size", "5"]
    assert flag_error(capsys, [*TINY_GPT_ARGS, *batch]) == (
        "megatron_dpp.pretrain_gpt: error: --global-batch-size 5 is not divisible by "
        "--micro-batch-size 2 x data-parallel size 2; "
        "use a multiple of 4 (or --decrease-batch-size-if-needed to train with 4)")
    small = ["--micro-batch-size", "2", "--global-batch-size", "3"]
    assert "is below one micro-batch on each data-parallel rank" in flag_error(
        capsys, [*TINY_GPT_ARGS, *small, "--decrease-batch-size-if-needed"])
    ramp = ["--micro-batch-size", "2", "--global-batch-size", "12", "--train-samples", "100",
            "--lr-warmup-samples", "0", "--rampup-batch-size", "2", "2", "20"]
    no_iters = without_flags(TINY_GPT_ARGS, "--train-iters", "--lr-warmup-iters")
    assert "make START and INCREMENT multiples of 4 (or add --decrease-batch-size-if-needed)" in \
        flag_error(capsys, [*no_iters, *ramp])
    assert "--rampup-batch-size starts at a global batch of 2, below one micro-batch" in \
        flag_error(capsys, [*no_iters, *ramp, "--decrease-batch-size-if-needed"])


# Sample-counted lengths: the schedule is the same whatever batch is asked for.
_BY_SAMPLES = [*without_flags(TINY_GPT_ARGS, "--train-iters", "--lr-warmup-iters"),
               "--micro-batch-size", "2", "--lr-warmup-samples", "8", "--lr-decay-samples", "40"]


@pytest.mark.timeout(300)
def test_training_with_a_decreased_batch_is_training_with_that_batch():
    rc, decreased, _, out = run_training(["--global-batch-size", "5", "--train-samples", "20",
                                          "--decrease-batch-size-if-needed"],
                                         base_args=_BY_SAMPLES)
    assert rc == 0, out[-3000:]
    assert (" decreasing batch size from 5 to 4 to keep divisibility by micro_batch_size=2 * "
            "data_parallel_size=2 (--decrease-batch-size-if-needed)") in out
    assert " training: 4 iterations, global batch 4," in out  # 20 // 5, as Megatron-LM counts
    assert out.count("global batch size:     4 |") == 4
    rc, asked, _, out = run_training(["--global-batch-size", "4", "--train-samples", "16"],
                                     base_args=_BY_SAMPLES)
    assert rc == 0, out[-3000:]
    assert "decreasing batch size" not in out
    assert decreased == asked and len(asked) == 4


@pytest.mark.timeout(300)
def test_training_through_a_ramp_trains_each_decreased_batch():
    import re

    rc, losses, _, out = run_training(["--global-batch-size", "12", "--train-samples", "60",
                                       "--rampup-batch-size", "6", "3", "24",
                                       "--decrease-batch-size-if-needed"], base_args=_BY_SAMPLES)
    assert rc == 0, out[-3000:]
    batches = [int(x) for x in re.findall(r"\| global batch size: +(\d+) \|", out)]
    train = _train(12, 4, BatchSizeRamp(6, 3, 24, 12))
    expected, consumed = [], 0
    for _ in batches:
        expected.append(global_batch_size_at(train, consumed))
        consumed += expected[-1]
    assert batches == expected and expected[:4] == [4, 4, 4, 8] and expected[-1] == 12, out[-3000:]
    assert len(losses) == len(batches) > 3
