"""--ddp-bucket-size and --ddp-num-buckets (Megatron-LM's): the gradient buckets that
--overlap-grad-reduce reduces one by one as backward fills them.

- Megatron-Core's DistributedDataParallel built with our DDP config makes the buckets asked for;
- two data-parallel ranks with small buckets train the default run's losses, bit for bit (each
  element is summed the same way, whatever bucket it is in), under Megatron's 1F1B and --use-dpp;
- the flag errors, one line each.
"""
import pytest
import torch

from _one_rank import one_rank_megatron
from _train_util import TINY_GPT_ARGS, data_args, flag_error, run_training


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    with one_rank_megatron(tmp_path_factory.mktemp("ddp")):
        yield


def _buckets(flags) -> int:
    """Buckets of Megatron-Core's DDP over 8 linear layers of 32 x 32 (+ bias: 1056 elements
    each), with the DDP config the trainer builds from `flags`."""
    import argparse

    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer import TransformerConfig

    from megatron_dpp.training.config import ddp_config_from_args

    args = argparse.Namespace(**{
        "bf16": False, "fp16": False, "overlap_grad_reduce": True, "overlap_param_gather": False,
        "delay_param_gather": False, "use_distributed_optimizer": False, "ddp_bucket_size": None,
        "ddp_num_buckets": None, **flags})
    module = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(8)])
    count = sum(param.nelement() for param in module.parameters())
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=1)
    ddp = DistributedDataParallel(config, ddp_config_from_args(args, count), module=module)
    return sum(len(buffer.buckets) for buffer in ddp.buffers)


def test_buckets_are_the_ones_asked_for(megatron):
    assert _buckets({}) == 1  # Megatron-Core's default, 40M elements
    assert _buckets({"ddp_bucket_size": 2 * 1056}) == 4  # two layers a bucket
    assert _buckets({"ddp_num_buckets": 8}) == 8  # 8448 / 8 = one layer a bucket


DP2 = ["--overlap-grad-reduce", "--train-iters", "3"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["1f1b", "dpp"])
def test_small_buckets_train_the_same_losses(schedule):
    flags = [*DP2, "--pipeline-model-parallel-size", "2"]
    if schedule == "dpp":
        flags += ["--use-dpp", "--dpp-timeout", "60"]
    rc, default, _n, out = run_training(flags, nproc=4, timeout=240)
    assert rc == 0 and len(default) == 3, out[-3000:]
    rc, small, _n, out = run_training([*flags, "--ddp-bucket-size", "5000"], nproc=4, timeout=240)
    assert rc == 0, out[-3000:]
    assert small == default


@pytest.mark.parametrize("flags, words", [
    (["--ddp-bucket-size", "1000"], "--ddp-bucket-size sizes the buckets --overlap-grad-reduce "
                                    "reduces one by one; without it the gradients are reduced as "
                                    "one bucket: add --overlap-grad-reduce or remove "
                                    "--ddp-bucket-size"),
    (["--overlap-grad-reduce", "--ddp-bucket-size", "1000", "--ddp-num-buckets", "4"],
     "give --ddp-bucket-size or --ddp-num-buckets, not both"),
    (["--overlap-grad-reduce", "--ddp-num-buckets", "0"], "--ddp-num-buckets must be positive"),
])
def test_flag_errors(monkeypatch, capsys, flags, words):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    line = flag_error(capsys, [*data_args(), *TINY_GPT_ARGS, *flags])
    assert words in line, line
