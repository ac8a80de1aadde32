"""The test suite's one view of the GPUs. CPU tests run pinned to the CPU: conftest.py calls
`pin_to_cpu()` before any test, which sets an empty CUDA_VISIBLE_DEVICES for the pytest process and
so for every rank and process a test starts. GPU tests start their GPU work in subprocesses with
`gpu_env()` (the machine's own CUDA_VISIBLE_DEVICES back) and are marked `@pytest.mark.gpu` (one
GPU) or `@pytest.mark.gpu(2)`: conftest.py skips them below that many GPUs, at setup (so collecting
or importing a test module probes nothing), and `pytest -m gpu` selects them.

`pin_to_cpu()` also sets TORCHDYNAMO_DISABLE=1. On the CPU nothing is torch.compile'd (Megatron-Core's
compiled fusions are off there, megatron_dpp/kernels.py; tests/test_gpu_env.py checks that a CPU
training step compiles nothing), but Megatron-Core wraps its fusions in torch.compile when it is
imported, which imports torch's inductor: 1.1 s of every rank's start-up on this 2-core machine,
some 14% of the parity tests' time. `gpu_env()` gives the GPU tests the machine's setting back.

    @pytest.mark.gpu(2)
    def test_x(): subprocess.run([...], env=gpu_env())
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from typing import Optional

# What pin_to_cpu() sets for CPU tests; the machine's own values come back in gpu_env().
_CPU_SETTINGS = {"CUDA_VISIBLE_DEVICES": "", "TORCHDYNAMO_DISABLE": "1"}
_machine_settings: Optional[dict] = None  # name -> the machine's value (None: unset)


def pin_to_cpu() -> None:
    """Hide every GPU from this process and its children, remembering the machine's settings."""
    global _machine_settings
    if _machine_settings is None:
        _machine_settings = {name: os.environ.get(name) for name in _CPU_SETTINGS}
    os.environ.update(_CPU_SETTINGS)


def gpu_env(base: Optional[dict] = None) -> dict:
    """`base` (default: this process's environment) with the machine's CUDA_VISIBLE_DEVICES and
    TORCHDYNAMO_DISABLE (as they were before pin_to_cpu; unchanged where nothing was pinned)."""
    env = dict(os.environ if base is None else base)
    for name, value in (_machine_settings or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


@functools.lru_cache(maxsize=None)
def gpu_count() -> int:
    """CUDA devices a GPU test's subprocess sees; probed once, in a subprocess (this process is
    pinned to the CPU). No NVIDIA driver device node (Linux, or WSL's): 0 without starting anything."""
    if not any(os.path.exists(node) for node in ("/dev/nvidiactl", "/dev/dxg")):
        return 0
    probe = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                timeout=120, env=gpu_env())
    except subprocess.TimeoutExpired:
        return 0
    lines = result.stdout.split()
    return int(lines[-1]) if result.returncode == 0 and lines and lines[-1].isdigit() else 0


def skip_reason(count: int) -> Optional[str]:
    """Why a test that needs `count` GPUs cannot run here, or None."""
    found = gpu_count()
    return None if found >= count else f"needs {count} CUDA GPU(s); {found} found"
