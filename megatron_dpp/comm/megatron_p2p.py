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
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from megatron_dpp.comm.tags import Direction, encode_sequence_tag
from megatron_dpp.comm.transport import Transport, TransportHandle


def _compute_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


class _PendingReceive:
    """What Megatron's overlapped schedule calls .wait() on: fills the buffer it already holds."""

    def __init__(self, handle: TransportHandle, buffer: torch.Tensor, timeout: Optional[float]):
        self._handle, self._buffer, self._timeout = handle, buffer, timeout

    def wait(self) -> None:
        received = self._handle.wait(self._timeout)
        if received.shape != self._buffer.shape:
            raise RuntimeError(
                f"TransportP2PCommunicator: message from rank {self._handle.peer} (tag "
                f"{self._handle.tag}) has shape {tuple(received.shape)}, the schedule expected "
                f"{tuple(self._buffer.shape)}; use --variable-seq-lengths for varying shapes")
        with torch.no_grad():
            self._buffer.copy_(received)


class _PendingSend:
    def __init__(self, handle: TransportHandle, timeout: Optional[float]):
        self._handle, self._timeout = handle, timeout

    def wait(self) -> None:
        self._handle.wait(self._timeout)


class _Completed:
    def wait(self) -> None:
        return None


class TransportP2PCommunicator(P2PCommunicator):
    def __init__(self, pp_group, config, transport: Transport, timeout_s: Optional[float] = None):
        super().__init__(pp_group, config)
        self.transport = transport
        self.timeout_s = timeout_s  # None: the transport's default
        self._sent = {Direction.FORWARD: 0, Direction.BACKWARD: 0}
        self._received = {Direction.FORWARD: 0, Direction.BACKWARD: 0}

    @staticmethod
    def _take(counters: dict, direction: Direction) -> int:
        sequence = counters[direction]
        counters[direction] = sequence + 1
        return encode_sequence_tag(direction, sequence)

    def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev: bool,
                     recv_next: bool, tensor_shape, wait_on_reqs: bool = True):
        config = self.config
        if (recv_prev or recv_next) and config.pipeline_dtype is None:
            raise RuntimeError("pipeline_dtype must be provided to receive tensors")
        # Sends first, so a peer blocked on our message is released before we block on theirs.
        sends = {}
        if tensor_send_next is not None:
            tag = self._take(self._sent, Direction.FORWARD)
            sends["send_next"] = self.transport.isend(tensor_send_next.detach(), self.next_rank, tag)
        if tensor_send_prev is not None:
            tag = self._take(self._sent, Direction.BACKWARD)
            sends["send_prev"] = self.transport.isend(tensor_send_prev.detach(), self.prev_rank, tag)
        receives = {}
        if recv_prev:
            tag = self._take(self._received, Direction.FORWARD)
            receives["recv_prev"] = self.transport.irecv(self.prev_rank, tag)
        if recv_next:
            tag = self._take(self._received, Direction.BACKWARD)
            receives["recv_next"] = self.transport.irecv(self.next_rank, tag)

        shapes_vary = config.variable_seq_lengths or config.mtp_standalone
        if wait_on_reqs or shapes_vary or tensor_shape is None:
            for handle in sends.values():
                handle.wait(self.timeout_s)
            results = {}
            for key, handle in receives.items():
                # Megatron's receive buffers are leaves that require grad; so are ours.
                results[key] = handle.wait(self.timeout_s).requires_grad_()
            reqs = None if wait_on_reqs else {key: _Completed() for key in (*sends, *receives)}
            return results.get("recv_prev"), results.get("recv_next"), reqs

        # Overlapped (interleaved schedule with overlap_p2p_comm): hand out buffers now and fill
        # them when Megatron waits on the request.
        reqs = {key: _PendingSend(handle, self.timeout_s) for key, handle in sends.items()}
        buffers = {}
        for key, handle in receives.items():
            # On the device the schedule computes on, as Megatron's own receive buffers are.
            buffers[key] = torch.empty(tensor_shape, requires_grad=True, dtype=config.pipeline_dtype,
                                       device=_compute_device())
            reqs[key] = _PendingReceive(handle, buffers[key], self.timeout_s)
        return buffers.get("recv_prev"), buffers.get("recv_next"), reqs
