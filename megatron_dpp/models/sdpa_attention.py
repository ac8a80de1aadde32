"""Core attention through torch's scaled_dot_product_attention (or flash-attn), as a layer-spec
submodule in place of Megatron-Core's local DotProductAttention.

Megatron-Core's local attention writes the attention out (scores, masked softmax, dropout, a
second matmul) and keeps the [b, heads, s, s] probabilities for the backward; SDPA runs torch's
flash or memory-efficient kernel. `SdpaCoreAttention` takes DotProductAttention's constructor and
forward arguments and returns the same numbers (tests/test_attention_kernels.py checks forward and
gradients against it), so a spec swaps one for the other (`with_core_attention`). Which one runs
is chosen in megatron_dpp.kernels.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

from megatron_dpp import kernels
from megatron_dpp.mcore.rng import model_parallel_rng


class SdpaCoreAttention(MegatronModule):
    """Megatron-Core's DotProductAttention computed by torch.nn.functional.scaled_dot_product_attention.

    Shapes as Megatron's: query [sq, b, np, hn], key and value [sk, b, ng, hn] (np heads and ng
    query groups of this tensor-parallel rank; ng < np is grouped-query attention) -> [sq, b, np*hn].
    attention_mask: Megatron's boolean mask (True = masked out), broadcastable to [b, np, sq, sk],
    or None, with the causal mask type meaning causal attention (SDPA's is_causal, no mask built).

    use_flash_attn (--use-flash-attn where flash-attn is installed): flash_attn.flash_attn_func
    for attention without a mask in fp16/bf16; a mask (BERT's padding) or fp32 goes through SDPA.

    packed_seq_params (--dataloader-inter-document-masking): Megatron's THD format, query
    [t, np, hn] and key/value [t, ng, hn] of one packed row whose documents end at cu_seqlens;
    each token attends causally inside its own document only -> [t, np*hn]. `packed_kernel`
    says which kernel runs it.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        use_flash_attn: bool = False,
    ):
        super().__init__(config=config)
        layer_number = max(1, layer_number)
        if config.context_parallel_size != 1:
            raise ValueError("SdpaCoreAttention does not support context parallelism "
                             "(Transformer Engine's attention does)")
        if config.softmax_type != "vanilla":
            raise ValueError(f"SdpaCoreAttention supports the vanilla softmax, not "
                             f"softmax_type={config.softmax_type!r}")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                     layer_number):
            raise ValueError("SdpaCoreAttention does not support sliding-window attention")
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type  # unused, as in DotProductAttention

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        world_size = pg_collection.tp.size()
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, world_size)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, world_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, world_size)
        head_dim = divide(projection_size, config.num_attention_heads)
        # apply_query_key_layer_scaling divides the scores by the layer number and the fp32 softmax
        # multiplies them back (an fp16 overflow guard): the same scale in the end, which SDPA's
        # kernels apply with fp32 accumulation.
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.flash_attn_func = _flash_attn_func() if use_flash_attn else None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SdpaCoreAttention does not support an attention bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if packed_seq_params is not None:
            return self._packed(query, key, value, attention_mask, mask_type, packed_seq_params)
        # As Megatron's softmax: a given mask is the mask; none with the causal type is causal.
        causal = attention_mask is None and mask_type == AttnMaskType.causal and query.size(0) > 1
        dropout_p = self.dropout_p if self.training else 0.0
        sq, b = query.size(0), query.size(1)
        # Megatron forks the tensor-parallel RNG for attention dropout (each tp rank its own heads'
        # mask), except under sequence parallelism.
        rng = (model_parallel_rng(query.device)
               if dropout_p > 0.0 and not self.config.sequence_parallel else contextlib.nullcontext())
        with rng:
            if self._use_flash_attn(query, attention_mask):
                # flash-attn's layout is [b, s, heads, hn]; it takes fewer key/value heads as is.
                context = self.flash_attn_func(
                    query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
                    dropout_p=dropout_p, softmax_scale=self.softmax_scale, causal=causal)
                return context.transpose(0, 1).reshape(sq, b, self.hidden_size_per_partition)
            context = self._sdpa(query, key, value, attention_mask, causal, dropout_p)
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _packed(self, query, key, value, attention_mask, mask_type: AttnMaskType,
                params: PackedSeqParams) -> torch.Tensor:
        """Causal attention inside each document of a THD row (see the class docstring)."""
        if params.qkv_format != "thd":
            raise ValueError(f"SdpaCoreAttention takes packed sequences in the thd format, not "
                             f"{params.qkv_format!r}")
        if attention_mask is not None or mask_type != AttnMaskType.causal:
            raise ValueError("SdpaCoreAttention runs packed documents causally, without a mask")
        if params.cu_seqlens_q_padded is not None or params.cu_seqlens_kv_padded is not None:
            raise ValueError("SdpaCoreAttention does not take padded packed boundaries "
                             "(cu_seqlens_*_padded: context parallelism's)")
        dropout_p = self.dropout_p if self.training else 0.0
        groups_per_head = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        rng = (model_parallel_rng(query.device)
               if dropout_p > 0.0 and not self.config.sequence_parallel else contextlib.nullcontext())
        kernel = packed_kernel(query, dropout_p, self.flash_attn_func is not None)
        cu_q, cu_kv = params.cu_seqlens_q, params.cu_seqlens_kv
        with rng:
            if kernel == PACKED_FLASH_ATTN:
                context = _flash_attn_varlen_func()(
                    query, key, value, cu_q, cu_kv, params.max_seqlen_q, params.max_seqlen_kv,
                    dropout_p=dropout_p, softmax_scale=self.softmax_scale, causal=True)
            elif kernel == PACKED_TORCH_VARLEN:
                from torch.nn.attention.varlen import varlen_attn

                # window (-1, 0): every earlier key of the document, no later one (causal).
                context = varlen_attn(query, key, value, cu_q, cu_kv, params.max_seqlen_q,
                                      params.max_seqlen_kv, scale=self.softmax_scale,
                                      window_size=(-1, 0), enable_gqa=groups_per_head > 1)
            else:
                context = self._sdpa_per_document(query, key, value, cu_q, cu_kv,
                                                  groups_per_head, dropout_p)
        return context.reshape(query.size(0), self.hidden_size_per_partition)

    def _sdpa_per_document(self, query, key, value, cu_q, cu_kv, groups_per_head: int,
                           dropout_p: float) -> torch.Tensor:
        """SDPA once per document: [t, heads, hn] rows cu[i]:cu[i+1] -> [t, np, hn]."""
        if not torch.equal(cu_q, cu_kv):
            raise ValueError("SdpaCoreAttention's per-document attention needs the same query "
                             "and key boundaries (self-attention)")
        bounds = cu_q.tolist()  # host values: the CPU path (and a GPU's fp32 or dropout case)
        outputs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            # [len, heads, hn] -> [1, heads, len, hn]
            q, k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
            if groups_per_head > 1:  # grouped-query attention, as _sdpa
                k = k.repeat_interleave(groups_per_head, dim=1)
                v = v.repeat_interleave(groups_per_head, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p,
                                                 is_causal=end - start > 1,
                                                 scale=self.softmax_scale)
            outputs.append(out.squeeze(0).transpose(0, 1))
        return torch.cat(outputs, dim=0)

    def _use_flash_attn(self, query: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> bool:
        return (self.flash_attn_func is not None and attention_mask is None
                and query.dtype in (torch.float16, torch.bfloat16))

    def _sdpa(self, query, key, value, attention_mask, causal: bool, dropout_p: float):
        # [s, b, heads, hn] -> [b, heads, s, hn]
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        groups_per_head = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups_per_head > 1:  # grouped-query attention: heads g*r .. g*r+r-1 share group g
            key = key.repeat_interleave(groups_per_head, dim=1)
            value = value.repeat_interleave(groups_per_head, dim=1)
        allowed = None
        if attention_mask is not None:
            masked = attention_mask.bool()
            # A query that may attend to nothing (a padding row of BERT's [b, 1, s, s] mask):
            # Megatron sets all its scores to -10000 and the softmax spreads it evenly over every
            # key. A zero query with nothing masked does the same (SDPA would return NaN), with
            # the same zero gradients for the query and from it for the keys.
            attends_to_nothing = masked.all(dim=-1, keepdim=True)
            query = query.masked_fill(attends_to_nothing, 0.0)
            allowed = ~masked | attends_to_nothing  # SDPA's boolean mask: True = attend
        return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed,
                                              dropout_p=dropout_p, is_causal=causal,
                                              scale=self.softmax_scale)


def _flash_attn_func():
    from flash_attn import flash_attn_func

    return flash_attn_func


def _flash_attn_varlen_func():
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


# The kernels that run a packed row's documents apart (kernels.packed_attention logs the rule).
PACKED_FLASH_ATTN = "flash_attn_varlen_func"
PACKED_TORCH_VARLEN = "torch varlen_attn"
PACKED_SDPA_PER_DOCUMENT = "torch SDPA per document"


def packed_kernel(query: torch.Tensor, dropout_p: float, use_flash_attn: bool) -> str:
    """The kernel for a THD row: on a GPU in fp16/bf16, flash-attn's varlen kernel with
    --use-flash-attn (flash-attn installed), else torch's varlen_attn without attention dropout
    (it has none); otherwise (the CPU, fp32, dropout without flash-attn) SDPA per document."""
    half = query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
    if half and use_flash_attn:
        return PACKED_FLASH_ATTN
    if half and dropout_p == 0.0 and _torch_varlen_available():
        return PACKED_TORCH_VARLEN
    return PACKED_SDPA_PER_DOCUMENT


@functools.lru_cache(maxsize=None)
def _torch_varlen_available() -> bool:
    return kernels.module_importable(kernels.TORCH_VARLEN_MODULE)


def with_core_attention(layer_spec: ModuleSpec, attention: str) -> ModuleSpec:
    """A copy of a Megatron-Core local layer spec whose self-attention's core_attention is the one
    megatron_dpp.kernels chose (kernels.SDPA, FLASH_ATTN or LOCAL: the spec as it is). The given
    spec (often a module global of Megatron-Core) is left unchanged."""
    if attention == kernels.LOCAL:
        return layer_spec
    if attention not in (kernels.SDPA, kernels.FLASH_ATTN):
        raise ValueError(f"with_core_attention: no local-spec core attention {attention!r}")
    core = ModuleSpec(module=SdpaCoreAttention,
                      params={"use_flash_attn": attention == kernels.FLASH_ATTN})
    self_attention = layer_spec.submodules.self_attention
    self_attention = dataclasses.replace(
        self_attention,
        submodules=dataclasses.replace(self_attention.submodules, core_attention=core))
    return dataclasses.replace(
        layer_spec,
        submodules=dataclasses.replace(layer_spec.submodules, self_attention=self_attention))


def uses_sdpa_core_attention(layer_spec: ModuleSpec) -> bool:
    core = layer_spec.submodules.self_attention.submodules.core_attention
    return (core is SdpaCoreAttention
            or (isinstance(core, ModuleSpec) and core.module is SdpaCoreAttention))
