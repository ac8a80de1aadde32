"""The lengths and document boundaries of an indexed dataset, read from its .idx file with numpy;
and whether its .bin is as long as the .idx says (bin_file_problem: the standard library only).

The data checks (data/datasets.py, data/bert_datasets.py) need only these two arrays, and they run
in the launchers' flag pre-check, where importing Megatron-Core's IndexedDataset would cost ~2.5 s
of imports (megatron.core pulls in torch.compile's machinery). The layout is Megatron-Core's
`_IndexReader`'s (megatron/core/datasets/indexed_dataset.py), version 1:

    b"MMIDIDX\\x00\\x00"  version <Q  dtype code <B  sequence count <Q  document count <Q
    sequence lengths  int32 x sequence count
    sequence pointers int64 x sequence count
    document indices  int64 x document count

tests/test_data_datasets.py checks that both readers agree on the sample data; tests/
test_data_bin_size.py that a .bin shorter than its .idx, or empty, is refused before launch.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Optional

from megatron_dpp.data.errors import DataInputError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
# Bytes per token of each dtype code (Megatron-Core's DType: uint8 1, int8 2, int16 3, int32 4,
# int64 5, float64 6, float32 7, uint16 8).
_ITEMSIZE = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}


class IndexFileError(DataInputError):
    """An .idx file that is not Megatron-Core's indexed-dataset index; the message names it."""


@dataclass(frozen=True)
class IndexArrays:
    sequence_lengths: numpy.ndarray  # tokens of each sequence (int32)
    document_indices: numpy.ndarray  # sequence index where each document starts, then the end


def read_index(prefix: str) -> IndexArrays:
    """The arrays of `prefix`.idx (copies: no memory map stays open)."""
    import numpy  # here: bin_file_problem, below, needs the standard library only

    path = prefix + ".idx"
    with open(path, "rb") as file:
        data = file.read()
    if len(data) < _HEADER.size:
        raise IndexFileError(f"{path} is too short for an index header ({len(data)} bytes)")
    _dtype_code, sequences, documents = _check_header(path, data[:_HEADER.size], len(data))
    lengths = numpy.frombuffer(data, dtype=numpy.int32, count=sequences, offset=_HEADER.size)
    documents_at = _HEADER.size + sequences * (4 + 8)
    document_indices = numpy.frombuffer(data, dtype=numpy.int64, count=documents,
                                        offset=documents_at)
    return IndexArrays(lengths.copy(), document_indices.copy())


def _check_header(path: str, header: bytes, size: int) -> tuple:
    """(dtype code, sequence count, document count) of an .idx file of `size` bytes whose first
    bytes are `header`; IndexFileError naming it where it is not a whole index."""
    if len(header) < _HEADER.size:
        raise IndexFileError(f"{path} is too short for an index header ({size} bytes)")
    magic, version, dtype_code, sequences, documents = _HEADER.unpack_from(header)
    if magic != INDEX_MAGIC or version != INDEX_VERSION:
        raise IndexFileError(f"{path} is not a version-{INDEX_VERSION} Megatron indexed-dataset "
                             f"index (header {magic!r}, version {version})")
    needed = _HEADER.size + sequences * (4 + 8) + documents * 8
    if size < needed:
        raise IndexFileError(f"{path} is truncated: {size} bytes where its header promises "
                             f"{needed}")
    return dtype_code, sequences, documents


def bin_bytes_needed(prefix: str) -> tuple:
    """(bytes the .bin must hold at least, sequence count) for `prefix`.idx: the end of its last
    sequence, pointer[-1] + length[-1] x the dtype's size (0 without sequences). Reads the header
    and those two numbers only (the standard library: the launchers' flag check runs it)."""
    path = prefix + ".idx"
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        dtype_code, sequences, _documents = _check_header(path, file.read(_HEADER.size), size)
        if sequences == 0:
            return 0, 0
        itemsize = _ITEMSIZE.get(dtype_code)
        if itemsize is None:
            raise IndexFileError(f"{path} has an unknown token type (dtype code {dtype_code}; "
                                 f"Megatron-Core's are 1 to 8)")
        file.seek(_HEADER.size + (sequences - 1) * 4)
        (last_length,) = struct.unpack("<i", file.read(4))
        file.seek(_HEADER.size + sequences * 4 + (sequences - 1) * 8)
        (last_pointer,) = struct.unpack("<q", file.read(8))
    return last_pointer + last_length * itemsize, sequences


def bin_file_problem(prefix: str) -> Optional[str]:
    """What is wrong with `prefix`.bin against `prefix`.idx, in words naming both and their sizes,
    or None: it is empty, or shorter than the end of the last sequence the index points to (a
    copy cut short). Longer is accepted (Megatron-Core reads only what the index points to). The
    .bin's size only: no byte of it is read."""
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    found = os.path.getsize(bin_path)
    needed, sequences = bin_bytes_needed(prefix)
    if found == 0 and sequences == 0:
        return (f"{bin_path} is empty (0 bytes), and {idx_path} indexes no sequence: no tokens to "
                f"read; remake both with tools/preprocess_data.py from documents with text")
    if found == 0:
        return (f"{bin_path} is empty: expected at least {needed} bytes, as {idx_path} says "
                f"({sequences} sequences), found 0; remake both with tools/preprocess_data.py")
    if found < needed:
        return (f"{bin_path} is shorter than {idx_path} says: expected at least {needed} bytes "
                f"(the end of its last sequence), found {found}; copy it again or remake both "
                f"with tools/preprocess_data.py")
    return None
