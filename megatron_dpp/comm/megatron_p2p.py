"""Megatron-Core's own pipeline schedules (1F1B, interleaved 1F1B) over a Transport.

`TransportP2PCommunicator` gives the hooks of mcore/p2p.py's CommunicatorSeam, the one seam every
send/receive helper of Megatron's schedules goes through. Megatron pairs sends and receives in
program order, like torch.distributed does per pair of ranks; we keep that contract by numbering the
messages of each direction (forward activations, backward gradients) and tagging message k with
sequence number k (tags.encode_sequence_tag). Shapes and dtypes come from the wire header, so
--variable-seq-lengths needs no separate shape exchange.

Pass it with the process groups of parallel_state:
    forward_backward_func(..., p2p_communicator=TransportP2PCommunicator(pp_group, config, transport),
                          pg_collection=ProcessGroupCollection.use_mpu_process_groups())

With an observer (--trace: training/observe/megatron_tracing.py), it reports every send as it is posted,
every receive as it is posted and as it is taken in, and every wait on a message that had not
completed yet.
"""
from __future__ import annotations

import time
from typing import Optional, Protocol

import torch

from megatron_dpp.comm.tags import Direction, encode_sequence_tag
from megatron_dpp.comm.transport import Transport, TransportHandle
from megatron_dpp.mcore.p2p import CommunicatorSeam


class P2PObserver(Protocol):
    """What a tracer hears from the communicator; times are time.perf_counter() seconds. Sends and
    receives are posted in the schedule's program order (the order they pair in); a receive may be
    taken in later, when the schedule waits on it."""

    def sent(self, direction: Direction, peer: int, tag: int, nbytes: int, posted: float) -> None: ...

    def expecting(self, direction: Direction, peer: int, tag: int) -> None: ...

    def received(self, peer: int, tag: int, nbytes: int, taken: float) -> None: ...

    def waited(self, started: float, ended: float, reason: str) -> None: ...


class TransportP2PCommunicator(CommunicatorSeam):
    def __init__(self, pp_group, config, transport: Transport, timeout_s: Optional[float] = None,
                 observer: Optional[P2PObserver] = None):
        super().__init__(pp_group, config)
        self.transport = transport
        self.timeout_s = timeout_s  # None: the transport's default
        self.observer = observer
        self._sent = {Direction.FORWARD: 0, Direction.BACKWARD: 0}
        self._received = {Direction.FORWARD: 0, Direction.BACKWARD: 0}

    @staticmethod
    def _take(counters: dict, direction: Direction) -> int:
        sequence = counters[direction]
        counters[direction] = sequence + 1
        return encode_sequence_tag(direction, sequence)

    def post_send(self, tensor: torch.Tensor, forward: bool, peer: int) -> TransportHandle:
        direction = Direction.FORWARD if forward else Direction.BACKWARD
        tag = self._take(self._sent, direction)
        posted = time.perf_counter()  # before isend: the peer may take the message in at once
        handle = self.transport.isend(tensor.detach(), peer, tag)
        if self.observer is not None:
            self.observer.sent(direction, peer, tag, _nbytes(tensor), posted)
        return handle

    def post_receive(self, forward: bool, peer: int) -> TransportHandle:
        direction = Direction.FORWARD if forward else Direction.BACKWARD
        tag = self._take(self._received, direction)
        if self.observer is not None:
            self.observer.expecting(direction, peer, tag)
        return self.transport.irecv(peer, tag)

    def _wait(self, handle: TransportHandle, reason: str):
        """handle.wait(); with an observer, the time spent blocked (if any) is a wait span."""
        if self.observer is None or handle.test():
            return handle.wait(self.timeout_s)
        started = time.perf_counter()
        result = handle.wait(self.timeout_s)
        self.observer.waited(started, time.perf_counter(), reason)
        return result

    def complete_send(self, handle: TransportHandle) -> None:
        self._wait(handle, "waiting for a send to complete")

    def take_in(self, handle: TransportHandle) -> torch.Tensor:
        received = self._wait(handle, f"waiting for an input from rank {handle.peer}")
        if self.observer is not None:
            self.observer.received(handle.peer, handle.tag, _nbytes(received), time.perf_counter())
        return received


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
