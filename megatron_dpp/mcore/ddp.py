"""Megatron-Core's DistributedDataParallel with a shorter per-parameter gradient hook where it can.

Megatron-Core's DDP adds each parameter's gradient into the parameter's `main_grad` (a view of its
contiguous gradient buffer) from a hook on the parameter's gradient accumulator, which autograd
runs once per parameter and micro-batch: 1184 calls an iteration for GPT-125m's recipe (148
parameters, 8 micro-batches). Each call looks the parameter up in a dictionary, asks whether a CUDA
graph is being captured (the hook must then do nothing), takes the gradient's `.data` (an aten view
op) and adds it; under --overlap-grad-reduce it then tells the parameter's bucket group that the
gradient is ready, which starts the bucket's reduction once all of them are. Where no CUDA graph can
be captured (cuda_graph_impl "none") the hook here does the same with the parameter's bucket group
found once, when the hook is made (Megatron fills that dictionary before it makes its hooks and
never again), and without the `.data`: a gradient carries no autograd history in a hook (nothing is
differentiated twice here), so adding it directly is the same as adding its `.data`. The
accumulation's condition, the overlap case's assertion and its ready call are Megatron's. On a GPU
the Python and the view op are host time in a step the host bounds (docs/gpu.md). Elsewhere
Megatron's hook runs.
"""
from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallel as MegatronDistributedDataParallel

__all__ = ["DistributedDataParallel", "accumulation_only"]


def accumulation_only(ddp: MegatronDistributedDataParallel, param: torch.nn.Parameter) -> bool:
    """Whether Megatron's backward hook for `param` would only accumulate its gradient (and, under
    --overlap-grad-reduce, say it is ready): no CUDA graph can be captured (cuda_graph_impl
    "none"), and the parameter has a gradient buffer (Megatron's hook skips one without)."""
    return (getattr(ddp.config, "cuda_graph_impl", "none") == "none"
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

        if not self.ddp_config.overlap_grad_reduce:
            return accumulate_into_main_grad
        bucket_group = self.param_to_bucket_group[param]

        def accumulate_and_mark_ready(*unused):
            assert param.grad is not None, ("param.grad being None is not safe when "
                                            "overlap_grad_reduce is True")  # Megatron's check
            accumulate_into_main_grad()
            bucket_group.register_grad_ready(param, self.force_all_reduce)

        return accumulate_and_mark_ready
