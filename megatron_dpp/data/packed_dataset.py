"""The GPT/Llama dataset of --use-sequence-packing: whole documents packed into windows of
--seq-length tokens (data/packing.py says how and why), each sample one window.

Its index (which documents each window holds, all epochs num_samples needs) is cached as
Megatron-Core's GPTDataset caches its own: .npy files under --data-cache-path or beside the data
(`<prefix>/cache/<class>_indices`), named by the hash of the dataset's description (seed,
--seq-length, split, tokenizer, the packing algorithm). The rank Megatron-Core's builder lets
build first writes them, the others load them after its barrier; a rank that finds none builds
the same index itself. A blend and the splits are the builder's, as in the other modes.

A sample is Megatron's (tokens, labels, loss_mask, position_ids; attention_mask None: causal)
and "cu_seqlens", the int32 boundaries of its documents (the padding its own last segment), for
the per-document attention of the batch format shared with the data loader.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, Optional

import numpy

from megatron_dpp.data.datasets import more_data_hint
from megatron_dpp.data.errors import DataInputError
from megatron_dpp.data.packing import ALGORITHM, PackingIndex, efficiency, pack_epochs, window_arrays

_INDEX_FILES = ("document_index.npy", "window_index.npy")


def _builds_first() -> bool:
    """The process Megatron-Core's builder builds on first (global rank 0, or no process group)."""
    import torch

    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _save_atomically(path: str, write) -> None:
    """Write through a temporary file, so that a reader never finds half a cache file."""
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "wb") as handle:
        write(handle)
    os.replace(temporary, path)


def _load_or_build_index(paths: Optional[Dict[str, str]], description: str, build) -> PackingIndex:
    """The cached index where all its files exist, else build() (saved on the first rank)."""
    if paths is not None and all(os.path.isfile(path) for path in paths.values()):
        return PackingIndex(numpy.load(paths["document_index.npy"], mmap_mode="r"),
                            numpy.load(paths["window_index.npy"], mmap_mode="r"))
    index = build()
    if paths is not None and _builds_first():
        os.makedirs(os.path.dirname(paths["description.txt"]), exist_ok=True)
        _save_atomically(paths["document_index.npy"],
                         lambda handle: numpy.save(handle, index.documents))
        _save_atomically(paths["window_index.npy"],
                         lambda handle: numpy.save(handle, index.window_starts))
        _save_atomically(paths["description.txt"],
                         lambda handle: handle.write(description.encode("utf-8")))
    return index


def packed_dataset_class():
    import torch
    from megatron.core.datasets.gpt_dataset import GPTDataset
    from megatron.core.datasets.megatron_dataset import MegatronDataset

    class PackedDocumentsGPTDataset(MegatronDataset):
        """One sample = one window of whole documents (see the module's docstring)."""

        build_low_level_dataset = staticmethod(GPTDataset.build_low_level_dataset)
        numel_low_level_dataset = staticmethod(GPTDataset.numel_low_level_dataset)

        def __init__(self, indexed_dataset, dataset_path, indexed_indices, num_samples,
                     index_split, config):
            super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples,
                             index_split, config)
            # The packing is part of what the cached index depends on.
            self.unique_identifiers["packing"] = ALGORITHM
            self.unique_description = json.dumps(self.unique_identifiers, indent=4,
                                                 default=lambda obj: obj.unique_identifiers)
            self.unique_description_hash = hashlib.md5(
                self.unique_description.encode("utf-8"), usedforsecurity=False).hexdigest()

            window = config.sequence_length
            lengths = indexed_dataset.sequence_lengths
            documents = numpy.asarray(indexed_indices, dtype=numpy.int64)
            documents = documents[lengths[documents] >= 1]
            wanted = len(documents) if num_samples is None else num_samples
            if wanted > 0 and len(documents) == 0:
                raise DataInputError(
                    f"the {index_split.name} split of {dataset_path} has no tokens but {wanted} "
                    f"samples are needed; {more_data_hint(index_split.name, config.split is None)}")
            self.index = _load_or_build_index(
                self._cache_paths(), self.unique_description,
                lambda: pack_epochs(documents, lengths[documents], window, num_samples,
                                    config.random_seed))
            if _builds_first() and len(self.index):  # (a split asked for no samples: silent)
                cut = int(numpy.count_nonzero(lengths[documents] > window))
                print(f"[data] sequence packing, {index_split.name} split of "
                      f"{dataset_path or 'the generated documents'}: {len(documents)} documents "
                      f"in {len(self.index)} windows of {window} tokens ({ALGORITHM}), efficiency "
                      f"{100 * efficiency(self.index, lengths, window):.1f}% (real tokens / "
                      f"window tokens); {cut} documents longer than {window} tokens cut to it",
                      flush=True)

        def _cache_paths(self) -> Optional[Dict[str, str]]:
            """Where the index is cached (None: generated documents without --data-cache-path,
            built on every rank as Megatron-Core's GPTDataset does)."""
            directory = self.config.path_to_cache
            if directory is None and not self.config.mock:
                directory = os.path.join(self.dataset.path_prefix, "cache",
                                         f"{type(self).__name__}_indices")
            if directory is None:
                return None
            base = f"{self.unique_description_hash}-{type(self).__name__}-{self.index_split.name}"
            return {name: os.path.join(directory, f"{base}-{name}")
                    for name in ("description.txt", *_INDEX_FILES)}

        def __len__(self) -> int:
            return len(self.index)

        def __getitem__(self, idx: int) -> Dict[str, Optional["torch.Tensor"]]:
            window = self.config.sequence_length
            parts = []
            for document in self.index.window(idx):
                document = int(document)
                length = min(int(self.dataset.sequence_lengths[document]), window)
                parts.append(self.dataset.get(document, offset=0, length=length)
                             .astype(numpy.int64))
            mask_token = self.config.tokenizer.eod if self.config.eod_mask_loss else None
            sample = {key: torch.from_numpy(value)
                      for key, value in window_arrays(parts, window, mask_token).items()}
            sample["attention_mask"] = None  # causal; the model builds its own mask
            return sample

    return PackedDocumentsGPTDataset
