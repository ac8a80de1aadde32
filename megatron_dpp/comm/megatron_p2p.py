"""Megatron-Core's own pipeline schedules (1F1B, interleaved 1F1B) over a Transport.

`TransportP2PCommunicator` overrides `P2PCommunicator._communicate`, the one method every
send/receive helper of Megatron's schedules goes through. Megatron pairs sends and receives in
program order, like torch.distributed does per pair of ranks; we keep that contract by numbering the
messages of each direction (forward activations, backward gradients) and tagging message k with
sequence number k (tags.encode_sequence_tag). Shapes and dtypes come from the wire header, so
--variable-seq-lengths needs no separate shape exchange.

Pass it with the process groups of parallel_state:
    forward_backward_func(..., p2p_communicator=TransportP2PCommunicator(pp_group, config, transport),
                          pg_collection=ProcessGroupCollection.use_mpu_process_groups())

With an observer (--trace: training/megatron_tracing.py), it reports every send as it is posted,
every receive as it is posted and as it is taken in, and every wait on a message that had not
completed yet.
"""
from __future__ import annotations

import time
from typing import Optional, Protocol

import torch
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from megatron_dpp.comm.tags import Direction, encode_sequence_tag
from megatron_dpp.comm.transport import Transport, TransportHandle


def _compute_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


class P2PObserver(Protocol):
    """What a tracer hears from the communicator; times are time.perf_counter() seconds. Sends and
    receives are posted in the schedule's program order (the order they pair in); a receive may be
    taken in later, when the schedule waits on it."""

    def sent(self, direction: Direction, peer: int, tag: int, nbytes: int, posted: float) -> None: ...

    def expecting(self, direction: Direction, peer: int, tag: int) -> None: ...

    def received(self, peer: int, tag: int, nbytes: int, taken: float) -> None: ...

    def waited(self, started: float, ended: float, reason: str) -> None: ...


class _PendingReceive:
    """What Megatron's overlapped schedule calls .wait() on: fills the buffer it already holds."""

    def __init__(self, communicator: "TransportP2PCommunicator", handle: TransportHandle,
                 buffer: torch.Tensor):
        self._communicator, self._handle, self._buffer = communicator, handle, buffer

    def wait(self) -> None:
        received = self._communicator._take_in(self._handle)
        if received.shape != self._buffer.shape:
            raise RuntimeError(
                f"TransportP2PCommunicator: message from rank {self._handle.peer} (tag "
                f"{self._handle.tag}) has shape {tuple(received.shape)}, the schedule expected "
                f"{tuple(self._buffer.shape)}; use --variable-seq-lengths for varying shapes")
        with torch.no_grad():
            self._buffer.copy_(received)


class _PendingSend:
    def __init__(self, communicator: "TransportP2PCommunicator", handle: TransportHandle):
        self._communicator, self._handle = communicator, handle

    def wait(self) -> None:
        self._communicator._complete_send(self._handle)


class _Completed:
    def wait(self) -> None:
        return None


class TransportP2PCommunicator(P2PCommunicator):
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

    def _post_send(self, tensor: torch.Tensor, direction: Direction, peer: int) -> TransportHandle:
        tag = self._take(self._sent, direction)
        posted = time.perf_counter()  # before isend: the peer may take the message in at once
        handle = self.transport.isend(tensor.detach(), peer, tag)
        if self.observer is not None:
            self.observer.sent(direction, peer, tag, _nbytes(tensor), posted)
        return handle

    def _post_receive(self, direction: Direction, peer: int) -> TransportHandle:
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

    def _complete_send(self, handle: TransportHandle) -> None:
        self._wait(handle, "waiting for a send to complete")

    def _take_in(self, handle: TransportHandle) -> torch.Tensor:
        received = self._wait(handle, f"waiting for an input from rank {handle.peer}")
        if self.observer is not None:
            self.observer.received(handle.peer, handle.tag, _nbytes(received), time.perf_counter())
        return received

    def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev: bool,
                     recv_next: bool, tensor_shape, wait_on_reqs: bool = True):
        config = self.config
        if (recv_prev or recv_next) and config.pipeline_dtype is None:
            raise RuntimeError("pipeline_dtype must be provided to receive tensors")
        # Sends first, so a peer blocked on our message is released before we block on theirs.
        sends = {}
        if tensor_send_next is not None:
            sends["send_next"] = self._post_send(tensor_send_next, Direction.FORWARD, self.next_rank)
        if tensor_send_prev is not None:
            sends["send_prev"] = self._post_send(tensor_send_prev, Direction.BACKWARD, self.prev_rank)
        receives = {}
        if recv_prev:
            receives["recv_prev"] = self._post_receive(Direction.FORWARD, self.prev_rank)
        if recv_next:
            receives["recv_next"] = self._post_receive(Direction.BACKWARD, self.next_rank)

        shapes_vary = config.variable_seq_lengths or config.mtp_standalone
        if wait_on_reqs or shapes_vary or tensor_shape is None:
            for handle in sends.values():
                self._complete_send(handle)
            results = {}
            for key, handle in receives.items():
                # Megatron's receive buffers are leaves that require grad; so are ours.
                results[key] = self._take_in(handle).requires_grad_()
            reqs = None if wait_on_reqs else {key: _Completed() for key in (*sends, *receives)}
            return results.get("recv_prev"), results.get("recv_next"), reqs

        # Overlapped (interleaved schedule with overlap_p2p_comm): hand out buffers now and fill
        # them when Megatron waits on the request.
        reqs = {key: _PendingSend(self, handle) for key, handle in sends.items()}
        buffers = {}
        for key, handle in receives.items():
            # On the device the schedule computes on, as Megatron's own receive buffers are.
            buffers[key] = torch.empty(tensor_shape, requires_grad=True, dtype=config.pipeline_dtype,
                                       device=_compute_device())
            reqs[key] = _PendingReceive(self, handle, buffers[key])
        return buffers.get("recv_prev"), buffers.get("recv_next"), reqs


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
