"""Device and backend choice.

With CUDA: device cuda:LOCAL_RANK and nccl, nothing patched. Without CUDA: device cpu and gloo, and
Megatron-Core's modules get the CPU stand-ins of mcore/cpu_patches.py. Call
`setup_platform(spec.cpu_patched_modules)` before building any Megatron model.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch

from megatron_dpp.mcore.cpu_patches import apply_cpu_patches


@dataclass(frozen=True)
class Platform:
    device: torch.device
    backend: str  # torch.distributed backend: "nccl" or "gloo"

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def setup_platform(extra_patched_modules: Sequence[str] = ()) -> Platform:
    """Pick device and backend for this process; on CPU patch Megatron-Core (idempotent).

    extra_patched_modules: the model's own Megatron-Core modules to patch on CPU
    (ModelSpec.cpu_patched_modules)."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return Platform(device=torch.device("cuda", local_rank), backend="nccl")
    apply_cpu_patches(extra_patched_modules)
    return Platform(device=torch.device("cpu"), backend="gloo")
