"""A hook into how BertModel picks its attention mask's shape.

Megatron-Core 0.16.1's BertModel picks the mask's dimensions in the private
`_sanity_check_attention_and_get_attn_mask_dimension`, by comparing the spec's core attention with
its own DotProductAttention and otherwise asking Transformer Engine's version (which fails without
Transformer Engine). `BertModelWithMaskHook` overrides it once and asks the public
`attention_mask_dimension()` first.
"""
from __future__ import annotations

from typing import Optional

from megatron.core.models.bert.bert_model import BertModel


class BertModelWithMaskHook(BertModel):
    def attention_mask_dimension(self) -> Optional[str]:
        """The mask's dimensions ("b1ss", "b11s", ...), or None to let Megatron-Core pick."""
        return None

    def _sanity_check_attention_and_get_attn_mask_dimension(self) -> str:
        chosen = self.attention_mask_dimension()
        if chosen is None:
            return super()._sanity_check_attention_and_get_attn_mask_dimension()
        return chosen
