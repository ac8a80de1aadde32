"""--deterministic-mode as Megatron-LM's: Megatron-Core's deterministic_mode in the config, torch's
deterministic algorithms on every rank, and Megatron-LM's refusals (flash attention, the fused
cross entropy, NCCL without a fixed all-reduce algorithm), each one line."""
from __future__ import annotations

import argparse

import pytest

from _train_util import TINY_GPT_ARGS, data_args, run_training

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
        "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3"]


def _parse(extra, monkeypatch):
    from megatron_dpp.arguments import parse_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    return parse_args([*data_args(), *BASE, *extra], model="gpt")


def test_the_config_has_megatron_cores_deterministic_mode(monkeypatch):
    from megatron_dpp.training.config import transformer_config_from_args

    assert transformer_config_from_args(_parse(["--deterministic-mode"], monkeypatch)).deterministic_mode
    assert not transformer_config_from_args(_parse([], monkeypatch)).deterministic_mode


def test_the_fused_cross_entropy_is_refused_in_one_line(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exited:
        _parse(["--deterministic-mode", "--cross-entropy-loss-fusion"], monkeypatch)
    assert exited.value.code == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and "remove --cross-entropy-loss-fusion" in errors[0], errors


@pytest.mark.parametrize("algorithm, refused", [(None, True), ("Auto", True), ("Ring", False),
                                                ("Tree", False), ("^NVLS", False)])
def test_nccl_needs_a_fixed_all_reduce_algorithm(monkeypatch, algorithm, refused):
    from megatron_dpp.models.flags import deterministic_mode_obstacle

    if algorithm is None:
        monkeypatch.delenv("NCCL_ALGO", raising=False)
    else:
        monkeypatch.setenv("NCCL_ALGO", algorithm)
    args = argparse.Namespace(use_flash_attn=False, cross_entropy_loss_fusion=False,
                              distributed_backend="nccl")
    obstacle = deterministic_mode_obstacle(args)
    assert (obstacle is not None) == refused, obstacle
    if refused:
        assert "NCCL_ALGO" in obstacle and "Ring" in obstacle
    # gloo reduces in a fixed order: no NCCL_ALGO needed.
    assert deterministic_mode_obstacle(argparse.Namespace(
        use_flash_attn=False, cross_entropy_loss_fusion=False, distributed_backend="gloo")) is None
    flash = argparse.Namespace(use_flash_attn=True, cross_entropy_loss_fusion=False,
                               distributed_backend="gloo")
    assert "remove --use-flash-attn" in deterministic_mode_obstacle(flash)


@pytest.mark.timeout(240)
def test_a_pipeline_trains_under_torchs_deterministic_algorithms():
    """pp=2 with --use-dpp: every op of a step has a deterministic implementation (torch raises
    where one has none), the line says the mode is on, and the losses are the default run's
    (CPU kernels are deterministic already)."""
    flags = ["--pipeline-model-parallel-size", "2", "--use-dpp", "--train-iters", "3"]
    rc, plain, _, out = run_training(flags, nproc=2)
    assert rc == 0, out[-3000:]
    rc, deterministic, _, out = run_training([*flags, "--deterministic-mode"], nproc=2)
    assert rc == 0, out[-3000:]
    assert "deterministic mode: torch's deterministic algorithms" in out, out[-3000:]
    assert deterministic == plain and len(plain) == 3
    assert "--deterministic-mode" not in TINY_GPT_ARGS
