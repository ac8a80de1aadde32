"""Message tags: which tensor a point-to-point message carries, as one non-negative 63-bit int.

Task tags (bit 62 clear) name a dynamic-schedule message by what it is:
    bits 32..61  iteration   (30 bits)
    bit  31      direction   (FORWARD: activations to the next stage, BACKWARD: gradients back)
    bits  9..30  microbatch  (22 bits)
    bits  0..8   chunk       (9 bits: the sender's local model chunk)
Sequence tags (bit 62 set) number the messages of one ordered stream, for Megatron's own schedules
whose sends and receives pair up in program order:
    bit  61      direction
    bits  0..60  sequence number
"""
from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple

ITERATION_BITS = 30
MICROBATCH_BITS = 22
CHUNK_BITS = 9
SEQUENCE_BITS = 61
_SEQUENCE_FLAG = 1 << 62


class Direction(IntEnum):
    FORWARD = 0  # activations, towards the next pipeline stage
    BACKWARD = 1  # gradients, towards the previous pipeline stage


class TaskTag(NamedTuple):
    iteration: int
    direction: Direction
    microbatch: int
    chunk: int


class SequenceTag(NamedTuple):
    direction: Direction
    sequence: int


def _check(name: str, value: int, bits: int) -> None:
    if not 0 <= value < (1 << bits):
        raise ValueError(f"tag field {name}={value} out of range [0, {1 << bits})")


def encode_tag(iteration: int, direction: Direction, microbatch: int, chunk: int) -> int:
    _check("iteration", iteration, ITERATION_BITS)
    _check("microbatch", microbatch, MICROBATCH_BITS)
    _check("chunk", chunk, CHUNK_BITS)
    return (
        (iteration << 32)
        | (int(Direction(direction)) << 31)
        | (microbatch << CHUNK_BITS)
        | chunk
    )


def encode_sequence_tag(direction: Direction, sequence: int) -> int:
    _check("sequence", sequence, SEQUENCE_BITS)
    return _SEQUENCE_FLAG | (int(Direction(direction)) << SEQUENCE_BITS) | sequence


def decode_tag(tag: int) -> TaskTag | SequenceTag:
    if not 0 <= tag < (1 << 63):
        raise ValueError(f"tag {tag} is not a non-negative 63-bit int")
    if tag & _SEQUENCE_FLAG:
        return SequenceTag(Direction((tag >> SEQUENCE_BITS) & 1), tag & ((1 << SEQUENCE_BITS) - 1))
    return TaskTag(
        iteration=tag >> 32,
        direction=Direction((tag >> 31) & 1),
        microbatch=(tag >> CHUNK_BITS) & ((1 << MICROBATCH_BITS) - 1),
        chunk=tag & ((1 << CHUNK_BITS) - 1),
    )
