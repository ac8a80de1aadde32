"""Train/valid/test BERT datasets: Megatron-Core's BERTMaskedWordPieceDataset through its
BlendedMegatronDatasetBuilder, configured the way Megatron-LM's pretrain_bert.py does.

The data is a sentence-split indexed dataset (preprocess_data --split-sentences): one sequence per
sentence, the document index marking each document's sentences. A sample packs consecutive
sentences of one document into [CLS] A [SEP] B [SEP] (B only with the binary head, swapped with A
half the time for sentence-order prediction), masks about mask_prob of its tokens (whole words,
n-grams up to 3) and pads it to seq_length. Samples are Megatron's dicts (see build_bert_datasets).

Megatron's sample mapping loops forever on a split with no document it can use, so asking samples
of such a split is a DataInputError with a one-line message, raised on every rank before any rank
builds (and again inside the dataset class, for callers that skip the up-front check). The flags'
defaults and the up-front checks need neither torch nor Megatron-Core (the launcher runs them before
it starts any rank); the dataset class imports both when built.
"""
from typing import Optional, Sequence

import numpy

from megatron_dpp.data.datasets import (_SPLIT_NAMES, DataSource, data_sources, megatron_blends,
                                        more_data_hint, samples_per_split, split_ranges)
from megatron_dpp.data.errors import DataInputError
from megatron_dpp.data.index_cache import index_cache_lock
from megatron_dpp.data.index_file import read_index

# The BERT flags' defaults (Megatron-LM's), used when args lacks the field.
BERT_ARG_DEFAULTS = {
    "mask_prob": 0.15,  # --mask-prob
    "short_seq_prob": 0.1,  # --short-seq-prob
    "bert_binary_head": True,  # off with --bert-no-binary-head
}
# Masking settings that Megatron-LM's pretrain_bert.py fixes (no flags).
MASKING_SETTINGS = {
    "masking_max_ngram": 3,
    "masking_do_full_word": True,
    "masking_do_permutation": False,
    "masking_use_longer_ngrams": False,
    "masking_use_geometric_distribution": False,
}
# [CLS] and two [SEP] around the sentences, which need at least 2 tokens between them (Megatron's
# sample mapping draws short targets as 2 + rand % (length - 1): length 1 divides by zero).
SPECIAL_TOKENS_PER_SAMPLE = 3
MIN_SEQ_LENGTH = SPECIAL_TOKENS_PER_SAMPLE + 2
# Megatron's sample mapping (helpers.cpp build_mapping) skips a document of two or more sentences
# when one of them is longer than this many tokens.
LONG_SENTENCE_TOKENS = 512


def bert_arg(args, name: str):
    """args.<name>, or its Megatron-LM default when args lacks it."""
    return getattr(args, name, BERT_ARG_DEFAULTS[name])


def min_sentences_per_sample(binary_head: bool) -> int:
    """Sentence-order prediction needs two segments, so two sentences; masked LM alone needs one."""
    return 2 if binary_head else 1


def usable_document_count(document_indices: numpy.ndarray, sentence_lengths: numpy.ndarray,
                          documents: Sequence[int], min_sentences: int) -> int:
    """How many of `documents` Megatron's sample mapping takes samples from.

    It takes a document with min_sentences or more sentences, unless the document has several
    sentences and one of them is over LONG_SENTENCE_TOKENS tokens.
    """
    documents = numpy.asarray(documents, dtype=numpy.int64)
    starts = document_indices[documents]
    ends = document_indices[documents + 1]
    sentences = ends - starts
    # long_before[i]: how many of the first i sentences are long.
    long_before = numpy.concatenate(([0], numpy.cumsum(sentence_lengths > LONG_SENTENCE_TOKENS)))
    has_long_sentence = long_before[ends] > long_before[starts]
    usable = (sentences >= min_sentences) & ~(has_long_sentence & (sentences > 1))
    return int(numpy.count_nonzero(usable))


def _split_has_no_usable_document(name: str, prefix: str, documents: int, wanted: int,
                                  min_sentences: int, per_split: bool) -> DataInputError:
    hints = f"preprocess with --split-sentences, or {more_data_hint(name, per_split)}"
    if min_sentences > 1:
        hints += ", or train with --bert-no-binary-head"
    if name != "train":
        hints += ", or --eval-iters 0"
    return DataInputError(
        f"the {name} split of {prefix} has {documents} documents but none BERT can sample "
        f"({min_sentences}+ sentences, none over {LONG_SENTENCE_TOKENS} tokens) yet {wanted} "
        f"samples are needed; {hints}")


def _empty_split(name: str, prefix: str, total_documents: int, per_split: bool) -> DataInputError:
    remedy = (more_data_hint(name, per_split) if per_split
              else "give it a larger share with --split, or a share of 0")
    return DataInputError(
        f"the {name} split of {prefix} has no documents ({total_documents} in all) and Megatron's "
        f"BERT dataset cannot be built empty; {remedy}")


def _document_structure(prefix: str):
    """(document_indices, sentence_lengths) of an indexed dataset, read from its .idx file only."""
    arrays = read_index(prefix)
    return arrays.document_indices, arrays.sequence_lengths


def check_bert_splits_have_data(source: DataSource, num_samples: Sequence[int],
                                binary_head: bool) -> None:
    """Raise DataInputError when a split with a share has no documents, or must provide samples
    but has no document Megatron's BERT sample mapping can use (it would loop forever).

    Deterministic and cheap (reads only the .idx files), so every rank reaches the same verdict
    before any rank builds. The split is over documents, as BERT's builder splits.
    """
    min_sentences = min_sentences_per_sample(binary_head)
    for position, prefix in enumerate(source.prefixes):
        if source.weights is not None and source.weights[position] == 0:
            continue
        document_indices, sentence_lengths = _document_structure(prefix)
        total = len(document_indices) - 1
        for name, wanted, documents in zip(_SPLIT_NAMES, num_samples,
                                           split_ranges(source.split, total)):
            if documents is None:
                continue
            if len(documents) == 0:
                raise _empty_split(name, prefix, total, source.per_split)
            if wanted and usable_document_count(document_indices, sentence_lengths, documents,
                                                min_sentences) == 0:
                raise _split_has_no_usable_document(name, prefix, len(documents), wanted,
                                                    min_sentences, source.per_split)


def _guarded_bert_dataset_class():
    from megatron_dpp.mcore.datasets import bert_dataset_with_sample_index_hook

    class GuardedBERTDataset(bert_dataset_with_sample_index_hook()):
        """BERTMaskedWordPieceDataset that refuses, instead of failing obscurely or looping
        forever, a split with no documents or no usable one, and that also builds in a process
        with no process group (one process, e.g. tests and tools)."""

        def check_sample_index(self, sequence_length: int, min_sentences: int) -> None:
            name, prefix = self.index_split.name, self.dataset_path
            per_split = self.config.split is None  # --valid-data-path, ...
            if len(self.indices) == 0:
                raise _empty_split(name, prefix, len(self.dataset.document_indices) - 1,
                                   per_split)
            if self.num_samples and usable_document_count(
                    self.dataset.document_indices, self.dataset.sequence_lengths, self.indices,
                    min_sentences) == 0:
                raise _split_has_no_usable_document(name, prefix, len(self.indices),
                                                    self.num_samples, min_sentences, per_split)

    return GuardedBERTDataset


def check_bert_args(args) -> None:
    """One-line DataInputError for BERT settings Megatron would assert on or crash with."""
    if args.seq_length < MIN_SEQ_LENGTH:
        raise DataInputError(f"--seq-length {args.seq_length} is too short for BERT: a sample "
                             f"holds [CLS], two [SEP] and at least 2 tokens (>= {MIN_SEQ_LENGTH})")
    mask_prob, short_seq_prob = bert_arg(args, "mask_prob"), bert_arg(args, "short_seq_prob")
    if not 0.0 < mask_prob < 1.0:
        raise DataInputError(f"--mask-prob must be in (0, 1), got {mask_prob}")
    if not 0.0 <= short_seq_prob <= 1.0:
        raise DataInputError(f"--short-seq-prob must be in [0, 1], got {short_seq_prob}")


def bert_dataset_config(args, tokenizer):
    """BERTMaskedWordPieceDatasetConfig from the parsed flags, as Megatron-LM's pretrain_bert.py."""
    from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDatasetConfig

    return BERTMaskedWordPieceDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        **megatron_blends(args),
        num_dataset_builder_threads=getattr(args, "num_dataset_builder_threads", 1),
        path_to_cache=getattr(args, "data_cache_path", None),
        tokenizer=tokenizer,
        masking_probability=bert_arg(args, "mask_prob"),
        short_sequence_probability=bert_arg(args, "short_seq_prob"),
        classification_head=bert_arg(args, "bert_binary_head"),
        **MASKING_SETTINGS,
    )


def build_bert_datasets(args, tokenizer,
                        train_val_test_num_samples: Optional[Sequence[int]] = None):
    """(train, valid, test) BERTMaskedWordPieceDatasets; a split with no share in --split is None.

    Call on every rank (the builder synchronizes ranks while it caches its indices). `tokenizer`
    is a BertWordPieceTokenizer (build_tokenizer with --tokenizer-type BertWordPieceLowerCase or
    BertWordPieceCase). train_val_test_num_samples defaults to Megatron-LM's counts from the
    training flags.

    Reads from args: data_path (PREFIX or W1 PREFIX1 W2 PREFIX2 ..., of sentence-split datasets)
    and split, or train/valid/test_data_path (each split's own), seq_length, seed, data_cache_path (absent: None, the cache goes beside the data),
    mask_prob, short_seq_prob, bert_binary_head (absent: BERT_ARG_DEFAULTS, Megatron-LM's 0.15,
    0.1 and True), and for the sample counts train_iters, global_batch_size, eval_iters,
    eval_interval (see datasets.samples_per_split).

    Each sample is Megatron's dict, with S = seq_length:
      text          int64 [S]  token ids: [CLS] A [SEP] (B [SEP]), masked, then [PAD] (id 0)
      types         int64 [S]  0 for [CLS] A [SEP], 1 for B [SEP], 0 on padding
      labels        int64 [S]  the original token at masked positions, -1 elsewhere
      is_random     int        1 if A and B were swapped (sentence-order label), else 0
      padding_mask  int64 [S]  1 on tokens, 0 on padding
      loss_mask     int64 [S]  1 at masked positions, else 0
      truncated     int        1 if the sentences were cut to fit, else 0
    Without the binary head a sample is one segment: types all 0 and is_random 0.
    Raises DataInputError (one line) for bad flags and for splits BERT cannot sample from.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder)

    num_samples = (list(train_val_test_num_samples) if train_val_test_num_samples is not None
                   else samples_per_split(args))
    check_bert_args(args)
    sources = data_sources(args)
    for source in sources:
        check_bert_splits_have_data(source, num_samples, bert_arg(args, "bert_binary_head"))

    config = bert_dataset_config(args, tokenizer)
    builder = BlendedMegatronDatasetBuilder(_guarded_bert_dataset_class(), num_samples,
                                            lambda: True, config)
    prefixes = [prefix for source in sources for prefix in source.prefixes]
    with index_cache_lock(prefixes, config.path_to_cache,
                          getattr(args, "distributed_timeout_minutes", None)):
        train, valid, test = builder.build()
    return train, valid, test
