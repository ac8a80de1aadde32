"""The suite's CPU pinning (conftest.py, tests/_gpu.py): the test process and what it starts see no
GPU; gpu_env() gives GPU tests the machine's CUDA_VISIBLE_DEVICES back (set or unset)."""
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
print(repr(os.environ["CUDA_VISIBLE_DEVICES"]), repr(_gpu.gpu_env().get("CUDA_VISIBLE_DEVICES")))
"""


def test_tests_and_their_processes_run_without_gpus():
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    child = subprocess.run([sys.executable, "-c", "import os, torch; "
                            "print(repr(os.environ['CUDA_VISIBLE_DEVICES']), torch.cuda.device_count())"],
                           capture_output=True, text=True, timeout=60)
    assert child.stdout.split() == ["''", "0"], child.stderr


@pytest.mark.parametrize("machine,restored", [("1,3", "'1,3'"), (None, "None")])
def test_gpu_env_restores_the_machines_setting(machine, restored):
    env = {name: value for name, value in os.environ.items() if name != "CUDA_VISIBLE_DEVICES"}
    if machine is not None:
        env["CUDA_VISIBLE_DEVICES"] = machine
    result = subprocess.run([sys.executable, "-c", _PIN_AND_RESTORE], capture_output=True,
                            text=True, timeout=60, cwd=TESTS, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["''", restored]
