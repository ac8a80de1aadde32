"""torch's fused AdamW where Megatron-Core falls back to torch's AdamW on a GPU
(kernels.torch_fused_adam, mcore.optimizer.set_torch_adam_implementation):

(a) the choice: Adam on a CUDA machine without Transformer Engine or Apex, said in the
    `kernels: fused optimizer` line; torch's default on the CPU, with SGD, or where Megatron-Core
    imports a FusedAdam of its own;
(b) switching an optimizer: every group fused (or back on torch's default), every parameter's step
    counter a tensor of its own on the right device, so that a counter Megatron-Core's distributed
    optimizer shares among parameters on load is not advanced once per parameter;
(c) training with it on the CPU, where torch has the fused kernel too (tests/_fused_adam_entry.py
    chooses it as a GPU run does): the default run's losses within 1e-6 relative (another order of
    the same arithmetic), a run saved at iteration 3 resumes to the uninterrupted losses bit for
    bit, with the plain and the distributed optimizer, and a checkpoint of a default run resumes
    fused. The entry records which kernel each step ran: the tests check that, not the losses'
    last digits (which another torch build may leave equal).
"""
from __future__ import annotations

import re
import types

import pytest
import torch

from _train_util import assert_losses_close, run_training

FUSED_ENTRY = "tests._fused_adam_entry"
SCHEDULE = ["--lr-decay-iters", "6"]
DIST_OPT = ["--use-distributed-optimizer"]


# ----------------------------------------------------------------------------------------------
# (a) the choice
# ----------------------------------------------------------------------------------------------
def test_the_choice(monkeypatch):
    from megatron_dpp import kernels

    adam, sgd = types.SimpleNamespace(optimizer="adam"), types.SimpleNamespace(optimizer="sgd")
    monkeypatch.setattr(kernels, "_megatron_fused_optimizer_library", lambda: None)
    monkeypatch.setattr(kernels, "cuda_available", lambda: True)
    assert kernels.torch_fused_adam("adam") and not kernels.torch_fused_adam("sgd")
    line = kernels._fused_optimizer(adam).line()
    assert line.startswith("kernels: fused optimizer on: torch's fused AdamW"), line
    assert kernels._fused_optimizer(sgd).line().startswith("kernels: fused optimizer off: torch SGD")
    monkeypatch.setattr(kernels, "_megatron_fused_optimizer_library", lambda: "Apex")
    assert not kernels.torch_fused_adam("adam")  # Megatron-Core uses Apex's FusedAdam
    assert kernels._fused_optimizer(adam).line() == (
        "kernels: fused optimizer on: Apex's FusedAdam and multi-tensor kernels")
    monkeypatch.setattr(kernels, "_megatron_fused_optimizer_library", lambda: None)
    monkeypatch.setattr(kernels, "cuda_available", lambda: False)
    assert not kernels.torch_fused_adam("adam")
    assert kernels._fused_optimizer(adam).line().startswith("kernels: fused optimizer off: torch Adam")


# ----------------------------------------------------------------------------------------------
# (b) switching an optimizer
# ----------------------------------------------------------------------------------------------
def _params():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(7, 5, generator=generator).requires_grad_(),
            torch.randn(5, generator=generator).requires_grad_()]


def _steps(optimizer, params, count: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()


def test_switching_to_fused_and_back():
    from megatron_dpp.mcore.optimizer import set_torch_adam_implementation

    params, reference_params = _params(), _params()
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    reference = torch.optim.AdamW(reference_params, lr=1e-2, weight_decay=0.1)
    _steps(optimizer, params, 2, seed=1)
    _steps(reference, reference_params, 2, seed=1)
    # As Megatron-Core's distributed optimizer leaves it after a load: one step tensor shared.
    shared = torch.tensor(2.0)
    for param in params:
        optimizer.state[param]["step"] = shared

    assert set_torch_adam_implementation(optimizer, fused=True) == 1
    group = optimizer.param_groups[0]
    assert group["fused"] is True and group["foreach"] is False
    steps = [optimizer.state[param]["step"] for param in params]
    assert steps[0] is not steps[1] and steps[0] is not shared
    assert all(step.dtype == torch.float32 and step.device == param.device and step.item() == 2
               for step, param in zip(steps, params))
    _steps(optimizer, params, 2, seed=2)
    _steps(reference, reference_params, 2, seed=2)
    # Each counter advanced once per step (a shared one would have been advanced twice per step).
    assert [optimizer.state[param]["step"].item() for param in params] == [4.0, 4.0]
    for ours, theirs in zip(params, reference_params):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)

    assert set_torch_adam_implementation(optimizer, fused=False) == 1
    assert group["fused"] is None and group["foreach"] is None
    assert all(optimizer.state[param]["step"].device.type == "cpu" for param in params)
    _steps(optimizer, params, 1, seed=3)
    assert [optimizer.state[param]["step"].item() for param in params] == [5.0, 5.0]


def test_only_torch_adams_inside_megatrons_wrappers_are_switched():
    from megatron_dpp.mcore.optimizer import set_torch_adam_implementation, torch_adams

    adam = torch.optim.AdamW(_params())
    sgd = torch.optim.SGD(_params(), lr=0.1)
    chained = types.SimpleNamespace(chained_optimizers=[types.SimpleNamespace(optimizer=adam),
                                                        types.SimpleNamespace(optimizer=sgd)])
    assert torch_adams(chained) == [adam]
    assert torch_adams(types.SimpleNamespace(optimizer=sgd)) == []
    assert set_torch_adam_implementation(chained, fused=True) == 1
    assert "fused" not in sgd.param_groups[0] or not sgd.param_groups[0]["fused"]


# ----------------------------------------------------------------------------------------------
# (c) training with it
# ----------------------------------------------------------------------------------------------
def _train(flags, fused: bool, nproc: int = 2):
    rc, losses, _norms, out = run_training([*SCHEDULE, *flags], nproc=nproc,
                                           entry=FUSED_ENTRY if fused else
                                           "megatron_dpp.pretrain_gpt")
    assert rc == 0, out[-3000:]
    assert ("fused optimizer on: torch's fused AdamW" in out) == fused, out[-3000:]
    return losses, out


def _steps_fused(out: str) -> list[list[bool]]:
    """Each rank's `fused adam steps: [...]` (tests/_fused_adam_entry.py): per optimizer step,
    whether torch's fused kernel ran in it."""
    return [[word == "True" for word in re.findall(r"True|False", found)]
            for found in re.findall(r"fused adam steps: \[([^\]]*)\]", out)]


@pytest.fixture(scope="module")
def default_losses():
    return _train(["--train-iters", "6"], fused=False)[0]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("optimizer", ["plain", "distributed"])
def test_fused_training_resumes_bit_for_bit(tmp_path, default_losses, optimizer):
    flags = DIST_OPT if optimizer == "distributed" else []
    uninterrupted, out = _train([*flags, "--train-iters", "6"], fused=True)
    assert _steps_fused(out) == [[True] * 6] * 2, out[-3000:]
    assert_losses_close(uninterrupted, default_losses, rel=1e-6)
    save = str(tmp_path / "ckpt")
    first, _ = _train([*flags, "--train-iters", "3", "--save", save], fused=True)
    assert first == uninterrupted[:3]
    resumed, out = _train([*flags, "--train-iters", "6", "--load", save], fused=True)
    assert "loaded checkpoint" in out
    assert resumed == uninterrupted[3:]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("optimizer", ["plain", "distributed"])
def test_a_default_runs_checkpoint_resumes_fused(tmp_path, default_losses, optimizer):
    flags = DIST_OPT if optimizer == "distributed" else []
    save = str(tmp_path / "ckpt")
    _train([*flags, "--train-iters", "3", "--save", save], fused=False)
    resumed, out = _train([*flags, "--train-iters", "6", "--load", save], fused=True)
    assert "loaded checkpoint" in out
    assert_losses_close(resumed, default_losses[3:], rel=1e-6)
    # The load gave the groups the saving run's implementation; the fused kernel ran after it
    # all the same, in each of the three steps, on every rank.
    assert _steps_fused(out) == [[True] * 3] * 2, out[-3000:]
