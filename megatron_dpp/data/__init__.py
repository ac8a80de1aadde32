"""Data: the offline sample corpus, BPE and WordPiece tokenizers, indexed datasets (GPT and BERT),
and data iterators.

The public names below are imported on first use, so tools that need only the tokenizer (the
preprocessing workers, flag validation) do not pay for importing torch and megatron.core.
"""
import importlib

_PUBLIC = {
    "DataInputError": "megatron_dpp.data.errors",
    "GPT2BPETokenizer": "megatron_dpp.data.tokenizer",
    "BertWordPieceTokenizer": "megatron_dpp.data.tokenizer",
    "build_tokenizer": "megatron_dpp.data.tokenizer",
    "train_wordpiece_vocab": "megatron_dpp.data.tokenizer",
    "split_sentences": "megatron_dpp.data.sentences",
    "build_train_valid_test_datasets": "megatron_dpp.data.datasets",
    "build_bert_datasets": "megatron_dpp.data.bert_datasets",
    "build_data_iterators": "megatron_dpp.data.iterators",
    "collate_samples": "megatron_dpp.data.iterators",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
