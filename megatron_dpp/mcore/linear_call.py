"""The seam through which Column/RowParallelLinear.forward calls its linear autograd function.

Megatron-Core 0.16.1's `forward` of both layers calls the private `_forward_impl(input, weight,
...)` (it is where Megatron itself switches to the frozen-weight function). `LinearCallSeam`, mixed
in before the layer class, overrides it once here and hands a subclass two public hooks: whether it
takes this call (`takes_linear_call`), and the call itself with its arguments bound by name
(`linear_call`). The rest of forward (TP copies and reductions, bias handling, gathers) stays
Megatron's.
"""
from __future__ import annotations

import inspect
import torch
from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce

# Megatron passes the linear's arguments by keyword; binding them against its own function keeps
# the hooks right if it ever passes some by position.
_LINEAR_ARGUMENTS = inspect.signature(linear_with_grad_accumulation_and_async_allreduce)


class LinearCallSeam:
    """Mixin for ColumnParallelLinear and RowParallelLinear (put it first among the bases). A
    subclass that takes a call defines `linear_call(arguments) -> output`: the arguments of
    Megatron's linear_with_grad_accumulation_and_async_allreduce by name, defaults filled in."""

    def takes_linear_call(self, weight: torch.Tensor) -> bool:
        """True: this call goes to `linear_call`; False: to Megatron's own function."""
        return False

    def _forward_impl(self, input, weight, *args, **kwargs):
        if not self.takes_linear_call(weight):
            return super()._forward_impl(input, weight, *args, **kwargs)
        call = _LINEAR_ARGUMENTS.bind(input, weight, *args, **kwargs)
        call.apply_defaults()
        return self.linear_call(call.arguments)
