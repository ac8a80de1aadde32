"""Packed long-context workloads for the simulator: documents packed whole into fixed windows,
each window's attention per document (issue 60).

Document lengths are lognormal (mean 2048 tokens, CV 1.5 by default); a document longer than the
window is cut into window-long pieces, each a document of its own; the pieces are packed greedily
in order (the next one goes into the open window if it fits, else the window is closed, its rest
padding, and a new one opened). Every window then holds the same tokens, so the same activation
bytes, but not the same work: pipeline/work.py's segments_work over its documents and its padding
(a segment of its own, as the data's cu_seqlens has it), with the model's attention cost per token
pair `per_token_pair` (models/memory_model.py causal_attention_work_per_token_pair; the sim knows
no model, so the caller gives it).
"""
from __future__ import annotations

import dataclasses
import math
from typing import List

import numpy as np

from megatron_dpp.pipeline import TaskGraph
from megatron_dpp.pipeline.placement import INTERLEAVED, named_placement
from megatron_dpp.pipeline.work import segments_work

DOCUMENT_MEAN = 2048.0
DOCUMENT_CV = 1.5
PACKED_WINDOWS = (8192, 32768)  # the long-context windows the benchmarks run


@dataclasses.dataclass(frozen=True)
class Pack:
    """One window: its documents' lengths in order, then the padding that fills it."""

    documents: tuple[int, ...]
    padding: int

    @property
    def segments(self) -> List[int]:
        """The attention's segments: every document, and the padding as one more."""
        return list(self.documents) + ([self.padding] if self.padding else [])


@dataclasses.dataclass(frozen=True)
class PackedLongContext:
    """Windows of `window` tokens packed whole from lognormal documents."""

    window: int
    per_token_pair: float
    mean_document: float = DOCUMENT_MEAN
    cv: float = DOCUMENT_CV

    def __post_init__(self):
        if self.window < 1 or self.mean_document < 1 or self.cv <= 0 or self.per_token_pair < 0:
            raise ValueError("PackedLongContext: window >= 1, mean_document >= 1, cv > 0 and "
                             "per_token_pair >= 0")

    def documents(self, rng: np.random.Generator, count: int) -> List[int]:
        """`count` document lengths (lognormal with this mean and CV, at least one token)."""
        sigma = math.sqrt(math.log(1.0 + self.cv ** 2))
        drawn = rng.lognormal(math.log(self.mean_document) - sigma ** 2 / 2, sigma, count)
        return [max(1, int(round(x))) for x in drawn]

    def cut(self, lengths: List[int]) -> List[int]:
        """Each document as pieces of at most one window (the last piece the rest)."""
        pieces = []
        for length in lengths:
            whole, rest = divmod(length, self.window)
            pieces += [self.window] * whole + ([rest] if rest else [])
        return pieces

    def packs(self, count: int, rng: np.random.Generator) -> List[Pack]:
        """`count` windows packed greedily in order from freshly drawn documents."""
        packs: List[Pack] = []
        current: List[int] = []
        while len(packs) < count:
            for piece in self.cut(self.documents(rng, 64)):
                if sum(current) + piece > self.window:
                    packs.append(Pack(tuple(current), self.window - sum(current)))
                    current = []
                    if len(packs) == count:
                        break
                current.append(piece)
        return packs

    def work(self, packs: List[Pack]) -> List[int]:
        """Each window's work in tokens: W + per_token_pair * sum of s_i^2 over its segments."""
        return [segments_work(pack.segments, self.per_token_pair) for pack in packs]

    def graph(self, P: int, V: int, M: int, seed: int, bytes_per_token: int = 1,
              split_backward: bool = False, placement: str = INTERLEAVED) -> TaskGraph:
        """M windows of seed's draw: sizes their work, act_bytes their (equal) tokens' bytes."""
        packs = self.packs(M, np.random.default_rng(seed))
        window_bytes = self.window * bytes_per_token
        return TaskGraph(P, V, M, self.work(packs), [window_bytes] * M,
                         max_act_bytes=window_bytes, split_backward=split_backward,
                         placement=named_placement(placement, P, V))
