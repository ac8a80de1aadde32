"""Megatron-Core's local layers with deferrable weight gradients.

Each class subclasses the layer Megatron builds (ColumnParallelLinear, RowParallelLinear through
our direct linears of mcore.direct_linear, torch's LayerNorm as WrappedTorchNorm makes it,
VocabParallelEmbedding, torch.nn.Embedding) and adds behaviour only: no state, no __init__ of its
own except the layer norm's, which takes WrappedTorchNorm's arguments. Outside
`WeightGradStash.defer(key)` (or under no_grad) every forward is the parent's, so the classes can
be used always. Inside it, the parameters' gradients go to the stash and reach the parameters at W.

The linears are the direct linears' subclasses, so a split backward's layers compute what the fused
backward's compute, kernel by kernel: where a direct linear multiplies directly (one tensor-parallel
rank, nothing else to do) the deferred one runs the same product, the bias in the GEMM where the
direct layer asks for it (mcore.direct_layer's bias_in_product), and elsewhere Megatron's forward
through the linear-call seam.
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron.core.transformer import TransformerConfig
from megatron.core.utils import get_tensor_model_parallel_group_if_none

from megatron_dpp.mcore.direct_linear import (
    DirectColumnParallelLinear,
    DirectRowParallelLinear,
    bias_goes_in_product,
)
from megatron_dpp.mcore.linear_call import LinearCallSeam
from megatron_dpp.models.weight_grad.functions import (
    DeferredEmbeddingFunction,
    DeferredLayerNormFunction,
    DeferredLinearFunction,
    DeferredRMSNormFunction,
    open_site,
    proxy,
    tap,
)
from megatron_dpp.models.weight_grad.store import WeightGradError, active_deferral

__all__ = [
    "DeferredColumnParallelLinear",
    "DeferredRowParallelLinear",
    "DeferredLayerNorm",
    "DeferredRMSNorm",
    "DeferredTorchNorm",
    "DeferredVocabParallelEmbedding",
    "DeferredEmbedding",
    "DeferredTorchLinear",
    "DEFERRED_CLASSES",
]


def _trainable_leaf(tensor: Optional[torch.Tensor]) -> bool:
    return tensor is not None and tensor.is_leaf and tensor.requires_grad


def _tap_if_deferring(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A bias returned to the caller (skip_bias_add) is added (or fused into GeLU) outside the
    layer; its gradient, a reduction computed there at B, is kept for W through a proxy."""
    deferral = active_deferral()
    if deferral is None or not _trainable_leaf(bias):
        return bias
    return tap(bias, *deferral)


class _DeferredLinear(LinearCallSeam):
    """Takes the linear call (mcore/linear_call.py) inside a deferral, for a trainable weight:
    the weight's (and a trainable bias's) gradient then goes to the stash. The direct product
    (`_deferred_product`) is taken here too, where the direct linear multiplies itself."""

    # A linear whose class is changed in place (GPT's output layer, built outside the spec: see
    # model.adopt_deferred_embedding_and_output) never ran the direct linear's __init__: it keeps
    # Megatron's forward, as it had before.
    multiplies_directly = False

    def takes_linear_call(self, weight) -> bool:
        return active_deferral() is not None and _trainable_leaf(weight)

    def linear_call(self, arguments):
        unsupported = [name for name in ("gradient_accumulation_fusion", "sequence_parallel")
                       if arguments[name]]
        if arguments["grad_output_buffer"] is not None:
            unsupported.append("defer_embedding_wgrad_compute")
        if unsupported:
            raise WeightGradError(
                f"{type(self).__name__}: deferred weight gradients do not support "
                f"{', '.join(unsupported)} yet; turn it off or run the fused backward")
        deferral = active_deferral()
        weight, bias = arguments["weight"], arguments["bias"]
        trainable_bias = bias if _trainable_leaf(bias) else None
        site = open_site(deferral[0], deferral[1], weight, trainable_bias)
        allreduce_dgrad = bool(arguments["allreduce_dgrad"])
        tp_group = (get_tensor_model_parallel_group_if_none(arguments["tp_group"])
                    if allreduce_dgrad else None)
        bias_input = proxy(bias) if trainable_bias is not None else bias
        return DeferredLinearFunction.apply(arguments["input"], proxy(weight), bias_input, site,
                                            allreduce_dgrad, tp_group)

    def _deferred_product(self, input_, bias_in_product: bool):
        """(output, bias) of the direct linear's product (mcore.direct_linear's _multiply) with the
        weight gradient deferred, or None outside a deferral (the direct forward runs then)."""
        deferral = active_deferral()
        if deferral is None or not _trainable_leaf(self.weight):
            return None
        in_product = bias_goes_in_product(self, bias_in_product)
        bias = self.bias if in_product else None
        trainable_bias = bias if _trainable_leaf(bias) else None
        site = open_site(deferral[0], deferral[1], self.weight, trainable_bias)
        bias_input = proxy(bias) if trainable_bias is not None else bias
        output = DeferredLinearFunction.apply(input_, proxy(self.weight), bias_input, site, False,
                                              None, True)
        return output, (None if in_product else _tap_if_deferring(self.bias))


class DeferredColumnParallelLinear(_DeferredLinear, DirectColumnParallelLinear):
    """ColumnParallelLinear (also GPT's output layer) with a deferrable weight gradient."""

    def forward(self, input_, weight=None, runtime_gather_output=None, *,
                bias_in_product: bool = False):
        if self.multiplies_this_call(weight):
            deferred = self._deferred_product(input_, bias_in_product)
            if deferred is not None:
                return deferred
        output, output_bias = super().forward(input_, weight=weight,
                                              runtime_gather_output=runtime_gather_output,
                                              bias_in_product=bias_in_product)
        return output, _tap_if_deferring(output_bias)


class DeferredRowParallelLinear(_DeferredLinear, DirectRowParallelLinear):
    """RowParallelLinear with a deferrable weight gradient. Its bias, when not skip_bias_add and
    not in the direct product, is added inside Megatron's forward, after the tp reduction: that
    gradient stays at B (GPT's layers all use skip_bias_add, so their row biases are deferred
    through the caller or in the product)."""

    def forward(self, input_, *, bias_in_product: bool = False):
        if self.multiplies_this_call():
            deferred = self._deferred_product(input_, bias_in_product)
            if deferred is not None:
                return deferred
        output, output_bias = super().forward(input_, bias_in_product=bias_in_product)
        return output, _tap_if_deferring(output_bias)


class DeferredLayerNorm(torch.nn.LayerNorm):
    """torch.nn.LayerNorm built from WrappedTorchNorm's arguments (the local spec's norm without
    apex), with deferrable weight and bias gradients."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,
                 persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                 normalization: str = "LayerNorm"):
        unsupported = []
        if config.normalization != "LayerNorm":
            unsupported.append(f"normalization={config.normalization}")
        for flag in ("layernorm_zero_centered_gamma", "persist_layer_norm", "sequence_parallel",
                     "memory_efficient_layer_norm"):
            if getattr(config, flag, False):
                unsupported.append(flag)
        if unsupported:
            raise WeightGradError("DeferredLayerNorm is torch's LayerNorm; it does not support "
                                  + ", ".join(unsupported))
        super().__init__(normalized_shape=hidden_size, eps=eps)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        deferral = active_deferral()
        weight = self.weight if _trainable_leaf(self.weight) else None
        bias = self.bias if _trainable_leaf(self.bias) else None
        if deferral is None or (weight is None and bias is None):
            return super().forward(input)
        site = open_site(deferral[0], deferral[1], weight, bias)
        return DeferredLayerNormFunction.apply(
            input, proxy(self.weight) if weight is not None else self.weight,
            proxy(self.bias) if bias is not None else self.bias,
            site, self.normalized_shape, self.eps)


class DeferredRMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm built from WrappedTorchNorm's arguments (Llama's norm in the local spec),
    with a deferrable weight gradient."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,
                 persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                 normalization: str = "RMSNorm"):
        unsupported = [flag for flag in ("layernorm_zero_centered_gamma", "sequence_parallel")
                       if getattr(config, flag, False)]
        if unsupported:
            raise WeightGradError("DeferredRMSNorm is torch's RMSNorm; it does not support "
                                  + ", ".join(unsupported))
        super().__init__(normalized_shape=hidden_size, eps=eps)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        deferral = active_deferral()
        if deferral is None or not _trainable_leaf(self.weight):
            return super().forward(input)
        site = open_site(deferral[0], deferral[1], self.weight)
        return DeferredRMSNormFunction.apply(input, proxy(self.weight), site,
                                             self.normalized_shape, self.eps)


class DeferredTorchNorm:
    """Our WrappedTorchNorm: builds DeferredLayerNorm or DeferredRMSNorm by
    config.normalization, as WrappedTorchNorm builds torch's LayerNorm or RMSNorm."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,
                persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                normalization: str = "LayerNorm"):
        norm_class = DeferredRMSNorm if config.normalization == "RMSNorm" else DeferredLayerNorm
        return norm_class(config, hidden_size, eps, persist_layer_norm, zero_centered_gamma,
                          normalization)


class DeferredVocabParallelEmbedding(VocabParallelEmbedding):
    """VocabParallelEmbedding with a deferred weight gradient. VocabParallelEmbedding.forward has
    no seam around its lookup, so the deferring path is written here: the same tp masking, our
    lookup function, the same reduction. Outside a deferral, Megatron's forward runs."""

    def forward(self, input_):
        deferral = active_deferral()
        if deferral is None or not _trainable_leaf(self.weight):
            return super().forward(input_)
        if self.reduce_scatter_embeddings:
            raise WeightGradError("DeferredVocabParallelEmbedding: deferred weight gradients do "
                                  "not support sequence parallelism (reduce_scatter_embeddings)")
        tp_size = self.tp_group.size()
        if tp_size > 1:
            input_mask = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            masked_input = input_.clone() - self.vocab_start_index
            masked_input[input_mask] = 0
        else:
            masked_input = input_
        site = open_site(deferral[0], deferral[1], self.weight)
        output_parallel = DeferredEmbeddingFunction.apply(
            masked_input, proxy(self.weight), site, None, bool(self.deterministic_mode))
        if tp_size > 1:
            output_parallel[input_mask, :] = 0.0
        return reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)


class DeferredEmbedding(torch.nn.Embedding):
    """torch.nn.Embedding (GPT's learned position embedding) with a deferred weight gradient."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        deferral = active_deferral()
        if deferral is None or not _trainable_leaf(self.weight):
            return super().forward(input)
        if self.max_norm is not None or self.scale_grad_by_freq or self.sparse:
            raise WeightGradError("DeferredEmbedding: max_norm, scale_grad_by_freq and sparse "
                                  "are not supported with deferred weight gradients")
        site = open_site(deferral[0], deferral[1], self.weight)
        return DeferredEmbeddingFunction.apply(input, proxy(self.weight), site, self.padding_idx,
                                               False)


class DeferredTorchLinear(torch.nn.Linear):
    """torch.nn.Linear (BERT's LM-head transform, pooler and sentence-order head, which Megatron-Core
    builds with get_linear_layer) with deferrable weight and bias gradients."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        deferral = active_deferral()
        if deferral is None or not _trainable_leaf(self.weight):
            return super().forward(input)
        bias = self.bias if _trainable_leaf(self.bias) else None
        site = open_site(deferral[0], deferral[1], self.weight, bias)
        bias_input = proxy(bias) if bias is not None else self.bias
        return DeferredLinearFunction.apply(input, proxy(self.weight), bias_input, site, False,
                                            None)


# Megatron's (or torch's) class -> ours, for the modules built outside any spec.
DEFERRED_CLASSES: dict[type, type] = {
    ColumnParallelLinear: DeferredColumnParallelLinear,
    RowParallelLinear: DeferredRowParallelLinear,
    VocabParallelEmbedding: DeferredVocabParallelEmbedding,
    torch.nn.Embedding: DeferredEmbedding,
    torch.nn.LayerNorm: DeferredLayerNorm,
    torch.nn.RMSNorm: DeferredRMSNorm,
    torch.nn.Linear: DeferredTorchLinear,
}
