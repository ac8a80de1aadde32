"""The test suite's one view of the GPUs. CPU tests run pinned to the CPU: conftest.py calls
`pin_to_cpu()` before any test, which sets an empty CUDA_VISIBLE_DEVICES for the pytest process and
so for every rank and process a test starts. GPU tests start their GPU work in subprocesses with
`gpu_env()` (the machine's own CUDA_VISIBLE_DEVICES back) and are marked `@pytest.mark.gpu` (one
GPU) or `@pytest.mark.gpu(2)`: conftest.py skips them below that many GPUs, at setup (so collecting
or importing a test module probes nothing), and `pytest -m gpu` selects them.

    @pytest.mark.gpu(2)
    def test_x(): subprocess.run([...], env=gpu_env())
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from typing import Optional

_UNSET = object()
_original_visible_devices: object = _UNSET  # the machine's CUDA_VISIBLE_DEVICES (None: unset)


def pin_to_cpu() -> None:
    """Hide every GPU from this process and its children, remembering the machine's setting."""
    global _original_visible_devices
    if _original_visible_devices is _UNSET:
        _original_visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def gpu_env(base: Optional[dict] = None) -> dict:
    """`base` (default: this process's environment) with the machine's CUDA_VISIBLE_DEVICES (as it
    was before pin_to_cpu; unchanged where nothing was pinned)."""
    env = dict(os.environ if base is None else base)
    if _original_visible_devices is _UNSET:
        return env
    if _original_visible_devices is None:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = _original_visible_devices
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
