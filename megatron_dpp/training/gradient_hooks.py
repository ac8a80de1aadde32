"""Megatron-Core's DistributedDataParallel with a shorter per-parameter gradient hook where it can.

Megatron-Core's DDP adds each parameter's gradient into the parameter's `main_grad` (a view of its
contiguous gradient buffer) from a hook on the parameter's gradient accumulator, which autograd
runs once per parameter and micro-batch: 1184 calls an iteration for GPT-125m's recipe (148
parameters, 8 micro-batches). Besides the accumulation, that hook serves two features: it does
nothing while a CUDA graph is being captured, and under --overlap-grad-reduce it counts the
bucket's ready gradients to start the bucket's reduction. Where neither can happen (no CUDA graphs
configured, no overlapped reduction) the hook here does the accumulation alone: the same condition,
the same `main_grad.add_(grad)` into the same buffer, and `grad = None`, without the parameter's
dictionary lookup, the graph-capture check and the `.data` view Megatron's takes of the gradient
(an aten op per call, which on a GPU is host time in a step the host bounds: docs/gpu.md). The
gradient carries no autograd history in a hook (nothing is differentiated twice here), so adding it
directly is the same as adding its `.data`. Everywhere else Megatron's hook runs.
"""
from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallel as MegatronDistributedDataParallel

__all__ = ["DistributedDataParallel", "accumulation_only"]


def accumulation_only(ddp: MegatronDistributedDataParallel, param: torch.nn.Parameter) -> bool:
    """Whether Megatron's backward hook for `param` would only accumulate its gradient: no CUDA graph
    can be captured (cuda_graph_impl "none"), no overlapped reduction, and the parameter has a
    gradient buffer (Megatron's hook skips one without)."""
    return (getattr(ddp.config, "cuda_graph_impl", "none") == "none"
            and not ddp.ddp_config.overlap_grad_reduce
            and param in ddp.param_to_bucket_group)


class DistributedDataParallel(MegatronDistributedDataParallel):
    """Megatron-Core's DistributedDataParallel; see the module docstring for its one difference."""

    def _make_backward_post_hook(self, param: torch.nn.Parameter):
        if not accumulation_only(self, param):
            return super()._make_backward_post_hook(param)

        def accumulate_into_main_grad(*unused):
            grad = param.grad
            if grad is not None and (not param.grad_added_to_main_grad
                                     or getattr(param, "zero_out_wgrad", False)):
                param.main_grad.add_(grad)
            param.grad = None

        return accumulate_into_main_grad
