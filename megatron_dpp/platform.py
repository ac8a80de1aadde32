"""Device and backend choice.

With CUDA: device cuda:LOCAL_RANK and nccl, nothing patched; with N ranks per GPU (the launcher's
--ranks-per-gpu, megatron_dpp.shared_gpu), device cuda:(LOCAL_RANK // N) and gloo (NCCL refuses two
ranks of one communicator on one device). Without CUDA: device cpu and gloo, and
Megatron-Core's modules get the CPU stand-ins of mcore/cpu_patches.py, and malloc keeps the memory
the process frees (megatron_dpp.cpu_memory). Call
`setup_platform(spec.cpu_patched_modules)` before building any Megatron model.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch

from megatron_dpp.cpu_memory import keep_freed_memory
from megatron_dpp.mcore.cpu_patches import apply_cpu_patches
from megatron_dpp.shared_gpu import device_index, ranks_per_gpu


@dataclass(frozen=True)
class Platform:
    device: torch.device
    backend: str  # torch.distributed backend: "nccl" or "gloo"

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def setup_platform(extra_patched_modules: Sequence[str] = ()) -> Platform:
    """Pick device and backend for this process; on CPU patch Megatron-Core and keep freed memory
    (both idempotent).

    extra_patched_modules: the model's own Megatron-Core modules to patch on CPU
    (ModelSpec.cpu_patched_modules)."""
    if torch.cuda.is_available():
        per_gpu = ranks_per_gpu()
        index = device_index(int(os.environ.get("LOCAL_RANK", "0")), per_gpu)
        torch.cuda.set_device(index)
        return Platform(device=torch.device("cuda", index),
                        backend="nccl" if per_gpu == 1 else "gloo")
    apply_cpu_patches(extra_patched_modules)
    keep_freed_memory()
    return Platform(device=torch.device("cpu"), backend="gloo")
