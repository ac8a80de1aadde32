"""The seam under Megatron-Core's pipeline schedules' sends and receives.

Every send/receive helper of Megatron-Core 0.16.1's P2PCommunicator goes through the private
`_communicate(*, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape,
wait_on_reqs)`, which returns (tensor from prev, tensor from next, requests). `CommunicatorSeam`
implements that contract once, here, on four public hooks a subclass gives: post a send, post a
receive, complete a send, take a receive in (comm/megatron_p2p.py does them over a Transport).
A message goes forward (activations, to the next rank) or backward (gradients, to the previous).
"""
from __future__ import annotations

from typing import Any

import torch
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator


def _compute_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


class _PendingReceive:
    """What Megatron's overlapped schedule calls .wait() on: fills the buffer it already holds."""

    def __init__(self, communicator: "CommunicatorSeam", handle: Any, buffer: torch.Tensor):
        self._communicator, self._handle, self._buffer = communicator, handle, buffer

    def wait(self) -> None:
        received = self._communicator.take_in(self._handle)
        if received.shape != self._buffer.shape:
            raise RuntimeError(
                f"{type(self._communicator).__name__}: message from rank {self._handle.peer} (tag "
                f"{self._handle.tag}) has shape {tuple(received.shape)}, the schedule expected "
                f"{tuple(self._buffer.shape)}; use --variable-seq-lengths for varying shapes")
        with torch.no_grad():
            self._buffer.copy_(received)


class _PendingSend:
    def __init__(self, communicator: "CommunicatorSeam", handle: Any):
        self._communicator, self._handle = communicator, handle

    def wait(self) -> None:
        self._communicator.complete_send(self._handle)


class _Completed:
    def wait(self) -> None:
        return None


class CommunicatorSeam(P2PCommunicator):
    """P2PCommunicator whose messages go through four hooks a subclass defines:
    `post_send(tensor, forward, peer) -> handle`, `post_receive(forward, peer) -> handle`,
    `complete_send(handle)` and `take_in(handle) -> tensor`. Handles are the subclass's own; the
    overlapped path reads their `peer` and `tag` for its shape error."""

    def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev: bool,
                     recv_next: bool, tensor_shape, wait_on_reqs: bool = True):
        config = self.config
        if (recv_prev or recv_next) and config.pipeline_dtype is None:
            raise RuntimeError("pipeline_dtype must be provided to receive tensors")
        # Sends first, so a peer blocked on our message is released before we block on theirs.
        sends = {}
        if tensor_send_next is not None:
            sends["send_next"] = self.post_send(tensor_send_next, True, self.next_rank)
        if tensor_send_prev is not None:
            sends["send_prev"] = self.post_send(tensor_send_prev, False, self.prev_rank)
        receives = {}
        if recv_prev:
            receives["recv_prev"] = self.post_receive(True, self.prev_rank)
        if recv_next:
            receives["recv_next"] = self.post_receive(False, self.next_rank)

        shapes_vary = config.variable_seq_lengths or config.mtp_standalone
        if wait_on_reqs or shapes_vary or tensor_shape is None:
            for handle in sends.values():
                self.complete_send(handle)
            results = {}
            for key, handle in receives.items():
                # Megatron's receive buffers are leaves that require grad; so are ours.
                results[key] = self.take_in(handle).requires_grad_()
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
