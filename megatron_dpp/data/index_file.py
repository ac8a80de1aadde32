"""The lengths and document boundaries of an indexed dataset, read from its .idx file with numpy.

The data checks (data/datasets.py, data/bert_datasets.py) need only these two arrays, and they run
in the launchers' flag pre-check, where importing Megatron-Core's IndexedDataset would cost ~2.5 s
of imports (megatron.core pulls in torch.compile's machinery). The layout is Megatron-Core's
`_IndexReader`'s (megatron/core/datasets/indexed_dataset.py), version 1:

    b"MMIDIDX\\x00\\x00"  version <Q  dtype code <B  sequence count <Q  document count <Q
    sequence lengths  int32 x sequence count
    sequence pointers int64 x sequence count
    document indices  int64 x document count

tests/test_data_datasets.py checks that both readers agree on the sample data.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy

from megatron_dpp.data.errors import DataInputError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count


class IndexFileError(DataInputError):
    """An .idx file that is not Megatron-Core's indexed-dataset index; the message names it."""


@dataclass(frozen=True)
class IndexArrays:
    sequence_lengths: numpy.ndarray  # tokens of each sequence (int32)
    document_indices: numpy.ndarray  # sequence index where each document starts, then the end


def read_index(prefix: str) -> IndexArrays:
    """The arrays of `prefix`.idx (copies: no memory map stays open)."""
    path = prefix + ".idx"
    with open(path, "rb") as file:
        data = file.read()
    if len(data) < _HEADER.size:
        raise IndexFileError(f"{path} is too short for an index header ({len(data)} bytes)")
    magic, version, _dtype_code, sequences, documents = _HEADER.unpack_from(data)
    if magic != INDEX_MAGIC or version != INDEX_VERSION:
        raise IndexFileError(f"{path} is not a version-{INDEX_VERSION} Megatron indexed-dataset "
                             f"index (header {magic!r}, version {version})")
    needed = _HEADER.size + sequences * (4 + 8) + documents * 8
    if len(data) < needed:
        raise IndexFileError(f"{path} is truncated: {len(data)} bytes where its header promises "
                             f"{needed}")
    lengths = numpy.frombuffer(data, dtype=numpy.int32, count=sequences, offset=_HEADER.size)
    documents_at = _HEADER.size + sequences * (4 + 8)
    document_indices = numpy.frombuffer(data, dtype=numpy.int64, count=documents,
                                        offset=documents_at)
    return IndexArrays(lengths.copy(), document_indices.copy())
