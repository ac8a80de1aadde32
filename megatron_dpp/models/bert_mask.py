"""BertModel with the padding mask our core attention takes.

Its own module, so that BERT's model builder (bert.py) and the split backward's DeferredBertModel
(weight_grad/model.py) both build on it without importing each other.
"""
from __future__ import annotations

from typing import Optional

from megatron_dpp.mcore.bert_model import BertModelWithMaskHook
from megatron_dpp.models.sdpa_attention import uses_sdpa_core_attention


class LocalMaskBertModel(BertModelWithMaskHook):
    """BertModel that also gives our core attention (SdpaCoreAttention) Megatron's local padding
    mask ([b, 1, s, s], True = masked out). BertModel picks the mask's shape by comparing the
    spec's core attention with its own DotProductAttention, and otherwise asks Transformer
    Engine's version (which fails without Transformer Engine)."""

    def attention_mask_dimension(self) -> Optional[str]:
        return "b1ss" if uses_sdpa_core_attention(self.transformer_layer_spec) else None
