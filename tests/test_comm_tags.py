"""Message tags: every field survives encode/decode, task and sequence tags never collide."""
import pytest
from hypothesis import given, strategies as st

from megatron_dpp.comm.tags import (
    CHUNK_BITS, ITERATION_BITS, MICROBATCH_BITS, SEQUENCE_BITS, Direction, SequenceTag, TaskTag,
    decode_tag, encode_sequence_tag, encode_tag,
)

directions = st.sampled_from(list(Direction))


@given(st.integers(0, (1 << ITERATION_BITS) - 1), directions,
       st.integers(0, (1 << MICROBATCH_BITS) - 1), st.integers(0, (1 << CHUNK_BITS) - 1))
def test_task_tag_round_trip(iteration, direction, microbatch, chunk):
    tag = encode_tag(iteration, direction, microbatch, chunk)
    assert 0 <= tag < (1 << 63)
    assert decode_tag(tag) == TaskTag(iteration, direction, microbatch, chunk)


@given(directions, st.integers(0, (1 << SEQUENCE_BITS) - 1))
def test_sequence_tag_round_trip(direction, sequence):
    tag = encode_sequence_tag(direction, sequence)
    assert 0 <= tag < (1 << 63)
    assert decode_tag(tag) == SequenceTag(direction, sequence)


def test_fields_out_of_range_are_rejected():
    with pytest.raises(ValueError, match="microbatch"):
        encode_tag(0, Direction.FORWARD, 1 << MICROBATCH_BITS, 0)
    with pytest.raises(ValueError, match="chunk"):
        encode_tag(0, Direction.FORWARD, 0, -1)
    with pytest.raises(ValueError, match="iteration"):
        encode_tag(1 << ITERATION_BITS, Direction.BACKWARD, 0, 0)
    with pytest.raises(ValueError):
        decode_tag(-1)


def test_forward_and_backward_of_one_task_differ():
    assert encode_tag(3, Direction.FORWARD, 5, 1) != encode_tag(3, Direction.BACKWARD, 5, 1)
