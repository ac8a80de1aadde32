"""Whether CUDA is available, as torch.cuda.is_available() says, without importing torch where no
GPU can be seen: the launcher checks a job's flags (`python -m megatron_dpp.arguments`) before it
starts any rank, and on a machine without a GPU importing torch was most of that check's 3-4 s.

No GPU can be seen when CUDA_VISIBLE_DEVICES is set to nothing, or when the machine has no NVIDIA
device node (/dev/nvidia0, ...; WSL 2 reaches its GPUs through /dev/dxg instead). Everywhere else,
and whenever torch is already loaded (whose answer a test may have replaced), torch answers.
"""
from __future__ import annotations

import glob
import os
import sys

# Device nodes through which the CUDA driver reaches a GPU: Linux's, and WSL 2's.
_DEVICE_NODE_PATTERNS = ("/dev/nvidia[0-9]*", "/dev/dxg")


def cuda_available() -> bool:
    if "torch" not in sys.modules and not _a_gpu_may_be_visible():
        return False
    import torch

    return torch.cuda.is_available()


def _a_gpu_may_be_visible() -> bool:
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    return any(glob.glob(pattern) for pattern in _DEVICE_NODE_PATTERNS)
