"""The work of a microbatch whose attention is per segment (documents masked apart in a pack, or
whole samples): what the policies order and balance by (TaskGraph.sizes), apart from the
activation bytes the budgets count (TaskGraph.act_bytes), which grow with the tokens only.

    work = sum over segments of s_i + c * s_i^2      (in tokens)

c is the attention's FLOPs per token pair over the dense part's per token, which the model's
shape gives (models/memory_model.py causal_attention_work_per_token_pair: 1/(12h) for GPT's
causal attention, f = 4h). Equal tokens are unequal work: a pack of one long document costs more
than one of many short ones.
"""
from __future__ import annotations

from typing import Sequence


def segments_work(lengths: Sequence[int], per_token_pair: float) -> int:
    """sum of s_i + per_token_pair * s_i^2 over the segment lengths, rounded to a whole token."""
    if per_token_pair < 0:
        raise ValueError(f"per_token_pair must be >= 0, got {per_token_pair}")
    return int(round(sum(int(s) for s in lengths)
                     + per_token_pair * sum(int(s) * int(s) for s in lengths)))
