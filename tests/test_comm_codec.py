"""comm/codec.py, the wire header in Python: byte-identical to the compiled transports' header
(csrc/common/wire_header.h through shm_tensor._C), round trips every dtype, refuses damage."""
import pytest
import torch

from megatron_dpp.comm import codec
from megatron_dpp.comm.errors import ProtocolError

CASES = [
    (torch.float32, (3, 5)), (torch.bfloat16, (2, 3, 4)), (torch.float16, (0,)), (torch.int64, ()),
    (torch.bool, (6,)), (torch.uint8, (1, 1, 1, 1, 1, 1, 1, 2)), (torch.float64, (7,)),
    (torch.complex64, (2, 2)), (torch.float8_e4m3fn, (5,)),
]


@pytest.mark.parametrize("dtype,shape", CASES)
def test_header_matches_the_compiled_transports_byte_for_byte(dtype, shape):
    shm_tensor = pytest.importorskip("shm_tensor._C")
    tensor = torch.zeros(shape, dtype=dtype)
    ours = codec.encode_header(tensor, tag=(1 << 62) + 12345, src_rank=7)
    assert len(ours) == codec.HEADER_BYTES
    assert ours == shm_tensor.encode_header(tensor, (1 << 62) + 12345, 7, 0)


@pytest.mark.parametrize("dtype,shape", CASES)
def test_header_round_trips(dtype, shape):
    tensor = torch.zeros(shape, dtype=dtype)
    header = codec.decode_header(codec.encode_header(tensor, 42, 3), 1 << 30, peer=3)
    assert header == codec.Header(42, 3, dtype, tuple(shape), tensor.numel() * tensor.element_size())


def test_damaged_or_foreign_headers_are_refused_with_peer_and_tag():
    good = bytearray(codec.encode_header(torch.zeros(4), 9, 1))
    flipped = bytearray(good)
    flipped[40] ^= 1  # a shape byte: the checksum no longer matches
    with pytest.raises(ProtocolError, match=r"peer=1, tag=9\): header checksum mismatch"):
        codec.decode_header(bytes(flipped), 1 << 20, peer=1)
    with pytest.raises(ProtocolError, match="bad header magic"):
        codec.decode_header(bytes(8) + bytes(good[8:]), 1 << 20, peer=1)
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        codec.decode_header(bytes(good), 8, peer=1)
    with pytest.raises(ProtocolError, match="got 5 bytes"):
        codec.decode_header(b"short", 1 << 20, peer=1)


def test_headers_of_compiled_only_payloads_are_refused():
    shm_tensor = pytest.importorskip("shm_tensor._C")
    header = shm_tensor.encode_header(torch.zeros(4), 9, 1, shm_tensor.FLAG_SINGLE_COPY)
    with pytest.raises(ProtocolError, match="compiled transport"):
        codec.decode_header(header, 1 << 20, peer=1)


def test_too_many_dimensions_and_unknown_dtypes_are_refused():
    with pytest.raises(ValueError, match="at most 8"):
        codec.encode_header(torch.zeros([1] * 9), 0, 0)
    with pytest.raises(ValueError, match="no wire code"):
        codec.encode_header(torch.empty(2, dtype=torch.quint8), 0, 0)
