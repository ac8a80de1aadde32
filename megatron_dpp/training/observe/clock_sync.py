"""The ping-pong behind trace clock alignment (trace/clock.py has the arithmetic).

Every rank but the reference sends `ROUNDS` pings to it, one at a time, on a process group of its
own (gloo, whatever the job's backend: CPU tensors, works across nodes, and no message of the
pipeline transport, which may use the default group, can take a ping for its own). The reference
answers each with its clock. No barrier: a rank's first ping may queue behind other ranks' rounds,
which only lengthens that round trip, and the shortest round is the one kept.

Cost: the reference serves (world size - 1) x ROUNDS round trips, each a few hundred microseconds
over gloo; a few milliseconds for a handful of ranks.
"""
from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_dpp.trace.clock import ROUNDS, OffsetSample, offset_from_rounds, reference_sample

REFERENCE_RANK = 0


def now_us() -> float:
    """The clock every trace event is recorded in."""
    return time.perf_counter() * 1e6


def clock_group(timeout: timedelta) -> dist.ProcessGroup:
    """Collective: the group the pings travel on (call on every rank, in the same order as the
    job's other new_group calls)."""
    return dist.new_group(backend="gloo", timeout=timeout)


def measure_offset(group: dist.ProcessGroup) -> OffsetSample:
    """Collective over `group`: this rank's clock minus the reference rank's (0 on the reference)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    message = torch.zeros(1, dtype=torch.float64)
    if rank == REFERENCE_RANK:
        for peer in range(world_size):
            if peer == REFERENCE_RANK:
                continue
            for _ in range(ROUNDS):
                dist.recv(message, src=peer, group=group)
                message[0] = now_us()
                dist.send(message, dst=peer, group=group)
        return reference_sample(now_us())
    rounds = []
    for _ in range(ROUNDS):
        sent = now_us()
        dist.send(message, dst=REFERENCE_RANK, group=group)
        dist.recv(message, src=REFERENCE_RANK, group=group)
        rounds.append((sent, float(message[0]), now_us()))
    return offset_from_rounds(rounds)
