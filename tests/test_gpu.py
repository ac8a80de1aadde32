"""On a GPU (marked `gpu`, skipped without one; `pytest -m gpu`): GPT and BERT train in bf16 at
pp=1 on one GPU with falling loss (GPT with --cuda-graph-impl local too), and the DPP runtime (tests/_runtime_harness.py: every rank a
thread, all on one GPU, CUDA tensors) runs under torch.cuda.set_sync_debug_mode("error"), so any
host-device synchronization per task fails it, and still computes the unpipelined gradients.
The suite's process is pinned to the CPU (conftest.py): the GPU work runs in subprocesses started
with _gpu.gpu_env(). pp>=2 with --use-dpp on GPUs is in test_dpp_parity.py."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from _gpu import gpu_env
from _train_util import TINY_GPT_ARGS, run_training
from test_bert_parity import TINY_BERT_ARGS, bert_data_args

ITERATIONS = 20
BF16_ONE_GPU = ["--bf16", "--pipeline-model-parallel-size", "1", "--train-iters", str(ITERATIONS),
                "--lr-warmup-iters", "2"]


def _assert_loss_falls(rc: int, losses: list[float], out: str) -> None:
    assert rc == 0, out[-3000:]
    assert len(losses) == ITERATIONS, out[-3000:]
    assert losses[-1] < losses[0], losses


@pytest.mark.gpu
@pytest.mark.timeout(420)
def test_gpt_bf16_trains_on_one_gpu():
    rc, losses, _, out = run_training(BF16_ONE_GPU, nproc=1, timeout=360, env=gpu_env(),
                                      base_args=TINY_GPT_ARGS)
    _assert_loss_falls(rc, losses, out)
    # Megatron-LM's memory line, once, at the first logged iteration
    memory = re.findall(r"\[Rank 0\] \(after \d+ iterations\) memory \(MB\) \| allocated: ([0-9.]+) "
                        r"\| max allocated: ([0-9.]+) \| reserved: [0-9.]+ \| max reserved: [0-9.]+", out)
    assert len(memory) == 1 and 0 < float(memory[0][0]) <= float(memory[0][1]), out[-3000:]


@pytest.mark.gpu
@pytest.mark.timeout(420)
def test_bert_bf16_trains_on_one_gpu():
    rc, losses, _, out = run_training(BF16_ONE_GPU, nproc=1, timeout=360, env=gpu_env(),
                                      with_data=False, base_args=[*bert_data_args(), *TINY_BERT_ARGS],
                                      entry="megatron_dpp.pretrain_bert")
    _assert_loss_falls(rc, losses, out)


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpt_cuda_graphs_train_as_eager_on_one_gpu():
    """--cuda-graph-impl local: the first iteration runs eagerly and records, then every layer's
    graphs replay; without dropout the losses follow the eager run's (bf16: the same kernels,
    replayed), and the evaluation (eager layers) runs."""
    flags = [*BF16_ONE_GPU, "--eval-interval", "10", "--eval-iters", "2"]
    rc, eager, _, out = run_training(flags, nproc=1, timeout=280, env=gpu_env(),
                                     base_args=TINY_GPT_ARGS)
    _assert_loss_falls(rc, eager, out)
    rc, graphed, _, out = run_training([*flags, "--cuda-graph-impl", "local"], nproc=1,
                                       timeout=280, env=gpu_env(), base_args=TINY_GPT_ARGS)
    _assert_loss_falls(rc, graphed, out)
    assert "kernels: CUDA graphs on: --cuda-graph-impl local" in out, out[-3000:]
    # At iterations 10 and 20, then after the last one (as Megatron-LM; no test split).
    assert out.count("validation loss at iteration") == 3, out[-3000:]
    assert out.count("validation loss at iteration 20 on validation set") == 1, out[-3000:]
    for step, (a, b) in enumerate(zip(eager, graphed), start=1):
        assert abs(a - b) <= 2e-2 * abs(a), (step, eager, graphed)


# Each case: (P, V, policy, tensor-parallel size, split backwards). Runs in one subprocess; prints
# "ok <case>" per case that ran without a synchronization and matched the reference.
_HARNESS_ON_GPU = r"""
import sys, traceback
import torch
from _runtime_harness import reference_grads, run_pipeline

SIZES = [3, 1, 4, 1, 5, 9, 2, 6]
CASES = [(2, 1, "dpp:adaptive", 1, False), (4, 1, "1f1b", 1, False),
         (2, 2, "dpp:adaptive", 1, False), (2, 2, "interleaved-1f1b", 1, False),
         (2, 2, "dpp:adaptive", 2, False), (2, 2, "dpp:adaptive", 1, True)]
torch.cuda.init()
for P, V, policy, tp, split in CASES:
    case = f"P={P} V={V} {policy} tp={tp} split={split}"
    result = run_pipeline(P, V, SIZES, policy, tp=tp, split_backward=split, device="cuda",
                          sync_debug_mode="error", timeout_s=60.0, join_s=120.0)
    for rank, error in sorted(result.errors.items()):
        print(f"{case}: rank {rank}:", "".join(traceback.format_exception(error)), file=sys.stderr)
    if result.errors:
        sys.exit(1)
    grads, losses = reference_grads(P, V, SIZES)
    assert sorted(result.grads) == sorted(grads), case
    for stage, grad in grads.items():
        assert result.grads[stage].is_cuda, case
        torch.testing.assert_close(result.grads[stage].cpu(), grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(losses), rtol=1e-4, atol=0)
    print("ok", case, flush=True)
"""


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_runtime_never_synchronizes_host_and_device_per_task():
    tests_dir = str(Path(__file__).resolve().parent)
    result = subprocess.run([sys.executable, "-c", _HARNESS_ON_GPU], cwd=tests_dir,
                            env=gpu_env(), capture_output=True,
                            text=True, timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert result.stdout.count("ok ") == 6, result.stdout
