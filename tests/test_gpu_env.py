"""The suite's CPU pinning (conftest.py, tests/_gpu.py): the test process and what it starts see no
GPU and skip torch.compile; gpu_env() gives GPU tests the machine's CUDA_VISIBLE_DEVICES and
TORCHDYNAMO_DISABLE back (set or unset); and a CPU training step compiles nothing, so skipping
torch.compile changes nothing that the CPU tests check."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = str(Path(__file__).resolve().parent)

_PIN_AND_RESTORE = """
import os, _gpu
_gpu.pin_to_cpu()
_gpu.pin_to_cpu()  # twice: the machine's value is remembered once
for name in ("CUDA_VISIBLE_DEVICES", "TORCHDYNAMO_DISABLE"):
    print(repr(os.environ[name]), repr(_gpu.gpu_env().get(name)))
"""


def test_tests_and_their_processes_run_without_gpus():
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    child = subprocess.run([sys.executable, "-c", "import os, torch; "
                            "print(repr(os.environ['CUDA_VISIBLE_DEVICES']), torch.cuda.device_count())"],
                           capture_output=True, text=True, timeout=60)
    assert child.stdout.split() == ["''", "0"], child.stderr


@pytest.mark.parametrize("machine,restored", [("1,3", "'1,3'"), (None, "None")])
def test_gpu_env_restores_the_machines_setting(machine, restored):
    pinned = ("CUDA_VISIBLE_DEVICES", "TORCHDYNAMO_DISABLE")
    env = {name: value for name, value in os.environ.items() if name not in pinned}
    if machine is not None:
        env["CUDA_VISIBLE_DEVICES"] = machine
        env["TORCHDYNAMO_DISABLE"] = "0"
    result = subprocess.run([sys.executable, "-c", _PIN_AND_RESTORE], capture_output=True,
                            text=True, timeout=60, cwd=TESTS, env=env)
    assert result.returncode == 0, result.stderr
    dynamo_restored = "'0'" if machine is not None else "None"
    assert result.stdout.split() == ["''", restored, "'1'", dynamo_restored]


_TRAIN_STEP_COUNTING_COMPILES = """
import sys
sys.path.insert(0, "benchmarks")
import torch._dynamo.utils as dynamo_utils
import host_overhead
args = host_overhead.resolve(host_overhead.build_parser().parse_args(["--quick", "--target", "ours"]))
host_overhead.measure_ours(args)
print("compiled frames", dict(dynamo_utils.counters["frames"]), dict(dynamo_utils.counters["stats"]))
"""


@pytest.mark.timeout(300)
def test_a_cpu_training_step_compiles_nothing():
    """With torch.compile on (as users run), our GPT training iterations on the CPU (forward,
    backward, optimizer step, loss and stop agreement) call nothing torch.compile'd: the CPU tests
    lose nothing by skipping torch.compile."""
    env = {name: value for name, value in os.environ.items() if name != "TORCHDYNAMO_DISABLE"}
    result = subprocess.run([sys.executable, "-c", _TRAIN_STEP_COUNTING_COMPILES],
                            capture_output=True, text=True, timeout=280, env=env,
                            cwd=str(Path(TESTS).parent))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "compiled frames {} {}", result.stdout[-2000:]
