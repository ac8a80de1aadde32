"""On one GPU (marked `gpu`; `pytest -m gpu`): a pipeline whose ranks share the GPU (the launcher's
--ranks-per-gpu 2: MPS, half the SMs each, gloo collectives, CUDA IPC between the stages). The tiny
GPT in bf16 at pp=2 trains with Megatron's 1F1B, with --use-dpp and with the V placement (split
backward), and their losses agree within bf16's tolerance (1e-3 relative), iteration by
iteration; the launcher's first line says what it did. Skipped where nvidia-cuda-mps-control is
not on PATH. The CPU side of the launcher is tests/test_ranks_per_gpu.py."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess

import pytest

from _gpu import gpu_env
from _train_util import PYTHON, REPO_ROOT, TINY_GPT_ARGS, _env, assert_losses_close, data_args, parse_log

ITERATIONS = 10
REL_TOL = 1e-3  # bf16
FLAGS = ["--bf16", "--pipeline-model-parallel-size", "2", "--train-iters", str(ITERATIONS)]
SCHEDULES = {
    "1f1b": [],
    "dpp": ["--use-dpp", "--dpp-timeout", "60"],
    "v": ["--use-dpp", "--dpp-timeout", "60", "--num-virtual-stages-per-pipeline-rank", "2",
          "--dpp-stage-placement", "v", "--dpp-split-backward"],
}


def _train_on_one_gpu(extra: list[str]) -> tuple[list[float], str]:
    command = [PYTHON, "-m", "megatron_dpp.rank_launcher", "--ranks-per-gpu", "2", "--standalone",
               "--nproc-per-node=2", "-m", "megatron_dpp.pretrain_gpt", *data_args(),
               *TINY_GPT_ARGS, *FLAGS, *extra]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=_env(gpu_env()), cwd=REPO_ROOT, start_new_session=True)
    try:
        out, _ = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, _ = process.communicate()
        raise AssertionError(f"the run did not finish within 240 s:\n{out[-4000:]}")
    assert process.returncode == 0, out[-4000:]
    return parse_log(out)[0], out


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_a_pipeline_on_one_gpu_trains_as_1f1b_with_dpp_and_the_v_placement():
    if shutil.which("nvidia-cuda-mps-control", path=gpu_env().get("PATH")) is None:
        pytest.skip("nvidia-cuda-mps-control is not on PATH (NVIDIA's MPS)")
    losses = {}
    for name, extra in SCHEDULES.items():
        losses[name], out = _train_on_one_gpu(extra)
        assert any(line.startswith("megatron_dpp.rank_launcher: ranks per GPU: 2 (rank r on GPU "
                                   "r // 2: 2 ranks on 1 GPU); MPS control daemon started")
                   for line in out.splitlines()), out[:2000]
        assert len(losses[name]) == ITERATIONS, out[-3000:]
    assert losses["1f1b"][-1] < losses["1f1b"][0]
    assert_losses_close(losses["dpp"], losses["1f1b"], REL_TOL)
    assert_losses_close(losses["v"], losses["1f1b"], REL_TOL)
