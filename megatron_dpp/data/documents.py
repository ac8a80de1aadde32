"""Document boundaries inside a packed sample, for --dataloader-inter-document-masking.

A sample of Megatron's GPTDataset is a window of the concatenated documents, each of which ends
with its end-of-document token. Its boundaries ("cu_seqlens", the batch contract of issue 60) are
[0, e1, e2, ..., L]: a document ends after each EOD token, the rule by which Megatron-Core's
_get_ltor_masks_and_position_ids resets the position ids and the attention mask
(--reset-position-ids, --reset-attention-mask), so the masked attention is that dense mask's
without building it. The sample's end is always the last boundary.
"""
from __future__ import annotations

import torch


def document_boundaries(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """int32 [0, e1, ..., L] of a 1-D sample: a boundary after each EOD token before its end."""
    length = tokens.numel()
    ends = torch.nonzero(tokens == eod).flatten() + 1
    ends = ends[ends < length]
    return torch.cat([torch.zeros(1, dtype=torch.long), ends,
                      torch.full((1,), length, dtype=torch.long)]).to(torch.int32)


def positions_within_documents(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """int64 position ids that restart at 0 at each boundary (as --reset-position-ids)."""
    lengths = cu_seqlens.diff().long()
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)
    return torch.arange(int(cu_seqlens[-1]), dtype=torch.long) - starts


def with_document_boundaries(sample: dict, eod: int) -> dict:
    """A GPT sample with its "cu_seqlens" and position ids restarted per document. A sample that
    knows its documents already (--use-sequence-packing's, whose padding is the EOD id too) keeps
    its own boundaries."""
    if "cu_seqlens" in sample:
        return sample
    cu_seqlens = document_boundaries(sample["tokens"], eod)
    return {**sample, "cu_seqlens": cu_seqlens,
            "position_ids": positions_within_documents(cu_seqlens)}
