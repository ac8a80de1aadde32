"""Data: the offline sample corpus and BPE tokenizer, indexed datasets, and data iterators.

The public names below are imported on first use, so tools that need only the tokenizer (the
preprocessing workers, flag validation) do not pay for importing torch and megatron.core.
"""
import importlib

_PUBLIC = {
    "DataInputError": "megatron_dpp.data.errors",
    "GPT2BPETokenizer": "megatron_dpp.data.tokenizer",
    "build_tokenizer": "megatron_dpp.data.tokenizer",
    "build_train_valid_test_datasets": "megatron_dpp.data.datasets",
    "build_data_iterators": "megatron_dpp.data.iterators",
    "collate_samples": "megatron_dpp.data.iterators",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
