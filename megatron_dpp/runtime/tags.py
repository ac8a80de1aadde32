"""Message tags of the DPP runtime, in megatron_dpp.comm.tags' task-tag layout.

An activation or gradient is tagged (iteration, direction, microbatch, SENDER's local chunk), as
comm/tags.py defines: from one peer, one direction and one microbatch, each sender chunk sends at most
one message per iteration, so (peer, tag) is unique.

Tensor-parallel decisions travel between ranks of one tensor-parallel group, which never exchange
pipeline messages (the groups are orthogonal), so they reuse the task-tag space with the decision's
sequence number in the microbatch field.
"""
from __future__ import annotations

from megatron_dpp.comm.tags import ITERATION_BITS, Direction, encode_tag
from megatron_dpp.pipeline import Phase, Task

_ITERATIONS = 1 << ITERATION_BITS


def message_tag(iteration: int, sending_task: Task) -> int:
    direction = Direction.FORWARD if sending_task.phase == Phase.F else Direction.BACKWARD
    return encode_tag(iteration % _ITERATIONS, direction, sending_task.microbatch, sending_task.chunk)


def decision_tag(iteration: int, sequence: int) -> int:
    return encode_tag(iteration % _ITERATIONS, Direction.FORWARD, sequence, 0)
