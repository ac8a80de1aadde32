"""Megatron-Core's local linear layers, minus their Python autograd functions on one tensor-parallel rank.

Megatron-Core's ColumnParallelLinear and RowParallelLinear run every call through Python
autograd functions: the linear itself (`LinearWithGradAccumulationAndAsyncCommunication`, for
its tensor-parallel communication and Apex's fused weight-gradient accumulation) and, around it,
the copy-to / reduce-from tensor-parallel region functions, identities on one rank. On one
tensor-parallel rank with none of those features on, that is host work and nothing else: three
Python forwards and backwards per linear and micro-batch, which bound GPT-125m's step on a GPU
(docs/gpu.md). The classes here are those layers, same parameters, initialization, checkpoints
and attributes, whose forward is then `torch.nn.functional.linear` (the product Megatron's function computes,
with the bias in the GEMM's epilogue as Transformer Engine's layers add it: one kernel where
Megatron's function launches two), differentiated by autograd in C++. A layer that returns its
bias for the caller to fuse (skip_bias_add) still does, unless the caller asks for it in the
product (`bias_in_product=True`, as mcore.direct_layer does). In every other case (tensor parallelism, sequence
parallelism, expert communication, gradient-accumulation fusion, deferred embedding gradients,
CPU offloading, a weight passed in) the forward is Megatron's own.

`with_direct_linears(spec)` puts them into a local layer spec, the public way Megatron-Core lets a
model choose its layer classes.
"""
from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_dpp.mcore.specs import replace_spec_classes

__all__ = ["DirectColumnParallelLinear", "DirectRowParallelLinear", "with_direct_linears",
           "DIRECT_CLASSES"]


def _one_rank_without_communication(layer) -> bool:
    """Whether Megatron's forward of `layer` would only multiply (see the module docstring)."""
    config = layer.config
    tp_group = layer.tp_group
    return ((tp_group is None or tp_group.size() == 1)
            and not layer.sequence_parallel
            and not getattr(layer, "explicit_expert_comm", False)
            and not layer.gradient_accumulation_fusion
            and not config.defer_embedding_wgrad_compute)


def bias_goes_in_product(layer, bias_in_product: bool) -> bool:
    """Whether the direct product adds the layer's bias (else it is returned, skip_bias_add)."""
    return not (layer.skip_bias_add and not bias_in_product)


def _multiply(layer, input_: torch.Tensor, bias_in_product: bool):
    """(output, bias) as Megatron's forward returns them on one rank: the bias returned for the
    caller to add (skip_bias_add) unless the caller asks for it in the product, else added in
    the product: `torch.nn.functional.linear`, one GEMM with the bias in its epilogue (addmm),
    where Megatron's function launches a product and then an addition."""
    if not bias_goes_in_product(layer, bias_in_product):
        return torch.matmul(input_, layer.weight.t()), layer.bias
    return torch.nn.functional.linear(input_, layer.weight, layer.bias), None


class DirectColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear whose forward on one tensor-parallel rank is torch.matmul (see the
    module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.multiplies_directly = _one_rank_without_communication(self)

    def multiplies_this_call(self, weight=None) -> bool:
        """Whether a forward with `weight` is the direct product (else Megatron's forward)."""
        return (self.multiplies_directly and weight is None and self.weight is not None
                and self.config._cpu_offloading_context is None)

    def forward(self, input_, weight=None, runtime_gather_output=None, *,
                bias_in_product: bool = False):
        """Megatron's forward; `bias_in_product` asks a skip_bias_add layer for its bias added
        in the product where it multiplies directly (the bias it returns is then None)."""
        if not self.multiplies_this_call(weight):
            return super().forward(input_, weight=weight,
                                   runtime_gather_output=runtime_gather_output)
        return _multiply(self, input_, bias_in_product)


class DirectRowParallelLinear(RowParallelLinear):
    """RowParallelLinear whose forward on one tensor-parallel rank is torch.matmul (see the
    module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.multiplies_directly = _one_rank_without_communication(self)

    def multiplies_this_call(self, weight=None) -> bool:
        """Whether a forward is the direct product (else Megatron's forward)."""
        return self.multiplies_directly and self.config._cpu_offloading_context is None

    def forward(self, input_, *, bias_in_product: bool = False):
        """As DirectColumnParallelLinear.forward."""
        if not self.multiplies_this_call():
            return super().forward(input_)
        return _multiply(self, input_, bias_in_product)


# Megatron-Core's class -> ours.
DIRECT_CLASSES: dict[type, type] = {
    ColumnParallelLinear: DirectColumnParallelLinear,
    RowParallelLinear: DirectRowParallelLinear,
}


def with_direct_linears(layer_spec: ModuleSpec) -> ModuleSpec:
    """A copy of a Megatron-Core local layer spec with our linear classes in place of Megatron's
    (the given spec, often a module global of Megatron-Core, is left unchanged)."""
    return replace_spec_classes(layer_spec, DIRECT_CLASSES)
