"""Data iterators for training: Megatron's pretraining sampler semantics, batch collation.

The sampler walks sample indices from `consumed_samples` on, in steps of micro_batch_size x
data-parallel size, and hands each data-parallel rank its own micro_batch_size slice. So resuming
at consumed_samples = iteration x global_batch_size continues the exact stream an uninterrupted run
would have seen, and the data-parallel ranks together see each sample once.
"""
import atexit
import functools
import weakref
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy
import torch

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


class PretrainingSampler:
    """Megatron-LM's MegatronPretrainingSampler: batches of indices for one data-parallel rank."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True):
        if total_samples <= 0:
            raise ValueError(f"no samples to draw from (total_samples={total_samples})")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} is not below the dataset "
                             f"size {total_samples}; the run already used all its data")
        if micro_batch_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"bad sampler sizes: micro_batch_size={micro_batch_size}, "
                             f"data_parallel_rank={data_parallel_rank}, "
                             f"data_parallel_size={data_parallel_size}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.step = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def _my_slice(self, batch: List[int]) -> List[int]:
        start = self.data_parallel_rank * self.micro_batch_size
        return batch[start:start + self.micro_batch_size]

    def __iter__(self) -> Iterator[List[int]]:
        batch: List[int] = []
        for index in range(self.consumed_samples, self.total_samples):
            batch.append(index)
            if len(batch) == self.step:
                yield self._my_slice(batch)
                batch = []
        if batch and not self.drop_last:
            yield self._my_slice(batch)


def collate_bert_samples(samples: Sequence[dict],
                         trim_padding: bool = False) -> Dict[str, torch.Tensor]:
    """Stack Megatron's BERT samples (all seq_length long) into tensors: [micro_batch, length]
    int64 for the arrays, [micro_batch] int64 for is_random and truncated.

    trim_padding (--variable-seq-lengths): the micro-batch is cut to its longest sample. Padding
    is always on the right and masked out of attention and of both losses, so the cut changes
    no real token's output, only the work of the micro-batch."""
    batch = {key: torch.as_tensor(numpy.stack([numpy.asarray(sample[key]) for sample in samples]),
                                  dtype=torch.int64)
             for key in samples[0]}
    if trim_padding:
        longest = int(batch["padding_mask"].sum(dim=1).max())
        batch = {key: value[:, :longest] if value.dim() == 2 else value
                 for key, value in batch.items()}
    return batch


def collate_samples(samples: Sequence[Dict[str, Optional[torch.Tensor]]],
                    pad_token: int = 0,
                    trim_padding: bool = False,
                    fold_documents: bool = False) -> Dict[str, Optional[torch.Tensor]]:
    """Stack samples into a [micro_batch, length] batch, padding to the longest sample.

    Padding goes on the right with loss_mask 0, so under a causal mask it changes neither the
    loss nor the real tokens' outputs. attention_mask is None unless the dataset made one.
    BERT's samples (a "text" key, already padded to seq_length) go to collate_bert_samples, which
    cuts their padding with trim_padding (GPT's variable-length samples come unpadded).

    fold_documents (--dataloader-inter-document-masking): samples carry their documents'
    boundaries ("cu_seqlens", data/documents.py); the batch gets "cu_seqlens", the boundaries of
    the rows laid end to end (int32; a row's padding is its own last segment, its positions from
    0), and "max_seqlen", the longest segment, and the micro-batch becomes that one row,
    [1, micro_batch * length], Megatron-Core's THD layout (one packed sequence per micro-batch).
    Without it, boundaries a sample carries (--use-sequence-packing's) are dropped: attention
    crosses the documents of a row, as Megatron's default.
    """
    if "text" in samples[0]:
        return collate_bert_samples(samples, trim_padding)
    longest = max(sample["tokens"].numel() for sample in samples)
    # Boundaries matter only where attention keeps to them: without the fold, attention spans
    # each row (Megatron's default), and so does the work the runtime prices (models/gpt.py).
    has_boundaries = fold_documents and "cu_seqlens" in samples[0]
    batch: Dict[str, Optional[torch.Tensor]] = {}
    for key in BATCH_KEYS:
        rows = []
        for sample in samples:
            value = sample[key]
            missing = longest - value.numel()
            if missing:
                if key == "position_ids":
                    start = 0 if has_boundaries else value.numel()  # a segment of its own
                    tail = torch.arange(start, start + missing, dtype=value.dtype)
                elif key == "loss_mask":
                    tail = torch.zeros(missing, dtype=value.dtype)
                else:
                    tail = torch.full((missing,), pad_token, dtype=value.dtype)
                value = torch.cat([value, tail])
            rows.append(value)
        batch[key] = torch.stack(rows)
    masks = [sample.get("attention_mask") for sample in samples]
    batch["attention_mask"] = None if any(m is None for m in masks) else torch.stack(masks)
    if has_boundaries:
        cu_seqlens = row_boundaries_end_to_end([sample["cu_seqlens"] for sample in samples],
                                               longest)
        batch["cu_seqlens"] = cu_seqlens
        batch["max_seqlen"] = int(cu_seqlens.diff().max())
    if fold_documents:
        if "cu_seqlens" not in samples[0]:
            raise ValueError("collate_samples: fold_documents needs samples with cu_seqlens")
        for key in BATCH_KEYS:
            batch[key] = batch[key].reshape(1, -1)
    return batch


def row_boundaries_end_to_end(boundaries: Sequence[torch.Tensor], row_length: int) -> torch.Tensor:
    """int32 boundaries of rows of row_length laid end to end, from each row's own (its padding
    past its last boundary a segment of its own)."""
    parts = [torch.zeros(1, dtype=torch.int32)]
    for row, cu_seqlens in enumerate(boundaries):
        ends = cu_seqlens[1:].to(torch.int32)
        if int(ends[-1]) < row_length:
            ends = torch.cat([ends, torch.tensor([row_length], dtype=torch.int32)])
        parts.append(ends + row * row_length)
    return torch.cat(parts)


def _data_parallel_position() -> Tuple[int, int]:
    """(rank, size) in the data-parallel group; (0, 1) before Megatron's groups exist."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return (parallel_state.get_data_parallel_rank(),
                parallel_state.get_data_parallel_world_size())
    return 0, 1


def build_data_loader(dataset, consumed_samples: int, micro_batch_size: int,
                      data_parallel_rank: int, data_parallel_size: int, num_workers: int = 0,
                      pad_token: int = 0,
                      trim_padding: bool = False,
                      fold_documents: bool = False) -> torch.utils.data.DataLoader:
    """A DataLoader over `dataset` that starts at consumed_samples (see PretrainingSampler);
    trim_padding, fold_documents: see collate_samples. Batches stay in pageable memory: pinning them (as
    Megatron-LM's loader does) made GPT-125m on one H200 slower, 450 and 553 ms per iteration
    against 370 ms pageable on the same machine (docs/gpu.md), since this loop is bound by the
    host, and pinning adds host work per micro-batch that the copies it makes asynchronous do not
    pay back."""
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                 data_parallel_rank, data_parallel_size)
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=num_workers,
        collate_fn=functools.partial(collate_samples, pad_token=pad_token,
                                     trim_padding=trim_padding, fold_documents=fold_documents),
        persistent_workers=num_workers > 0,
        # Each iterator draws its workers' base seed from this generator. From torch's default
        # one, it would take a draw from the stream CPU ranks' dropout uses, and a resumed run
        # (its iterators made after the checkpoint's RNG states are restored) would drop out
        # other values than the uninterrupted run.
        generator=torch.Generator())


# Loaders and iterators whose worker processes are to be stopped at exit (see _stop_workers).
_WITH_WORKERS: "weakref.WeakSet" = weakref.WeakSet()


def _stop_workers() -> None:
    """At exit, before multiprocessing's own exit handler (registered earlier, so it runs later):
    stop the worker processes of every loader still alive, as deleting it would. That handler
    SIGTERMs daemonic children, torch's DataLoader workers among them, and a worker killed so
    leaves its temporary directory behind (/tmp/pymp-*, with the socket through which it shared
    its batches' memory). Stopped by their loader, they exit cleanly and remove it."""
    for owner in list(_WITH_WORKERS):
        iterator = getattr(owner, "_iterator", owner)  # a DataLoader's persistent iterator
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


atexit.register(_stop_workers)  # after torch's import registered multiprocessing's handler


def _stopped_at_exit(owner):
    """`owner` (a DataLoader, or its iterator) with workers: stopped by _stop_workers at exit."""
    _WITH_WORKERS.add(owner)
    return owner


def build_data_iterators(args, train_ds, valid_ds, test_ds,
                         consumed_train_samples: Optional[int] = None,
                         consumed_valid_samples: Optional[int] = None,
                         data_parallel_rank: Optional[int] = None,
                         data_parallel_size: Optional[int] = None,
                         pad_token: int = 0):
    """(train, valid, test) iterators of batch dicts; None where the dataset is None.

    consumed_* default to args.consumed_train_samples / args.consumed_valid_samples (0 when
    absent): pass iteration x global_batch_size when resuming. The data-parallel rank and size
    default to Megatron's parallel state. valid and test cycle (evaluation restarts them), train
    does not: it holds exactly the samples the run asked for. With args.variable_seq_lengths
    every micro-batch is as long as its longest sample; with
    args.dataloader_inter_document_masking each is one packed row (see collate_samples).
    """
    if data_parallel_rank is None or data_parallel_size is None:
        data_parallel_rank, data_parallel_size = _data_parallel_position()
    if consumed_train_samples is None:
        consumed_train_samples = getattr(args, "consumed_train_samples", 0) or 0
    if consumed_valid_samples is None:
        consumed_valid_samples = getattr(args, "consumed_valid_samples", 0) or 0
    num_workers = getattr(args, "num_workers", 0)
    trim_padding = bool(getattr(args, "variable_seq_lengths", False))
    fold_documents = bool(getattr(args, "dataloader_inter_document_masking", False))

    def loader(dataset, consumed):
        built = build_data_loader(dataset, consumed, args.micro_batch_size, data_parallel_rank,
                                  data_parallel_size, num_workers, pad_token, trim_padding,
                                  fold_documents)
        return _stopped_at_exit(built) if num_workers > 0 else built

    train_iter = iter(loader(train_ds, consumed_train_samples)) if train_ds is not None else None
    if num_workers > 0 and train_iter is not None:
        _stopped_at_exit(train_iter)  # its loader may be gone: the iterator holds the workers
    valid_iter = (_cycle(loader(valid_ds, consumed_valid_samples % len(valid_ds)))
                  if valid_ds is not None and len(valid_ds) > 0 else None)
    test_iter = _cycle(loader(test_ds, 0)) if test_ds is not None and len(test_ds) > 0 else None
    return train_iter, valid_iter, test_iter


def _cycle(data_loader) -> Iterator[dict]:
    """Restart the loader when it runs out (not itertools.cycle: that replays cached batches)."""
    while True:
        produced = 0
        for batch in data_loader:
            produced += 1
            yield batch
        if produced == 0:
            raise ValueError("an evaluation dataset yields no full batch: it has fewer samples "
                             "than micro_batch_size x data-parallel size")
