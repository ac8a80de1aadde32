"""The data flags (--data-path, --split, the tokenizer files, --variable-seq-lengths, ...; --help's
"data" group) and their checks: the files exist (each .bin as long as its .idx says), the blend
and the split parse. Which samples a model builds from the data is the model's (models/
families.py, ModelFamily.check_data), which megatron_dpp.arguments passes in: the data package
does not import models.

The datasets module (and with it megatron.core) is imported only when the flags are checked.
"""
from __future__ import annotations

import argparse
import json
from typing import Any, Callable, Optional, Sequence

from megatron_dpp.data.tokenizer import (DEFAULT_TIKTOKEN_NUM_SPECIAL_TOKENS,
                                         DEFAULT_TIKTOKEN_VOCAB_SIZE, DEFAULT_TOKENIZER_TYPE,
                                         SUPPORTED_TOKENIZER_TYPES, TIKTOKEN_PATTERNS,
                                         TIKTOKEN_SPECIAL_TOKENS, WORDPIECE_LOWER_CASE,
                                         check_padded_vocab_size,
                                         check_tokenizer_args,
                                         check_tokenizer_files, check_vocab_size)
from megatron_dpp.data import megatron_lm_flags
from megatron_dpp.flag_errors import (ArgsError, add_refused_flags, add_stated_flags, require,
                                      require_output_dir)


ModelDataCheck = Callable[[argparse.Namespace, Sequence[Any], list], None]
"""(args, the data's sources (datasets.DataSource: --data-path split by --split, or each split's
own path), samples each split must give): raises megatron_dpp.data.errors.DataInputError when
the data cannot give the model's samples."""


# --split's default: Megatron-LM's ("legacy") one where --data-path is given without --split.
DEFAULT_SPLIT = "969, 30, 1"
# --dataloader-type: the kind that runs here, and why Megatron-LM's others do not.
DATALOADER_TYPE = "single"
REFUSED_DATALOADER_TYPES = {
    "cyclic": "(Megatron-LM's MegatronPretrainingRandomSampler: a reshuffle of the dataset every "
              "epoch) is not built here: the sampler walks Megatron-Core's dataset, whose samples "
              "are shuffled already, in order (single, Megatron-LM's default)",
    "external": "(the training script's own iterator in place of the data loader) is not built "
                "here: the trainer builds its data loader from the data flags",
}
# Megatron-LM's tokenizer flags that do not apply to the tokenizers here: flag -> why.
REFUSED_TOKENIZER_FLAGS = {
    "--tokenizer-sentencepiece-legacy": "(megatron.core's SentencePiece wrapper reading special "
                                        "tokens' text) is not a choice here: Llama2Tokenizer and "
                                        "GPTSentencePieceTokenizer read the model as Megatron-LM's "
                                        "trainer does, without it",
}
# Megatron-LM's data flags that cannot apply here: flag -> why (flag_errors.py).
REFUSED_DATA_FLAGS: dict = {**megatron_lm_flags.REFUSED_DATA, **REFUSED_TOKENIZER_FLAGS}


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
    group.add_argument("--train-data-path", nargs="*", default=None,
                       help="The training split's own documents, as --data-path (PREFIX or a "
                            "blend `W1 PREFIX1 ...`), instead of a --split share of --data-path; "
                            "with --valid-data-path and --test-data-path (each optional: a split "
                            "without one is not built, so no evaluation without "
                            "--valid-data-path).")
    group.add_argument("--valid-data-path", nargs="*", default=None,
                       help="The validation split's own documents; see --train-data-path.")
    group.add_argument("--test-data-path", nargs="*", default=None,
                       help="The test split's own documents; see --train-data-path.")
    group.add_argument("--data-args-path", type=str, default=None, metavar="FILE",
                       help="A file holding --data-path's values (PREFIX, or W1 PREFIX1 W2 "
                            "PREFIX2 ..., separated by any white space), for blends too long for "
                            "a command line; relative prefixes are taken from the directory the "
                            "trainer runs in (the launchers: the repository root). Not with "
                            "--data-path.")
    group.add_argument("--per-split-data-args-path", type=str, default=None, metavar="FILE",
                       help="A JSON file {\"train\": ..., \"valid\": ..., \"test\": ...}: each "
                            "split's --train/--valid/--test-data-path values, as a string or a "
                            "list (train required, valid and test optional). Not with those "
                            "flags.")
    group.add_argument("--split", type=str, default=None,
                       help="Train, validation and test weights of --data-path's documents "
                            f"(default {DEFAULT_SPLIT!r}, Megatron-LM's).")
    group.add_argument("--data-cache-path", type=str, default=None,
                       help="Where dataset index caches go (default: beside the data).")
    group.add_argument("--tokenizer-type", type=str, default=None, choices=tokenizer_types,
                       help="GPT2BPETokenizer (GPT's and Llama's default: byte-level BPE, needs "
                            "--vocab-file vocab.json and --merge-file), Llama2Tokenizer (GPT or "
                            "Llama: Llama 2's SentencePiece model, needs --tokenizer-model), "
                            "GPTSentencePieceTokenizer (GPT or Llama: a SentencePiece model, "
                            "no BOS, needs --tokenizer-model), "
                            "HuggingFaceTokenizer (GPT or Llama: a local Hugging Face tokenizer "
                            "directory such as Llama 3's, needs --tokenizer-model DIR and the "
                            "transformers package), TikTokenizer (GPT or Llama: a tiktoken "
                            "vocabulary in Megatron-LM's JSON format, needs --tokenizer-model "
                            "FILE.json, --tiktoken-pattern and the tiktoken package), "
                            "NullTokenizer (GPT or Llama: ids without a "
                            "file, needs --vocab-size) or BertWordPieceLowerCase / "
                            "BertWordPieceCase (BERT's, lower-case the default: WordPiece, needs "
                            "--vocab-file vocab.txt).")
    group.add_argument("--vocab-file", type=str, default=None,
                       help="The tokenizer's vocabulary: BPE vocab.json (GPT2BPETokenizer) or "
                            "WordPiece vocab.txt (BERT's).")
    group.add_argument("--merge-file", type=str, default=None,
                       help="Path to the BPE merges.txt (GPT2BPETokenizer only).")
    group.add_argument("--tokenizer-model", type=str, default=None,
                       help="The SentencePiece model file, e.g. Llama 2's tokenizer.model "
                            "(Llama2Tokenizer, GPTSentencePieceTokenizer), the directory of a "
                            "Hugging Face tokenizer, e.g. Llama 3's tokenizer.json and "
                            "tokenizer_config.json (HuggingFaceTokenizer), or the tiktoken "
                            "vocabulary's JSON file (TikTokenizer); local files only, nothing is "
                            "downloaded.")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="NullTokenizer's vocabulary: token ids 0..N-1, and N the "
                            "end-of-document token; or TikTokenizer's, special tokens included "
                            f"(default {DEFAULT_TIKTOKEN_VOCAB_SIZE}, Megatron-LM's: the file's "
                            "first N - --tiktoken-num-special-tokens tokens). NullTokenizer and "
                            "TikTokenizer only.")
    group.add_argument("--padded-vocab-size", type=int, default=None,
                       help="The embedding's and the output layer's rows, used as given "
                            "(Megatron-LM's; Qwen2.5's 151936): at least the tokenizer's "
                            "vocabulary and divisible by --tensor-model-parallel-size. Default: "
                            "the vocabulary padded to a multiple of "
                            "--make-vocab-size-divisible-by x --tensor-model-parallel-size.")
    group.add_argument("--tiktoken-pattern", choices=tuple(TIKTOKEN_PATTERNS), default=None,
                       help="TikTokenizer's, and required by it (as in Megatron-LM): the "
                            "expression that splits the text before BPE, Megatron-LM's v1 or "
                            "v2; the one the vocabulary was made with. Another tokenizer ignores "
                            "it, as Megatron-LM's (a warning says so).")
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=None, metavar="N",
                       help="TikTokenizer only: ids 0..N-1 are special tokens "
                            f"(default {DEFAULT_TIKTOKEN_NUM_SPECIAL_TOKENS}, Megatron-LM's), "
                            "--tiktoken-special-tokens first, then fillers <SPECIAL_i>.")
    group.add_argument("--tiktoken-special-tokens", nargs="+", default=None, metavar="TOKEN",
                       help="TikTokenizer only: the first special tokens, in id order "
                            f"(default {' '.join(TIKTOKEN_SPECIAL_TOKENS)}; they must be among "
                            "them: unknown, BOS, and EOS the end-of-document token).")
    group.add_argument("--tokenizer-special-tokens", nargs="+", default=None, metavar="TOKEN",
                       help="Megatron-LM's newer name of --tiktoken-special-tokens (which its "
                            "trainer copies here): TikTokenizer only; give one of the two.")
    group.add_argument("--variable-seq-lengths", action="store_true",
                       help="Micro-batches of different lengths. GPT: one document per sample, "
                            "truncated to --seq-length, padded to the longest within a "
                            "micro-batch. BERT: each micro-batch cut to its longest sample "
                            "(BERT's padding is masked, so the losses are unchanged).")
    group.add_argument("--use-sequence-packing", action="store_true",
                       help="GPT and Llama: pack whole documents into samples of --seq-length "
                            "tokens, none split across two samples (a document longer than "
                            "--seq-length is cut to it; the build log says how many), padding "
                            "the rest of a sample with loss mask 0. Position ids restart at each "
                            "document; attention still crosses documents (Megatron's default). "
                            "Named after Megatron-LM's --rl-use-sequence-packing, which packs "
                            "whole sequences the same way; Megatron-LM has no flag for it on "
                            "--data-path data.")
    group.add_argument("--reset-position-ids", action="store_true",
                       help="Restart position ids after each end-of-document token.")
    group.add_argument("--reset-attention-mask", action="store_true",
                       help="Block attention across end-of-document tokens (makes the data loader "
                            "build an explicit attention mask).")
    group.add_argument("--dataloader-inter-document-masking", action="store_true",
                       help="Attention stays inside each document of a packed sample (GPT and "
                            "Llama, as Megatron-LM's flag): each sample carries its documents' "
                            "boundaries (a document ends with its end-of-document token), "
                            "position ids restart per document, and a micro-batch runs as one "
                            "packed row (Megatron-Core's THD format, PackedSeqParams). Cost: the "
                            "sum of the squared document lengths, no dense mask. Needs the SDPA "
                            "or flash-attn core attention (auto picks SDPA); not with "
                            "--reset-attention-mask (that one builds a dense mask).")
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
    group.add_argument("--num-dataset-builder-threads", type=int, default=1, metavar="N",
                       help="Threads per rank that build a blend's datasets (their index files) "
                            "at start-up, as Megatron-LM (default 1: one after the other).")
    group.add_argument("--dataloader-type", choices=[DATALOADER_TYPE, *REFUSED_DATALOADER_TYPES],
                       default=None,
                       help="Megatron-LM's data loader kinds; single runs here (and is its "
                            "default): every sample once, in order from the consumed samples "
                            "on, each data-parallel rank its slice of every step (Megatron-LM's "
                            "MegatronPretrainingSampler). cyclic and external are refused in one "
                            "line with the reason.")
    group.add_argument("--num-workers", type=int, default=2,
                       help="Data loader worker processes per loader (default 2, Megatron-LM's; "
                            "0: build the batches in the training process).")
    add_refused_flags(group, REFUSED_DATA_FLAGS, taking_values=REFUSED_DATA_FLAGS)
    add_stated_flags(group, megatron_lm_flags.STATED_DATA)


def _read_data_args_files(args: argparse.Namespace) -> dict:
    """--data-args-path / --per-split-data-args-path: their values into args.data_path / the
    per-split paths (Megatron-LM's get_blend_and_blend_per_split reads the same files). Returns
    {flag: what to name in an error about its prefixes} for the flags the files gave."""
    from megatron_dpp.data.datasets import PER_SPLIT_DESTS, PER_SPLIT_FLAGS, per_split_paths

    named = {}
    if args.data_args_path is not None:
        require(args.data_path is None,
                "--data-args-path holds --data-path's values: give one of the two")
        words = _read_data_file(args.data_args_path, "--data-args-path").split()
        require(words, f"--data-args-path {args.data_args_path} is empty; write PREFIX or "
                       f"W1 PREFIX1 W2 PREFIX2 ... in it")
        args.data_path = words
        named["--data-path"] = f"--data-args-path {args.data_args_path}"
    if args.per_split_data_args_path is not None:
        path, flag = args.per_split_data_args_path, "--per-split-data-args-path"
        given = next((f for f, p in zip(PER_SPLIT_FLAGS, per_split_paths(args)) if p is not None),
                     None)
        require(given is None, f"{flag} holds {given}'s values: give one of the two")
        try:
            content = json.loads(_read_data_file(path, flag))
        except json.JSONDecodeError as error:
            raise ArgsError(f"{flag} {path} is not JSON: {error}") from None
        require(isinstance(content, dict) and "train" in content,
                f"{flag} {path} must hold a JSON object with a \"train\" key (and optionally "
                f"\"valid\" and \"test\")")
        unknown = sorted(set(content) - {"train", "valid", "test"})
        if unknown:
            raise ArgsError(f"{flag} {path}: unknown key {unknown[0]!r}; the keys are train, "
                            f"valid and test")
        for key, dest, split_flag in zip(("train", "valid", "test"), PER_SPLIT_DESTS,
                                         PER_SPLIT_FLAGS):
            value = content.get(key)
            if value is None:
                continue
            require(isinstance(value, (str, list)),
                    f"{flag} {path}: {key} must be a string or a list, like {split_flag}'s values")
            words = value.split() if isinstance(value, str) else [str(word) for word in value]
            setattr(args, dest, words)
            named[split_flag] = f"{flag} {path} ({key})"
    return named


def _read_data_file(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError as error:
        raise ArgsError(f"{flag} {path}: {error.strerror or error}") from None


def _check_one_data_source(args: argparse.Namespace, named: dict) -> None:
    """Megatron-LM's rule, one source of documents: --mock-data, --data-path (split by --split),
    or each split's own path; --split given its default where it applies. `named`: what to call
    a flag whose values came from a file (_read_data_args_files)."""
    from megatron_dpp.data.datasets import PER_SPLIT_FLAGS, per_split_paths

    per_split = [named.get(flag, flag) for flag, path in zip(PER_SPLIT_FLAGS, per_split_paths(args))
                 if path is not None]
    data_path = named.get("--data-path", "--data-path")
    if args.mock_data:
        given = data_path if args.data_path else (per_split[0] if per_split else None)
        require(given is None, f"--mock-data generates the documents, {given} reads them: give "
                               f"one of the two")
    elif per_split:
        require(not args.data_path,
                f"{data_path} (split by --split) and {per_split[0]} (a split's own documents) "
                f"are two sources of data: give one of the two")
        require(args.split is None,
                f"--split shares --data-path's documents out; with {per_split[0]} each split "
                f"reads its own: remove --split")
        require(args.train_data_path is not None,
                f"{per_split[0]} needs --train-data-path: the documents to train on")
        for flag, path in zip(PER_SPLIT_FLAGS, per_split_paths(args)):
            require(path is None or len(path) > 0,
                    f"{flag} needs PREFIX or a blend `W1 PREFIX1 W2 PREFIX2 ...`")
    else:
        require(args.data_path, "--data-path is required (or --mock-data for generated "
                                "documents, or --train-data-path ... for each split's own); make "
                                "the sample data with `python -m "
                                "megatron_dpp.data.prepare_sample --output-dir data` and pass "
                                "--data-path data/sample_text_document")
    if not per_split and args.split is None:
        args.split = DEFAULT_SPLIT


def _check_a_split_to_evaluate(args: argparse.Namespace) -> None:
    """--skip-train only evaluates: the validation or the test split must have documents (where
    neither has, Megatron-LM's evaluation stops at a missing validation iterator)."""
    if not getattr(args, "skip_train", False):
        return
    from megatron_dpp.data.datasets import parse_split, uses_per_split_paths

    if uses_per_split_paths(args):
        require(args.valid_data_path is not None or args.test_data_path is not None,
                "--skip-train only evaluates, and without --valid-data-path and "
                "--test-data-path no split has documents to evaluate; give one of them")
    else:
        _train, valid, test = parse_split(args.split)
        require(valid > 0 or test > 0,
                f"--skip-train only evaluates, and --split {args.split} gives the validation "
                f"and the test split no documents; give one of them a share")


def _check_sequence_packing(args: argparse.Namespace) -> None:
    """--use-sequence-packing builds its own GPT/Llama samples: the flags that make other ones
    cannot go with it."""
    if not args.use_sequence_packing:
        return
    # The WordPiece tokenizers are BERT's alone (the model's check chose one): the data package
    # names no model.
    tokenizer_type = args.tokenizer_type or DEFAULT_TOKENIZER_TYPE
    require(tokenizer_type not in WORDPIECE_LOWER_CASE,
            "--use-sequence-packing packs GPT and Llama documents; BERT's samples "
            f"(--tokenizer-type {tokenizer_type}) are Megatron-Core's packed sentence pairs: "
            "remove it")
    require(not args.variable_seq_lengths,
            "--use-sequence-packing packs several documents into each --seq-length sample, "
            "--variable-seq-lengths puts one document in each: give one of the two")
    require(not args.reset_position_ids,
            "--use-sequence-packing restarts the position ids at each document already: remove "
            "--reset-position-ids")
    require(not args.reset_attention_mask,
            "--reset-attention-mask masks attention at end-of-document tokens; a packed sample "
            "carries its documents' boundaries (cu_seqlens) instead and no mask: remove it")


def validate_data_args(args: argparse.Namespace,
                       check_model_data: Optional[ModelDataCheck] = None) -> None:
    """check_model_data: the model's own check that the data gives the samples each split
    needs (each model builds its samples its own way: token windows, packed sentences), run
    after the checks of the data itself; megatron_dpp.arguments gives the model family's."""
    # Imported here: the data package pulls in megatron.core only when a check needs it.
    from megatron_dpp.data.datasets import data_sources, dataset_files_missing, samples_per_split
    from megatron_dpp.data.errors import DataInputError
    from megatron_dpp.data.index_file import bin_file_problem

    named = _read_data_args_files(args)
    _check_one_data_source(args, named)
    try:
        _check_a_split_to_evaluate(args)
        sources = data_sources(args)
        for source in sources:
            for prefix in source.prefixes:
                missing = dataset_files_missing(prefix)
                where = (f"{named[source.flag]}: {prefix}" if source.flag in named
                         else f"{source.flag} {prefix}")
                require(not missing, f"{where}: {' and '.join(missing)} not found; make it with "
                                     f"tools/preprocess_data.py or `python -m "
                                     f"megatron_dpp.data.prepare_sample --output-dir DIR`")
                problem = bin_file_problem(prefix)  # the .bin as long as its .idx says
                require(problem is None, f"{where}: {problem}")
        tokenizer_type = args.tokenizer_type or DEFAULT_TOKENIZER_TYPE
        check_tokenizer_files(tokenizer_type,
                              {"vocab_file": args.vocab_file, "merge_file": args.merge_file,
                               "tokenizer_model": args.tokenizer_model})
        check_vocab_size(tokenizer_type, args.vocab_size)
        check_tokenizer_args(tokenizer_type, args)  # TikTokenizer's flags; some files read
        check_padded_vocab_size(args.padded_vocab_size, args.tensor_model_parallel_size)
        if args.data_cache_path is not None:  # Megatron's index cache is written there
            require_output_dir("--data-cache-path", args.data_cache_path)
        require(args.num_workers >= 0, "--num-workers must be >= 0")
        if args.dataloader_type is None:  # Megatron-LM's validate_args: not given, single
            args.dataloader_type = DATALOADER_TYPE
        require(args.dataloader_type == DATALOADER_TYPE,
                f"--dataloader-type {args.dataloader_type} "
                f"{REFUSED_DATALOADER_TYPES.get(args.dataloader_type)}; remove it")
        require(args.num_dataset_builder_threads >= 1,
                "--num-dataset-builder-threads must be at least 1")
        require(args.create_attention_mask_in_dataloader or not args.reset_attention_mask,
                "--reset-attention-mask needs the attention mask the data loader builds, which "
                "--no-create-attention-mask-in-dataloader turns off: remove one of the two")
        require(not (args.dataloader_inter_document_masking and args.reset_attention_mask),
                "--dataloader-inter-document-masking keeps attention inside each document "
                "without a mask, --reset-attention-mask builds the dense mask for the same: give "
                "one of the two")
        if args.variable_seq_lengths:
            require(not (args.reset_position_ids or args.reset_attention_mask),
                    "--variable-seq-lengths puts one document per sample, so --reset-position-ids "
                    "and --reset-attention-mask do not apply; remove them")
        _check_sequence_packing(args)
        # Generated documents have tokens in every split (MockGPTDataset's 100000 of them).
        if check_model_data is not None and not args.mock_data:
            check_model_data(args, sources, samples_per_split(args))
    except DataInputError as error:
        raise ArgsError(str(error)) from None
