"""Hooks into Megatron-Core's dataset classes where they have no public one.

GPTDataset counts the epochs a split needs in the private `_get_num_epochs` (it loops forever on a
split with no tokens); BERT's MaskedWordPieceDataset builds its sample mapping in the private
`_build_sample_index` (it asks torch.distributed for the rank even without a process group). The
base classes here override each once and hand subclasses a public hook; data/ holds the checks.
The classes are made on first use: Megatron-Core and torch import only then.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Optional


@functools.cache
def gpt_dataset_with_epoch_hook():
    """GPTDataset whose `epochs_for_tokens(num_tokens_per_epoch)` is asked first: an int is the
    epoch count, None leaves it to Megatron-Core."""
    from megatron.core.datasets.gpt_dataset import GPTDataset

    class GPTDatasetWithEpochHook(GPTDataset):
        def epochs_for_tokens(self, num_tokens_per_epoch: int) -> Optional[int]:
            return None

        def _get_num_epochs(self, num_tokens_per_epoch: int) -> int:
            epochs = self.epochs_for_tokens(num_tokens_per_epoch)
            if epochs is None:
                return super()._get_num_epochs(num_tokens_per_epoch)
            return epochs

    return GPTDatasetWithEpochHook


@contextlib.contextmanager
def _as_the_only_rank():
    """torch.distributed.get_rank() answers 0 while no process group exists: Megatron's BERT index
    builder asks for the rank unconditionally (GPT's checks is_initialized() first)."""
    import torch

    original = torch.distributed.get_rank
    torch.distributed.get_rank = lambda group=None: 0
    try:
        yield
    finally:
        torch.distributed.get_rank = original


@functools.cache
def bert_dataset_with_sample_index_hook():
    """BERTMaskedWordPieceDataset that calls `check_sample_index(sequence_length, min_sentences)`
    (raise to refuse) before Megatron-Core builds its sample mapping, and that builds it in a
    process with no process group too (one process: tests and tools)."""
    import torch
    from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset

    class BERTDatasetWithSampleIndexHook(BERTMaskedWordPieceDataset):
        def check_sample_index(self, sequence_length: int, min_sentences: int) -> None:
            pass

        def _build_sample_index(self, sequence_length: int, min_sentences: int):
            self.check_sample_index(sequence_length, min_sentences)
            if torch.distributed.is_initialized():
                return super()._build_sample_index(sequence_length, min_sentences)
            with _as_the_only_rank():
                return super()._build_sample_index(sequence_length, min_sentences)

    return BERTDatasetWithSampleIndexHook
