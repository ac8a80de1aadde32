"""Train/valid/test GPT datasets on Megatron-Core's BlendedMegatronDatasetBuilder.

Three modes:
- fixed length (default): Megatron's GPTDataset, samples of exactly --seq-length tokens cut from
  the concatenated documents;
- variable length (--variable-seq-lengths): one sample is one document (one sequence of the
  indexed dataset, as preprocess_data writes them), truncated to --seq-length tokens, so
  microbatches have different lengths;
- packed (--use-sequence-packing): one sample is a window of --seq-length tokens holding whole
  documents, padded (packed_dataset.py; packing.py says how they are packed).
Each reads the indexed dataset of --data-path (split by --split), or each split's own with
--train-data-path / --valid-data-path / --test-data-path (Megatron-Core's blend_per_split), or
with --mock-data Megatron-Core's generated documents (MockGPTLowLevelDataset).

Each guards against GPTDataset's endless loop on a split with no tokens: asking samples of such a
split is a DataInputError with a one-line message, raised on every rank before any rank builds.

The checks (parse_data_path ... check_splits_have_data) need neither torch nor Megatron-Core: the
launcher runs them before it starts any rank. The dataset classes import both when built.
"""
import dataclasses
import math
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy

from megatron_dpp.data.errors import DataInputError
from megatron_dpp.data.index_cache import index_cache_lock
from megatron_dpp.data.index_file import read_index

_SPLIT_NAMES = ("train", "valid", "test")
# Megatron-LM's flags that give each split its own documents, in _SPLIT_NAMES' order.
PER_SPLIT_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")
PER_SPLIT_DESTS = ("train_data_path", "valid_data_path", "test_data_path")


def parse_data_path(data_path: Sequence[str], flag: str = "--data-path"
                    ) -> Tuple[List[str], Optional[List[float]]]:
    """Megatron's --data-path (or a per-split path, `flag`): `PREFIX` or `W1 PREFIX1 W2 PREFIX2
    ...` -> (prefixes, weights)."""
    if len(data_path) == 1:
        return [data_path[0]], None
    if len(data_path) % 2 != 0:
        raise DataInputError(f"{flag} takes one PREFIX or pairs WEIGHT PREFIX, got "
                             f"{len(data_path)} values: {' '.join(data_path)}")
    weights, prefixes = [], []
    for weight, prefix in zip(data_path[0::2], data_path[1::2]):
        try:
            weights.append(float(weight))
        except ValueError:
            raise DataInputError(f"{flag} weight {weight!r} is not a number; use "
                                 f"`{flag} W1 PREFIX1 W2 PREFIX2 ...`") from None
        prefixes.append(prefix)
    return prefixes, weights


def per_split_paths(args) -> List[Optional[Sequence[str]]]:
    """The --train/--valid/--test-data-path values (None where not given)."""
    return [getattr(args, dest, None) for dest in PER_SPLIT_DESTS]


def uses_per_split_paths(args) -> bool:
    return any(path is not None for path in per_split_paths(args))


def more_data_hint(split_name: str, per_split: bool) -> str:
    """How a user gives a split that lacks documents more of them, for the one-line errors."""
    if per_split:
        return f"give {PER_SPLIT_FLAGS[_SPLIT_NAMES.index(split_name)]} more data"
    return "give it a larger share with --split or use more data"


@dataclasses.dataclass(frozen=True)
class DataSource:
    """Documents some splits draw from: a blend of indexed datasets (`weights` None: one prefix,
    or weighted by size) and the train/valid/test shares of its documents (`split`, normalized)."""

    prefixes: List[str]
    weights: Optional[List[float]]
    split: List[float]
    per_split: bool  # one split's own documents (--valid-data-path, ...), not a --split share
    flag: str  # the flag that gave it: --data-path or a per-split path

    def more_data(self, split_name: str) -> str:
        return more_data_hint(split_name, self.per_split)


def data_sources(args) -> List[DataSource]:
    """The documents each split reads, as Megatron-LM's get_blend_and_blend_per_split: --data-path
    split by --split, or each --train/--valid/--test-data-path given, all of it for its split;
    none with --mock-data."""
    if uses_per_split_paths(args):
        sources = []
        for position, (flag, path) in enumerate(zip(PER_SPLIT_FLAGS, per_split_paths(args))):
            if path:
                prefixes, weights = parse_data_path(path, flag)
                share = [0.0, 0.0, 0.0]
                share[position] = 1.0
                sources.append(DataSource(prefixes, weights, share, per_split=True, flag=flag))
        return sources
    if getattr(args, "mock_data", False):
        return []
    prefixes, weights = parse_data_path(args.data_path)
    return [DataSource(prefixes, weights, parse_split(args.split), per_split=False,
                       flag="--data-path")]


def megatron_blends(args) -> Dict[str, object]:
    """BlendedMegatronDatasetConfig's blend, blend_per_split and split for the flags (no blend of
    either kind: generated documents, --mock-data)."""
    if uses_per_split_paths(args):
        blends = [parse_data_path(path, flag) if path else None
                  for flag, path in zip(PER_SPLIT_FLAGS, per_split_paths(args))]
        return {"blend": None, "blend_per_split": blends, "split": None}
    mock = bool(getattr(args, "mock_data", False))
    return {"blend": None if mock else parse_data_path(args.data_path),
            "blend_per_split": None, "split": args.split}


def parse_split(split: str) -> List[float]:
    """'969,30,1' -> normalized [train, valid, test] weights; one-line error when malformed. Quotes
    around it are the shell's, left in by a script that word-splits `"--split '99,1,0'"` (Megatron-
    LM's examples/llama/train_llama3_8b_h100_fp8.sh); Megatron-LM reads through them too."""
    try:
        values = [float(v) for v in split.strip().strip("'\"").replace("/", ",").split(",")
                  if v.strip()]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3 or any(v < 0 for v in values) or sum(values) <= 0:
        raise DataInputError(f"--split {split!r} must be up to three non-negative weights with a "
                             f"positive sum, e.g. 969,30,1")
    values += [0.0] * (3 - len(values))
    return [v / sum(values) for v in values]


def samples_per_split(args) -> List[int]:
    """Samples each split must provide, by Megatron-LM's rule (train, valid, test); with
    --train-samples the train split is asked for that many, as Megatron-LM asks, or for what
    the iterations draw where --rampup-batch-size's last ramp iteration ends past it
    (args.train_samples_drawn, set by the flag check)."""
    train = getattr(args, "train_samples", None) or args.train_iters * args.global_batch_size
    train = max(train, getattr(args, "train_samples_drawn", 0))
    eval_iters = getattr(args, "eval_iters", 0) or 0
    eval_interval = getattr(args, "eval_interval", None) or args.train_iters
    # One evaluation per --eval-interval and the one after the last iteration; --skip-train
    # evaluates once only.
    evaluations = 1 if getattr(args, "skip_train", False) else args.train_iters // eval_interval + 1
    valid = evaluations * eval_iters * args.global_batch_size
    test = eval_iters * args.global_batch_size
    return [train, valid, test]


def split_ranges(split_weights: List[float], num_sequences: int) -> List[Optional[range]]:
    """Sequence index ranges of each split (None: a split with no share), with the bookends and
    rounding of Megatron's builder (convert_split_vector_to_split_matrix: cumulative sums from 0,
    a zero-width share is None; tests/test_data_datasets.py compares the two). Computed here, not
    imported: the launchers' flag pre-check runs it, and importing Megatron-Core costs seconds."""
    bookends = [0.0]
    for weight in split_weights:
        bookends.append(bookends[-1] + weight)
    ranges: List[Optional[range]] = []
    for start, end in zip(bookends[:-1], bookends[1:]):
        if end - start == 0:
            ranges.append(None)
        else:
            ranges.append(range(int(round(start * num_sequences)), int(round(end * num_sequences))))
    return ranges


def min_tokens_for_a_sample(variable_seq_lengths: bool) -> int:
    """A sequence needs 2 tokens to give one (token, label) pair in the variable mode."""
    return 2 if variable_seq_lengths else 1


def check_splits_have_data(source: DataSource, num_samples: Sequence[int],
                           variable_seq_lengths: bool) -> None:
    """Raise DataInputError when a split of `source` that must provide samples has no usable
    tokens.

    GPTDataset would otherwise loop forever computing its epoch count. Deterministic and cheap
    (reads only the .idx files), so every rank reaches the same verdict before any rank builds.
    """
    min_tokens = min_tokens_for_a_sample(variable_seq_lengths)
    for position, prefix in enumerate(source.prefixes):
        if source.weights is not None and source.weights[position] == 0:
            continue
        lengths = read_index(prefix).sequence_lengths
        for name, wanted, indices in zip(_SPLIT_NAMES, num_samples,
                                         split_ranges(source.split, len(lengths))):
            if indices is None or wanted == 0:
                continue
            usable = lengths[indices.start:indices.stop]
            if int(numpy.count_nonzero(usable >= min_tokens)) == 0:
                has = (f"{len(indices)} documents but none with {min_tokens}+ tokens"
                       if len(indices) else "no documents")
                raise DataInputError(
                    f"the {name} split of {prefix} has {has} yet {wanted} samples are needed "
                    f"({len(lengths)} documents in the dataset); {source.more_data(name)}"
                    + (", or --eval-iters 0" if name != "train" else ""))


def _guarded_gpt_dataset_class():
    from megatron_dpp.mcore.datasets import gpt_dataset_with_epoch_hook

    class GuardedGPTDataset(gpt_dataset_with_epoch_hook()):
        """GPTDataset that refuses, instead of looping forever, to draw samples from no tokens."""

        def epochs_for_tokens(self, num_tokens_per_epoch: int) -> Optional[int]:
            if num_tokens_per_epoch == 0 and self.num_samples:
                raise DataInputError(
                    f"the {self.index_split.name} split of {self.dataset_path} has no tokens but "
                    f"{self.num_samples} samples are needed; "
                    f"{more_data_hint(self.index_split.name, self.config.split is None)}")
            if num_tokens_per_epoch == 0:
                # Asked for 0 samples (a blend's share of a split none are drawn from, of a
                # dataset whose share of that split rounds to no document): Megatron-Core's loop
                # would still want its one extra token and never end.
                return 1
            return None

    return GuardedGPTDataset


def _mock_dataset_class(dataset_class):
    """dataset_class over Megatron-Core's generated documents instead of an indexed dataset."""
    from megatron.core.datasets.gpt_dataset import MockGPTDataset

    return type(f"Mock{dataset_class.__name__}", (dataset_class,), {
        "build_low_level_dataset": staticmethod(MockGPTDataset.build_low_level_dataset),
        "numel_low_level_dataset": staticmethod(MockGPTDataset.numel_low_level_dataset),
    })


def _document_dataset_class():
    import torch
    from megatron.core.datasets.gpt_dataset import GPTDataset
    from megatron.core.datasets.megatron_dataset import MegatronDataset

    class DocumentPerSampleGPTDataset(MegatronDataset):
        """One sample = one sequence (document) of the indexed dataset, cut to seq_length tokens.

        The sample order is a per-epoch shuffle of the split's usable documents, repeated for as
        many epochs as num_samples needs; the same seed gives the same order on every rank.
        """

        build_low_level_dataset = staticmethod(GPTDataset.build_low_level_dataset)
        numel_low_level_dataset = staticmethod(GPTDataset.numel_low_level_dataset)

        def __init__(self, indexed_dataset, dataset_path, indexed_indices, num_samples,
                     index_split, config):
            super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples,
                             index_split, config)
            self.unique_identifiers["class"] = type(self).__name__
            lengths = indexed_dataset.sequence_lengths[indexed_indices]
            usable = numpy.asarray(indexed_indices)[lengths >= min_tokens_for_a_sample(True)]
            wanted = len(usable) if num_samples is None else num_samples
            if wanted > 0 and len(usable) == 0:
                raise DataInputError(
                    f"the {index_split.name} split of {dataset_path} has no document with 2 or "
                    f"more tokens but {wanted} samples are needed; "
                    f"{more_data_hint(index_split.name, config.split is None)}")
            rng = numpy.random.RandomState(config.random_seed)
            epochs = math.ceil(wanted / len(usable)) if wanted else 0
            order = [rng.permutation(usable) for _ in range(epochs)]
            self.sample_to_sequence = (numpy.concatenate(order)[:wanted] if order
                                       else numpy.zeros(0, dtype=numpy.int64))

        def __len__(self) -> int:
            return len(self.sample_to_sequence)

        def __getitem__(self, idx: int) -> Dict[str, Optional["torch.Tensor"]]:
            sequence = int(self.sample_to_sequence[idx])
            length = min(int(self.dataset.sequence_lengths[sequence]),
                         self.config.sequence_length + 1)
            text = torch.from_numpy(
                self.dataset.get(sequence, offset=0, length=length).astype(numpy.int64))
            tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
            loss_mask = torch.ones(tokens.numel(), dtype=torch.float)
            if self.config.eod_mask_loss:
                loss_mask[tokens == self.config.tokenizer.eod] = 0.0
            return {
                "tokens": tokens,
                "labels": labels,
                "loss_mask": loss_mask,
                "position_ids": torch.arange(tokens.numel(), dtype=torch.long),
                "attention_mask": None,  # causal; the model builds its own mask
            }

    return DocumentPerSampleGPTDataset


def _with_document_boundaries_class(dataset_class):
    """dataset_class whose samples carry their documents' boundaries (data/documents.py), for
    --dataloader-inter-document-masking. The subclass keeps the class name (the index cache's
    key): the samples' windows are the same."""
    from megatron_dpp.data.documents import with_document_boundaries

    def __getitem__(self, idx):
        return with_document_boundaries(dataset_class.__getitem__(self, idx),
                                        self.config.tokenizer.eod)

    return type(dataset_class.__name__, (dataset_class,), {"__getitem__": __getitem__})


def gpt_dataset_config(args, tokenizer):
    """GPTDatasetConfig from the parsed flags."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    reset_attention_mask = bool(getattr(args, "reset_attention_mask", False))
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        **megatron_blends(args),  # no blend of either kind: generated documents
        num_dataset_builder_threads=getattr(args, "num_dataset_builder_threads", 1),
        path_to_cache=getattr(args, "data_cache_path", None),
        tokenizer=tokenizer,
        reset_position_ids=bool(getattr(args, "reset_position_ids", False)),
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=bool(getattr(args, "eod_mask_loss", False)),
        # Causal attention needs no mask from the data; only document-reset masks do.
        create_attention_mask=reset_attention_mask,
        mmap_bin_files=bool(getattr(args, "mmap_bin_files", True)),  # --no-mmap-bin-files
    )


def build_train_valid_test_datasets(args, tokenizer,
                                    train_val_test_num_samples: Optional[Sequence[int]] = None):
    """(train, valid, test) datasets; a split with no share in --split is None.

    Call on every rank (the builder synchronizes ranks while it caches its indices).
    train_val_test_num_samples defaults to Megatron-LM's counts from the training flags.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder)

    num_samples = (list(train_val_test_num_samples) if train_val_test_num_samples is not None
                   else samples_per_split(args))
    variable = bool(getattr(args, "variable_seq_lengths", False))
    mock = bool(getattr(args, "mock_data", False))
    sources = data_sources(args)
    for source in sources:
        check_splits_have_data(source, num_samples, variable)

    config = gpt_dataset_config(args, tokenizer)
    if getattr(args, "use_sequence_packing", False):
        from megatron_dpp.data.packed_dataset import packed_dataset_class

        dataset_class = packed_dataset_class()
    elif variable:
        dataset_class = _document_dataset_class()
    else:
        dataset_class = _guarded_gpt_dataset_class()
    if mock:
        dataset_class = _mock_dataset_class(dataset_class)
    if getattr(args, "dataloader_inter_document_masking", False):
        dataset_class = _with_document_boundaries_class(dataset_class)
    builder = BlendedMegatronDatasetBuilder(dataset_class, num_samples, lambda: True, config)
    prefixes = [prefix for source in sources for prefix in source.prefixes]
    with index_cache_lock(prefixes, config.path_to_cache,
                          getattr(args, "distributed_timeout_minutes", None)):
        train, valid, test = builder.build()
    return train, valid, test


def dataset_files_missing(prefix: str) -> List[str]:
    """The .bin/.idx files of an indexed-dataset prefix that do not exist."""
    return [prefix + suffix for suffix in (".bin", ".idx") if not os.path.isfile(prefix + suffix)]
