"""The data flags (--data-path, --split, the tokenizer files, --variable-seq-lengths, ...; --help's
"data" group) and their checks: the files exist, the blend and the split parse. Which samples a
model builds from the data is the model's (models/families.py, ModelFamily.check_data), which
megatron_dpp.arguments passes in: the data package does not import models.

The datasets module (and with it megatron.core) is imported only when the flags are checked.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable, Optional, Sequence

from megatron_dpp.data.tokenizer import (DEFAULT_TOKENIZER_TYPE, SUPPORTED_TOKENIZER_TYPES,
                                         check_tokenizer_files, check_vocab_size)
from megatron_dpp.flag_errors import ArgsError, add_refused_flags, require, require_output_dir


ModelDataCheck = Callable[[argparse.Namespace, Sequence[str], Any, list, list], None]
"""(args, data prefixes, blend weights, split weights, samples each split must give): raises
megatron_dpp.data.errors.DataInputError when the data cannot give the model's samples."""


# Megatron-LM's data flags that cannot apply here: flag -> why (flag_errors.py).
REFUSED_DATA_FLAGS = {
    "--tiktoken-pattern": "configures TikTokenizer (Llama 3's), which is not a --tokenizer-type "
                          "here (Llama 2's Llama2Tokenizer is)",
}


def add_data_args(parser: argparse.ArgumentParser,
                  tokenizer_types: Sequence[str] = SUPPORTED_TOKENIZER_TYPES) -> None:
    """tokenizer_types: the choices of --tokenizer-type (megatron_dpp.arguments gives the ones
    some model trains with)."""
    group = parser.add_argument_group("data")
    group.add_argument("--data-path", nargs="*", default=None,
                       help="Indexed dataset prefix (PREFIX for PREFIX.bin/.idx), or a blend "
                            "`W1 PREFIX1 W2 PREFIX2 ...`. `python -m megatron_dpp.data.prepare_sample "
                            "--output-dir data` makes data/sample_text_document.")
    group.add_argument("--mock-data", action="store_true",
                       help="Train on Megatron-Core's generated documents (MockGPTDataset: "
                            "token ids 1, 2, 3, ... of random lengths up to 4095, each ended by "
                            "the end-of-document token) instead of --data-path; GPT and Llama. "
                            "The tokenizer still gives the vocabulary: e.g. `--tokenizer-type "
                            "NullTokenizer --vocab-size 128256`.")
    group.add_argument("--split", type=str, default="969, 30, 1",
                       help="Train, validation and test weights of the documents, e.g. 969,30,1.")
    group.add_argument("--data-cache-path", type=str, default=None,
                       help="Where dataset index caches go (default: beside the data).")
    group.add_argument("--tokenizer-type", type=str, default=None, choices=tokenizer_types,
                       help="GPT2BPETokenizer (GPT's and Llama's default: byte-level BPE, needs "
                            "--vocab-file vocab.json and --merge-file), Llama2Tokenizer (GPT or "
                            "Llama: Llama 2's SentencePiece model, needs --tokenizer-model) or "
                            "BertWordPieceLowerCase / BertWordPieceCase (BERT's, lower-case the "
                            "default: WordPiece, needs --vocab-file vocab.txt).")
    group.add_argument("--vocab-file", type=str, default=None,
                       help="The tokenizer's vocabulary: BPE vocab.json (GPT2BPETokenizer) or "
                            "WordPiece vocab.txt (BERT's).")
    group.add_argument("--merge-file", type=str, default=None,
                       help="Path to the BPE merges.txt (GPT2BPETokenizer only).")
    group.add_argument("--tokenizer-model", type=str, default=None,
                       help="The SentencePiece model file, e.g. Llama 2's tokenizer.model "
                            "(Llama2Tokenizer only; needs the sentencepiece package).")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="NullTokenizer's vocabulary: token ids 0..N-1, and N the "
                            "end-of-document token (NullTokenizer only).")
    group.add_argument("--variable-seq-lengths", action="store_true",
                       help="Micro-batches of different lengths. GPT: one document per sample, "
                            "truncated to --seq-length, padded to the longest within a "
                            "micro-batch. BERT: each micro-batch cut to its longest sample "
                            "(BERT's padding is masked, so the losses are unchanged).")
    group.add_argument("--reset-position-ids", action="store_true",
                       help="Restart position ids after each end-of-document token.")
    group.add_argument("--reset-attention-mask", action="store_true",
                       help="Block attention across end-of-document tokens (makes the data loader "
                            "build an explicit attention mask).")
    group.add_argument("--eod-mask-loss", action="store_true",
                       help="Exclude end-of-document tokens from the loss.")
    group.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                       dest="create_attention_mask_in_dataloader",
                       help="Accepted for Megatron-LM command lines, and always so here for GPT "
                            "and Llama: the data loader builds no causal mask (the model applies "
                            "causality itself); it builds a mask only for --reset-attention-mask, "
                            "which this flag would leave without one.")
    group.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files",
                       help="Read the dataset's .bin files instead of memory-mapping them "
                            "(Megatron-Core's GPT dataset; GPT and Llama).")
    group.add_argument("--num-workers", type=int, default=0,
                       help="Data loader worker processes (0: load in the training process).")
    add_refused_flags(group, REFUSED_DATA_FLAGS, taking_a_value=("--tiktoken-pattern",))


def validate_data_args(args: argparse.Namespace,
                       check_model_data: Optional[ModelDataCheck] = None) -> None:
    """check_model_data: the model's own check that the data gives the samples each split
    needs (each model builds its samples its own way: token windows, packed sentences), run
    after the checks of the data itself; megatron_dpp.arguments gives the model family's."""
    # Imported here: the data package pulls in megatron.core only when a check needs it.
    from megatron_dpp.data.datasets import (dataset_files_missing, parse_data_path, parse_split,
                                            samples_per_split)
    from megatron_dpp.data.errors import DataInputError

    if args.mock_data:  # Megatron-LM's rule: one data source
        require(not args.data_path, "--mock-data generates the documents, --data-path reads "
                                    "them: give one of the two")
    else:
        require(args.data_path, "--data-path is required (or --mock-data for generated "
                                "documents); make the sample data with `python -m "
                                "megatron_dpp.data.prepare_sample --output-dir data` and pass "
                                "--data-path data/sample_text_document")
    try:
        prefixes, weights = parse_data_path(args.data_path) if args.data_path else ([], None)
        for prefix in prefixes:
            missing = dataset_files_missing(prefix)
            require(not missing, f"--data-path {prefix}: {' and '.join(missing)} not found; make "
                                 f"it with tools/preprocess_data.py or `python -m "
                                 f"megatron_dpp.data.prepare_sample --output-dir DIR`")
        tokenizer_type = args.tokenizer_type or DEFAULT_TOKENIZER_TYPE
        check_tokenizer_files(tokenizer_type,
                              {"vocab_file": args.vocab_file, "merge_file": args.merge_file,
                               "tokenizer_model": args.tokenizer_model})
        check_vocab_size(tokenizer_type, args.vocab_size)
        split = parse_split(args.split)
        if args.data_cache_path is not None:  # Megatron's index cache is written there
            require_output_dir("--data-cache-path", args.data_cache_path)
        require(args.num_workers >= 0, "--num-workers must be >= 0")
        require(args.create_attention_mask_in_dataloader or not args.reset_attention_mask,
                "--reset-attention-mask needs the attention mask the data loader builds, which "
                "--no-create-attention-mask-in-dataloader turns off: remove one of the two")
        if args.variable_seq_lengths:
            require(not (args.reset_position_ids or args.reset_attention_mask),
                    "--variable-seq-lengths puts one document per sample, so --reset-position-ids "
                    "and --reset-attention-mask do not apply; remove them")
        # Generated documents have tokens in every split (MockGPTDataset's 100000 of them).
        if check_model_data is not None and not args.mock_data:
            check_model_data(args, prefixes, weights, split, samples_per_split(args))
    except DataInputError as error:
        raise ArgsError(str(error)) from None
