"""GPT-2-style byte-level BPE tokenizer over local vocab.json + merges.txt (the `tokenizers` library).

Megatron-Core ships no pure-Python GPT-2 BPE tokenizer, so this class provides the interface its
GPTDataset uses (vocab_size, eod, tokenize, detokenize, unique_identifiers) on top of the Rust
`tokenizers` BPE model. Training a tokenizer on a local corpus lives here too.
"""
import json
import os
from collections import OrderedDict
from typing import Iterable, List, Sequence

from megatron_dpp.data.errors import DataInputError

EOD_TOKEN = "<|endoftext|>"
SUPPORTED_TOKENIZER_TYPES = ("GPT2BPETokenizer",)


class GPT2BPETokenizer:
    """Byte-level BPE with `<|endoftext|>` as end-of-document; decode(encode(text)) == text."""

    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import ByteLevelBPETokenizer

        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path or not os.path.isfile(path):
                raise DataInputError(
                    f"{flag} {path!r} does not exist; run `python -m megatron_dpp.data.prepare_sample "
                    f"--output-dir DIR` to make one, or pass the right path"
                )
        self._bpe = ByteLevelBPETokenizer.from_file(vocab_file, merge_file)
        self._vocab = self._bpe.get_vocab()
        if EOD_TOKEN not in self._vocab:
            raise DataInputError(f"--vocab-file {vocab_file!r} has no {EOD_TOKEN!r} token; a GPT-2 "
                                 f"vocabulary needs it as end-of-document")
        self._inv_vocab = {index: token for token, index in self._vocab.items()}
        self._eod = self._vocab[EOD_TOKEN]
        # GPTDataset hashes these into its index-cache file names (json.dumps of the config).
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("tokenizer_path", [vocab_file, merge_file])]
        )

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def vocab(self) -> dict:
        return self._vocab

    @property
    def inv_vocab(self) -> dict:
        return self._inv_vocab

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> List[int]:
        return self._bpe.encode(text).ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [encoding.ids for encoding in self._bpe.encode_batch(list(texts))]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._bpe.decode([int(i) for i in ids], skip_special_tokens=False)


def vocab_size_with_padding(vocab_size: int, divisible_by: int, tensor_parallel_size: int) -> int:
    """Megatron's rule: pad the embedding rows to a multiple of divisible_by * TP size."""
    multiple = divisible_by * tensor_parallel_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


def build_tokenizer(args) -> GPT2BPETokenizer:
    """Build the tokenizer named by --tokenizer-type; sets args.padded_vocab_size like Megatron-LM."""
    tokenizer_type = getattr(args, "tokenizer_type", "GPT2BPETokenizer")
    if tokenizer_type not in SUPPORTED_TOKENIZER_TYPES:
        raise DataInputError(f"--tokenizer-type {tokenizer_type} is not supported; "
                             f"use one of {', '.join(SUPPORTED_TOKENIZER_TYPES)}")
    tokenizer = GPT2BPETokenizer(args.vocab_file, args.merge_file)
    args.padded_vocab_size = vocab_size_with_padding(
        tokenizer.vocab_size,
        getattr(args, "make_vocab_size_divisible_by", 128),
        getattr(args, "tensor_model_parallel_size", 1),
    )
    return tokenizer


def train_bpe_tokenizer(texts: Iterable[str], output_dir: str, vocab_size: int) -> None:
    """Train a byte-level BPE on `texts`; writes output_dir/vocab.json and output_dir/merges.txt.

    The files are written under temporary names and renamed, so a crash never leaves half a
    tokenizer behind that a later run would take as finished.
    """
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2,
                            show_progress=False, special_tokens=[EOD_TOKEN])
    tmp_prefix = f"tmp{os.getpid()}"
    vocab_tmp, merges_tmp = bpe.save_model(output_dir, tmp_prefix)
    # Re-serialize the vocabulary with sorted keys so the file bytes are deterministic.
    with open(vocab_tmp, encoding="utf-8") as f:
        vocab = json.load(f)
    with open(vocab_tmp, "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False, sort_keys=True)
    os.replace(merges_tmp, os.path.join(output_dir, "merges.txt"))
    os.replace(vocab_tmp, os.path.join(output_dir, "vocab.json"))
