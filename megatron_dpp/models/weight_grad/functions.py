"""Autograd functions whose backward computes the input gradient only and stores the weight work.

Every function takes the parameters as *detached proxies* (`proxy(param)`: a new leaf sharing the
parameter's storage) and keeps the real parameters in a `_Site`. The proxy makes the output
require a gradient (an embedding has no other differentiable input), and because the real
parameter is not an input, its AccumulateGrad node and the hooks on it (Megatron DDP's) do not
run at B at all: they run at W, when the stash hands them the finished gradient. Returning None
for a real parameter instead would run those hooks at B with `param.grad is None`, which DDP
rejects under overlap_grad_reduce.

The forward math is the same op by op as Megatron-Core's (LinearWithGradAccumulationAndAsync-
Communication without fusion or sequence parallelism, torch's layer norm and embedding), and each
W uses the op torch's own backward uses, so the gradients are the fused backward's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Optional

import torch
import torch.nn.functional as F
from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

from megatron_dpp.models.weight_grad.store import WeightGradStash, WeightGradWork


@dataclass
class _Site:
    """Where one deferred op's weight work goes: the stash, the key, the real parameters."""

    stash: WeightGradStash
    key: Hashable
    params: tuple[Optional[torch.nn.Parameter], ...]

    def store(self, tensors: tuple, compute) -> None:
        self.stash._store(self.key, WeightGradWork(self.params, tensors, compute))


def proxy(param: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A leaf that shares `param`'s storage (and values) but not its autograd identity."""
    return None if param is None else param.detach().requires_grad_(True)


def open_site(stash: WeightGradStash, key: Hashable, *params) -> _Site:
    stash._forward_deferred(key)
    return _Site(stash, key, params)


# ----------------------------------------------------------------------------------------------
# linear: y = x W^T (+ b)
# ----------------------------------------------------------------------------------------------
def _linear_wgrad(total_input, grad_output, has_bias: bool):
    # The same steps as Megatron's LinearWithGradAccumulationAndAsyncCommunication.backward.
    grad_output, total_input = prepare_input_tensors_for_wgrad_compute(grad_output, total_input)
    grad_weight = grad_output.t().matmul(total_input)
    grad_bias = grad_output.sum(dim=0) if has_bias else None
    return grad_weight, grad_bias


class DeferredLinearFunction(torch.autograd.Function):
    """Megatron's linear (no sequence parallelism, no gradient-accumulation fusion) with a split
    backward: B = grad_output @ W (all-reduced over tp when `allreduce_dgrad`), W = stored.

    `bias_in_product`: the bias is added in the GEMM (torch.nn.functional.linear, one addmm), as
    our direct linears add it (mcore.direct_linear); otherwise after the product, as Megatron's
    function does."""

    @staticmethod
    def forward(ctx, input, weight, bias, site: _Site, allreduce_dgrad: bool, tp_group,
                bias_in_product: bool = False):
        ctx.save_for_backward(input, weight)
        ctx.site, ctx.has_bias = site, bias is not None
        ctx.allreduce_dgrad, ctx.tp_group = allreduce_dgrad, tp_group
        if bias_in_product:
            return F.linear(input, weight, bias)
        output = torch.matmul(input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        handle = None
        if ctx.allreduce_dgrad and grad_input is not None:
            handle = torch.distributed.all_reduce(grad_input, group=ctx.tp_group, async_op=True)
        has_bias = ctx.has_bias
        ctx.site.store((input.detach(), grad_output.detach()),
                       lambda x, g: _linear_wgrad(x, g, has_bias))
        if handle is not None:
            handle.wait()
        return grad_input, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# layer norm
# ----------------------------------------------------------------------------------------------
class DeferredLayerNormFunction(torch.autograd.Function):
    """torch's layer norm; B asks native_layer_norm_backward for dX only, W for dgamma, dbeta."""

    @staticmethod
    def forward(ctx, input, weight, bias, site: _Site, normalized_shape, eps: float):
        output, mean, rstd = torch.native_layer_norm(input, normalized_shape, weight, bias, eps)
        ctx.save_for_backward(input, weight, bias, mean, rstd)
        ctx.site, ctx.normalized_shape = site, list(normalized_shape)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, bias, mean, rstd = ctx.saved_tensors
        shape = ctx.normalized_shape
        grad_input, _, _ = torch.ops.aten.native_layer_norm_backward(
            grad_output, input, shape, mean, rstd, weight, bias,
            [ctx.needs_input_grad[0], False, False])
        # W reads the parameters' values when it runs: they do not change within an iteration.
        weight_param, bias_param = ctx.site.params

        def wgrad(g, x, mu, sigma):
            _, grad_weight, grad_bias = torch.ops.aten.native_layer_norm_backward(
                g, x, shape, mu, sigma,
                None if weight_param is None else weight_param.detach(),
                None if bias_param is None else bias_param.detach(),
                [False, weight_param is not None, bias_param is not None])
            return grad_weight, grad_bias

        ctx.site.store((grad_output.detach(), input.detach(), mean, rstd), wgrad)
        return grad_input, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# RMS norm (Llama's): y = x * rstd * gamma, rstd = 1 / sqrt(mean(x^2) + eps)
# ----------------------------------------------------------------------------------------------
class DeferredRMSNormFunction(torch.autograd.Function):
    """torch's RMS norm (computed in fp32 at least, as torch's own); B computes dX, W dgamma."""

    @staticmethod
    def forward(ctx, input, weight, site: _Site, normalized_shape, eps: Optional[float]):
        dims = tuple(range(-len(normalized_shape), 0))
        x = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        eps = torch.finfo(input.dtype).eps if eps is None else eps
        rstd = torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
        output = (x * rstd).to(input.dtype)
        if weight is not None:
            output = output * weight
        ctx.save_for_backward(input, weight, rstd)
        ctx.site, ctx.dims = site, dims
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, rstd = ctx.saved_tensors
        dims = ctx.dims
        x = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        normalized = x * rstd
        grad = grad_output.to(normalized.dtype)
        grad_normalized = grad * weight.to(grad.dtype) if weight is not None else grad
        grad_input = rstd * (grad_normalized
                             - normalized * (grad_normalized * normalized).mean(dims, keepdim=True))
        leading = tuple(range(grad_output.dim() - len(dims)))

        def wgrad(g, x_, r):
            x_ = x_.float() if x_.dtype in (torch.float16, torch.bfloat16) else x_
            return ((g.to(x_.dtype) * (x_ * r)).sum(leading).to(g.dtype),)

        if weight is not None:
            ctx.site.store((grad_output.detach(), input.detach(), rstd), wgrad)
        return grad_input.to(input.dtype), None, None, None, None


# ----------------------------------------------------------------------------------------------
# embedding: the whole backward is the weight gradient (the input is token ids)
# ----------------------------------------------------------------------------------------------
class DeferredEmbeddingFunction(torch.autograd.Function):
    """F.embedding (or `weight[ids]` in Megatron's deterministic mode); B stores (ids, grad),
    W runs the op torch's backward runs: embedding_dense_backward, or index_put_ with
    accumulation for indexing."""

    @staticmethod
    def forward(ctx, ids, weight, site: _Site, padding_idx: Optional[int], by_index: bool):
        ctx.save_for_backward(ids)
        ctx.site, ctx.by_index = site, by_index
        ctx.num_weights, ctx.padding_idx = weight.shape[0], padding_idx
        return weight[ids] if by_index else F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_output):
        (ids,) = ctx.saved_tensors
        num_weights, by_index = ctx.num_weights, ctx.by_index
        padding_idx = -1 if ctx.padding_idx is None else ctx.padding_idx
        (param,) = ctx.site.params

        def wgrad(i, g):
            if by_index:
                return (torch.zeros_like(param).index_put_((i,), g, accumulate=True),)
            return (torch.ops.aten.embedding_dense_backward(g, i, num_weights, padding_idx, False),)

        ctx.site.store((ids, grad_output.detach()), wgrad)
        return None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# a parameter used outside our functions (a bias returned by skip_bias_add)
# ----------------------------------------------------------------------------------------------
def tap(param: torch.nn.Parameter, stash: WeightGradStash, key: Hashable) -> torch.Tensor:
    """A proxy of `param` whose gradient, computed by whatever consumes it at B (a bias-add or a
    fused bias-GeLU: a reduction, no GEMM), is stored and handed to `param` at W."""
    site = open_site(stash, key, param)
    leaf = proxy(param)

    def keep(tensor: torch.Tensor) -> None:
        grad, tensor.grad = tensor.grad, None
        site.store((grad,), lambda g: (g,))

    leaf.register_post_accumulate_grad_hook(keep)
    return leaf
