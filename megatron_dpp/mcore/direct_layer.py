"""Megatron-Core's TransformerLayer whose plain forward is written out in one function.

Megatron-Core's layer forward serves every feature it has: inference contexts and KV caches,
cross attention, recomputed norms, activation offloading, packed sequences, output gates, fused
RoPE, MoE. On a dense layer in training or evaluation each of those is a branch, a context
manager or a module call that does nothing, through four forwards (layer, self-attention, QKV
split, MLP), per layer and micro-batch. Where the host bounds the step (GPT-125m on one GPU:
96 layer calls an iteration, docs/gpu.md) that Python is on the critical path.

`DirectTransformerLayer` is that layer, same submodules, parameters, checkpoints and attributes,
whose forward, where nothing but the dense path has work to do, calls the same submodules with
the same arguments in the same order in one function: input norm, QKV linear, Megatron's split
of the heads, q/k norms, rotary embedding (Megatron's apply_rotary_pos_emb), core attention,
output projection, bias-dropout-add (Megatron's own function), pre-MLP norm, MLP (unfused
activation as Megatron's MLP computes it, or Megatron's MLP forward where its fused activations are
on), bias-dropout-add. One difference: our direct linears (mcore.direct_linear) add each bias in
their GEMM, where Megatron adds three of the four after the product. Same numbers to rounding:
tests/test_direct_layer.py checks GPT, BERT and Llama layers, training with dropout and
evaluation, against Megatron's forward to 1e-6 (bit for bit at its sizes here), dropout drawing
the same masks. Anything else runs Megatron's forward: an inference context, cross attention,
precomputed rotary cos/sin, recomputed norms, MLP or core attention, offloading, an
output gate, fused QKV RoPE, per-layer no-RoPE, test mode, MoE or any other attention or MLP
class, Transformer Engine's activation, fewer query groups than tensor-parallel ranks. Packed
sequences (PackedSeqParams, THD) run the dense path as Megatron's SelfAttention runs them.

Around the forward, the calls Megatron makes that find nothing to do are shortened where they
can be (docs/gpu.md, "The optimizer step, the gradient hooks and the layer's calls"): without CUDA
graphs the layer's call goes straight to nn.Module's, q/k norms that are IdentityOps are not
called, the unfused bias-dropout-add runs Megatron's function without its closures and, where grad
is on already, without its torch.enable_grad, and `current_microbatch` is stored as the plain
attribute it is.

`with_direct_layer(spec)` names it in a local layer spec, the public way Megatron-Core lets a
model choose its layer classes.
"""
from __future__ import annotations

import torch
from megatron.core.fusions.fused_bias_dropout import _bias_dropout_add_func, get_bias_dropout_add
from megatron.core.transformer import attention as megatron_attention
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import make_viewless_tensor

from megatron_dpp.mcore.direct_linear import DIRECT_CLASSES, with_direct_linears
from megatron_dpp.mcore.specs import replace_spec_classes

__all__ = ["DirectTransformerLayer", "with_direct_layer", "with_direct_classes",
           "DIRECT_LAYER_CLASSES"]

# Forward arguments the dense path uses or that change nothing on it (padding_mask is MoE's;
# sequence_len_offset is read only with an inference context). Any other argument that is not
# None sends the call to Megatron's forward.
_DENSE_PATH_ARGUMENTS = frozenset({"hidden_states", "attention_mask", "rotary_pos_emb",
                                   "attention_bias", "padding_mask", "sequence_len_offset",
                                   "packed_seq_params"})


def _dense_path_only(layer: TransformerLayer) -> bool:
    """Whether Megatron's forward of `layer` takes its dense path whatever the inputs (the inputs
    are checked per call)."""
    config = layer.config
    attention, mlp = layer.self_attention, layer.mlp
    if type(attention) is not SelfAttention or type(mlp) is not MLP:  # MoE, cross attention, ...
        return False
    return (isinstance(layer.pre_cross_attn_layernorm, IdentityOp)
            and isinstance(layer.cross_attention, IdentityOp)
            and not (layer.recompute_input_layernorm or layer.recompute_pre_mlp_layernorm
                     or layer.recompute_mlp)
            and not (layer.offload_attn_norm or layer.offload_mlp_norm)
            and not (attention.offload_qkv_linear or attention.offload_core_attention
                     or attention.offload_attn_proj)
            and not attention.checkpoint_core_attention
            and not config.inference_fuse_tp_communication
            and not config.attention_output_gate
            and not config.fused_single_qkv_rope
            and not config.no_rope_freq
            and not config.test_mode
            and not config.flash_decode
            and config.num_query_groups >= attention.world_size
            and not config.use_te_activation_func)


class DirectTransformerLayer(TransformerLayer):
    """TransformerLayer whose dense forward runs in one function (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.runs_directly = _dense_path_only(self)
        # Megatron's MLP forward fuses bias and activation itself where that is on.
        self.mlp_inline = not self.config.bias_activation_fusion
        # Our direct linears add their bias in the GEMM when asked (mcore.direct_linear); the
        # layer then adds none itself (one kernel per linear fewer).
        self.bias_in_products = self.runs_directly and all(
            isinstance(linear, tuple(DIRECT_CLASSES.values()))
            for linear in (self.self_attention.linear_qkv, self.self_attention.linear_proj,
                           self.mlp.linear_fc1, self.mlp.linear_fc2))
        # Megatron's __call__ routes a layer with CUDA graphs to them; without (cuda_graph_impl
        # "none": no graph manager, no Transformer Engine capture) it ends in nn.Module's, after
        # two checks per call that find nothing.
        self.plain_call = (self.config.cuda_graph_impl == "none"
                           and not hasattr(self, "cudagraph_manager"))
        # Which of Megatron's calls on the dense path may be shortened without changing what
        # runs: q/k norms that are IdentityOps (return their input), bias-dropout-add's grad
        # handler (torch.enable_grad, nothing to do where grad is already on), and its unfused
        # function (Megatron's own, called without the two closures that bind `training`).
        attention = self.self_attention
        self.norms_q = not isinstance(attention.q_layernorm, (IdentityOp, type(None)))
        self.norms_k = not isinstance(attention.k_layernorm, (IdentityOp, type(None)))
        self.bda_handler_enables_grad = self.bias_dropout_add_exec_handler is torch.enable_grad
        self.bda_unfused = (not self.config.bias_dropout_fusion
                            and self.self_attn_bda is get_bias_dropout_add
                            and self.mlp_bda is get_bias_dropout_add)

    def __call__(self, *args, **kwargs):
        if self.plain_call:
            return torch.nn.Module.__call__(self, *args, **kwargs)
        return super().__call__(*args, **kwargs)

    def __setattr__(self, name, value):
        # Megatron's schedules set every layer's `current_microbatch` (an int its CUDA graphs
        # read) before each micro-batch's forward. nn.Module.__setattr__ first checks the name
        # against parameters, submodules and buffers, a dozen Python calls, to store a plain
        # attribute where this stores it.
        if name == "current_microbatch" and type(value) is int:
            self.__dict__[name] = value
            return
        super().__setattr__(name, value)

    def _linear(self, linear, inputs):
        """(output, bias) of one of the layer's linears, the bias in the product where it can be."""
        if self.bias_in_products:
            return linear(inputs, bias_in_product=True)
        return linear(inputs)

    def forward(self, *args, **kwargs):
        # TransformerBlock passes every argument by name; anything else goes to Megatron's forward.
        if args or not self.runs_directly or kwargs.get("hidden_states") is None:
            return super().forward(*args, **kwargs)
        for name, value in kwargs.items():
            if value is not None and name not in _DENSE_PATH_ARGUMENTS:
                return super().forward(*args, **kwargs)
        # Megatron's _forward_attention, _forward_mlp and _forward_post_mlp on the dense path.
        hidden_states = kwargs["hidden_states"]
        residual = hidden_states
        normed = self.input_layernorm(hidden_states)
        attention_output = self._self_attention(normed, kwargs.get("attention_mask"),
                                                kwargs.get("rotary_pos_emb"),
                                                kwargs.get("attention_bias"),
                                                kwargs.get("packed_seq_params"))
        hidden_states = self._bias_dropout_add(self.self_attn_bda, attention_output, residual)
        residual = hidden_states
        normed = self.pre_mlp_layernorm(hidden_states)
        mlp_output = self._mlp(normed) if self.mlp_inline else self.mlp(normed)
        hidden_states = self._bias_dropout_add(self.mlp_bda, mlp_output, residual)
        output = make_viewless_tensor(inp=hidden_states, requires_grad=hidden_states.requires_grad,
                                      keep_graph=True)
        return output, None  # no cross attention: no context

    def _bias_dropout_add(self, bda, output_and_bias, residual):
        """Megatron's bias-dropout-add of (output, bias) onto the residual, under its grad handler."""
        if self.bda_handler_enables_grad and torch.is_grad_enabled():
            if self.bda_unfused:
                return _bias_dropout_add_func(output_and_bias, residual, self.hidden_dropout,
                                              self.training)
            return bda(self.training, self.config.bias_dropout_fusion)(
                output_and_bias, residual, self.hidden_dropout)
        with self.bias_dropout_add_exec_handler():
            return bda(self.training, self.config.bias_dropout_fusion)(
                output_and_bias, residual, self.hidden_dropout)

    def _self_attention(self, normed, attention_mask, rotary_pos_emb, attention_bias,
                        packed_seq_params=None):
        """SelfAttention.forward (with get_query_key_value_tensors) on the dense path:
        (output, bias) of the output projection. packed_seq_params in the thd format (packed
        documents, one row): as Megatron, q/k/v lose the batch dimension of 1, the rotary
        embedding restarts at each document (cu_seqlens) and the core attention gets them."""
        attention = self.self_attention
        config = self.config
        mixed_qkv, _ = self._linear(attention.linear_qkv, normed)
        # [sq, b, ng * (np/ng + 2) * hn] -> [sq, b, ng, (np/ng + 2) * hn] -> q, k, v
        heads_per_group = (attention.num_attention_heads_per_partition
                           // attention.num_query_groups_per_partition)
        head_size = attention.hidden_size_per_attention_head
        mixed_qkv = mixed_qkv.view(*mixed_qkv.size()[:-1], attention.num_query_groups_per_partition,
                                   (heads_per_group + 2) * head_size)
        split_sizes = [heads_per_group * head_size, head_size, head_size]
        split_along_dim = megatron_attention.SplitAlongDim  # Transformer Engine's, where installed
        if split_along_dim is not None:
            query, key, value = split_along_dim(mixed_qkv, 3, split_sizes)
        else:
            query, key, value = torch.split(mixed_qkv, split_sizes, dim=3)
        query = query.reshape(query.size(0), query.size(1), -1, head_size)
        if self.norms_q:
            query = attention.q_layernorm(query)
        if self.norms_k:
            key = attention.k_layernorm(key)
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if thd:  # [t, 1, heads, hn] -> [t, heads, hn]
            query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
        cu_seqlens_q = cu_seqlens_kv = None
        if thd:  # Megatron's choice: the padded boundaries where given
            cu_seqlens_q = (packed_seq_params.cu_seqlens_q_padded
                            if packed_seq_params.cu_seqlens_q_padded is not None
                            else packed_seq_params.cu_seqlens_q)
            cu_seqlens_kv = (packed_seq_params.cu_seqlens_kv_padded
                             if packed_seq_params.cu_seqlens_kv_padded is not None
                             else packed_seq_params.cu_seqlens_kv)
        if rotary_pos_emb is not None:
            if not isinstance(rotary_pos_emb, tuple):
                rotary_pos_emb = (rotary_pos_emb,) * 2
            query_embedding, key_embedding = rotary_pos_emb
            mscale = megatron_attention._yarn_get_concentration_factor_from_config(config)
            cp_group = attention.pg_collection.cp
            if query_embedding is not None:
                query = megatron_attention.apply_rotary_pos_emb(
                    query, query_embedding, config=config, cu_seqlens=cu_seqlens_q,
                    mscale=mscale, cp_group=cp_group)
            if key_embedding is not None:
                key = megatron_attention.apply_rotary_pos_emb(
                    key, key_embedding, config=config, cu_seqlens=cu_seqlens_kv,
                    mscale=mscale, cp_group=cp_group)
        core_output = attention.core_attention(
            query, key, value, attention_mask, attn_mask_type=attention.attn_mask_type,
            attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        if thd:  # (t, np, hn) or (t, np * hn) -> (t, 1, h), as Megatron's Attention
            core_output = core_output.reshape(core_output.size(0), 1, -1)
        return self._linear(attention.linear_proj, core_output)

    def _mlp(self, normed):
        """MLP.forward with the bias and activation unfused: (output, bias) of linear_fc2."""
        mlp = self.mlp
        config = self.config
        intermediate, bias = self._linear(mlp.linear_fc1, normed)
        if bias is not None:
            intermediate = intermediate + bias
        if config.gated_linear_unit:
            gated, linear = torch.chunk(intermediate, 2, dim=-1)
            clamp = config.activation_func_clamp_value
            if clamp is not None:
                gated = gated.clamp(min=None, max=clamp)
                linear = linear.clamp(min=-clamp, max=clamp)
            intermediate = config.activation_func(gated) * (linear + config.glu_linear_offset)
        else:
            intermediate = mlp.activation_func(intermediate)
        return self._linear(mlp.linear_fc2, intermediate)


# Megatron-Core's class -> ours.
DIRECT_LAYER_CLASSES: dict[type, type] = {TransformerLayer: DirectTransformerLayer}


def with_direct_layer(layer_spec: ModuleSpec) -> ModuleSpec:
    """A copy of a Megatron-Core local layer spec with our layer class in place of Megatron's (the
    given spec, often a module global of Megatron-Core, is left unchanged)."""
    return replace_spec_classes(layer_spec, DIRECT_LAYER_CLASSES)


def with_direct_classes(layer_spec: ModuleSpec) -> ModuleSpec:
    """Our local specs' classes: the direct layer and the direct linears (mcore.direct_linear)."""
    return with_direct_layer(with_direct_linears(layer_spec))
