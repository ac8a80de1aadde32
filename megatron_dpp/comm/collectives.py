"""Our collectives on device tensors, on whatever backend the job runs.

NCCL takes CUDA tensors only, gloo CPU tensors (and CUDA tensors for some operations only: not
for send/recv, and which others take them depends on torch's version). With ranks sharing a GPU (megatron_dpp.shared_gpu) the job runs gloo on CUDA ranks, so
every collective of ours goes through here: a CUDA tensor under gloo is staged through the host
(copied to the CPU, reduced or gathered there, copied back), the same route for every operation.
A group of one rank runs nothing at all (a pipeline on one GPU has a data-parallel group of one).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def collective_device(group: Optional[dist.ProcessGroup], device: torch.device) -> torch.device:
    """Where a collective of `group` (None: the default group) takes a tensor that lives on
    `device`: the device itself under NCCL, the CPU under gloo."""
    if dist.get_backend(group) == "nccl":
        return device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM,
               group: Optional[dist.ProcessGroup] = None) -> None:
    """dist.all_reduce in place, staged through the host where the backend needs it."""
    if dist.get_world_size(group) == 1:
        return
    staged = tensor.to(collective_device(group, tensor.device))
    dist.all_reduce(staged, op=op, group=group)
    if staged is not tensor:
        tensor.copy_(staged)


def all_gather(tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> list:
    """dist.all_gather of `tensor` from every rank of `group`, each on `tensor`'s device."""
    staged = tensor.to(collective_device(group, tensor.device))
    everyone = [torch.empty_like(staged) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, staged, group=group)
    return [row.to(tensor.device) for row in everyone]
