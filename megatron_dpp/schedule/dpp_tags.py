"""Message tags of the DPP runtime.

Activations and gradients are tagged by the task that RECEIVES them (iteration, direction, microbatch,
receiving chunk): a (rank, chunk) pair receives at most one message per (direction, microbatch), so
tags are unique per peer. Tensor-parallel decisions use their own direction, numbered by sequence.
"""
from __future__ import annotations

from megatron_dpp.comm.tags import Direction, encode_tag
from megatron_dpp.schedule import Phase, Task


def message_tag(iteration: int, receiving_task: Task) -> int:
    direction = Direction.ACTIVATION if receiving_task.phase == Phase.F else Direction.GRADIENT
    return encode_tag(iteration, direction, receiving_task.microbatch, receiving_task.chunk)


def decision_tag(iteration: int, sequence: int) -> int:
    return encode_tag(iteration, Direction.CONTROL, sequence, 0)
