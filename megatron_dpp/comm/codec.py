"""The wire header every transport puts before a tensor's bytes, in Python.

The one header format of the project (csrc/common/wire_header.h defines the same 128 bytes for the
compiled transports): magic, version, tag, dtype code, shape, payload bytes, sender rank, flags and
an FNV-1a checksum, little-endian. Transports that frame messages in Python (torch.distributed
today) encode and decode through this module only, so they need no compiled extension, and a
header written here reads the same in C++ (tests/test_comm_codec.py checks byte equality).
"""
from __future__ import annotations

import struct
from typing import NamedTuple

import torch

from megatron_dpp.comm.errors import ProtocolError

MAGIC = 0x54505044  # "DPPT" read as little-endian bytes
VERSION = 1
MAX_DIMS = 8
HEADER_BYTES = 128
# struct layout of wire_header.h's WireHeader, without its final checksum field.
_BODY = struct.Struct(f"<IHHqii{MAX_DIMS}qQiI2Q")
_CHECKSUM = struct.Struct("<Q")
assert _BODY.size + _CHECKSUM.size == HEADER_BYTES

# Flags the compiled transports set; a Python transport writes 0 and refuses the others.
FLAG_CUDA_IPC = 1 << 0
FLAG_SINGLE_COPY = 1 << 1

# Stable dtype codes (wire_header.h's DType): independent of torch's numbering.
_DTYPE_CODES = {
    torch.bool: 1, torch.uint8: 2, torch.int8: 3, torch.int16: 4, torch.int32: 5, torch.int64: 6,
    torch.uint16: 7, torch.uint32: 8, torch.uint64: 9, torch.float16: 10, torch.bfloat16: 11,
    torch.float32: 12, torch.float64: 13, torch.complex32: 14, torch.complex64: 15,
    torch.complex128: 16, torch.float8_e4m3fn: 17, torch.float8_e5m2: 18,
    torch.float8_e4m3fnuz: 19, torch.float8_e5m2fnuz: 20,
}
_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


class Header(NamedTuple):
    tag: int
    src_rank: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def _checksum(body: bytes) -> int:
    value = 1469598103934665603
    for byte in body:
        value = ((value ^ byte) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return value


def encode_header(tensor: torch.Tensor, tag: int, src_rank: int) -> bytes:
    """The HEADER_BYTES bytes that announce `tensor` (its dtype, shape and byte count) as `tag`."""
    code = _DTYPE_CODES.get(tensor.dtype)
    if code is None:
        raise ValueError(f"dtype {tensor.dtype} has no wire code; send it as a supported dtype "
                         "(e.g. view as uint8)")
    shape = tuple(tensor.shape)
    if len(shape) > MAX_DIMS:
        raise ValueError(f"tensor has {len(shape)} dimensions; the wire header carries at most "
                         f"{MAX_DIMS}")
    nbytes = tensor.numel() * tensor.element_size()
    body = _BODY.pack(MAGIC, VERSION, HEADER_BYTES, tag, code, len(shape),
                      *shape, *([0] * (MAX_DIMS - len(shape))), nbytes, src_rank, 0, 0, 0)
    return body + _CHECKSUM.pack(_checksum(body))


def decode_header(data: bytes, max_payload_bytes: int, peer: int) -> Header:
    """The header `encode_header` wrote; ProtocolError naming `peer` and the tag when it is not one
    (corrupted, another version, flags a Python transport cannot serve, or too large a payload)."""
    if len(data) != HEADER_BYTES:
        raise ProtocolError(f"decode_header(peer={peer}): got {len(data)} bytes, a header has "
                            f"{HEADER_BYTES}")
    body = data[:_BODY.size]
    (magic, version, size, tag, code, ndim, *rest) = _BODY.unpack(body)
    shape_words = rest[:MAX_DIMS]
    nbytes, src_rank, flags = rest[MAX_DIMS:MAX_DIMS + 3]  # then two reserved words

    def fail(problem: str) -> ProtocolError:
        return ProtocolError(f"decode_header(peer={peer}, tag={tag}): {problem}")

    if magic != MAGIC:
        raise fail(f"bad header magic {magic:#x} (expected {MAGIC:#x})")
    if version != VERSION or size != HEADER_BYTES:
        raise fail(f"header version {version} / size {size} does not match this build (version "
                   f"{VERSION}, size {HEADER_BYTES}); run the same version on both sides")
    stored, = _CHECKSUM.unpack(data[_BODY.size:])
    if stored != _checksum(body):
        raise fail("header checksum mismatch: the header was corrupted")
    if flags:
        raise fail(f"header flags {flags:#x} name a compiled transport's payload; this transport "
                   "carries plain bytes only")
    dtype = _DTYPES.get(code)
    if dtype is None:
        raise fail(f"unknown dtype code {code}")
    if not 0 <= ndim <= MAX_DIMS:
        raise fail(f"bad ndim {ndim}")
    shape = tuple(shape_words[:ndim])
    if any(dim < 0 for dim in shape):
        raise fail(f"negative dimension in shape {shape}")
    numel = 1
    for dim in shape:
        numel *= dim
    expected = numel * torch.empty((), dtype=dtype).element_size()
    if expected != nbytes:
        raise fail(f"payload size {nbytes} B does not match shape and dtype ({expected} B)")
    if nbytes > max_payload_bytes:
        raise fail(f"payload of {nbytes} B exceeds the limit of {max_payload_bytes} B")
    return Header(tag, src_rank, dtype, shape, nbytes)
