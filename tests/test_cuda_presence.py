"""megatron_dpp.cuda_presence: torch.cuda.is_available()'s answer, without importing torch where no
GPU can be seen (the launcher's flag check)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_dpp import cuda_presence

_ASK = ("import sys; from megatron_dpp.cuda_presence import cuda_available; "
        "print(cuda_available(), 'torch' in sys.modules)")


def _ask(**variables: str) -> str:
    env = {**os.environ, **variables}
    done = subprocess.run([sys.executable, "-c", _ASK], capture_output=True, text=True, env=env,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.timeout(90)
def test_an_empty_cuda_visible_devices_is_no_gpu_without_importing_torch():
    assert _ask(CUDA_VISIBLE_DEVICES="") == "False False"


def test_no_nvidia_device_node_is_no_gpu_without_importing_torch(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(cuda_presence, "_DEVICE_NODE_PATTERNS", ("/nonexistent/nvidia[0-9]*",))
    assert not cuda_presence._a_gpu_may_be_visible()
    monkeypatch.setattr(cuda_presence, "_DEVICE_NODE_PATTERNS", (sys.executable,))
    assert cuda_presence._a_gpu_may_be_visible()  # a node: torch must answer


def test_once_torch_is_loaded_torch_answers(monkeypatch):
    """Its answer may have been replaced (tests stand in a GPU that way), and asking costs nothing."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cuda_presence.cuda_available() is True  # although CUDA_VISIBLE_DEVICES is "" here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda_presence.cuda_available() is False
