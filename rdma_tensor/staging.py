"""GPU tensors through host memory, without the sender waiting for the device.

UCX here moves host memory only (Debian's UCX has no CUDA transports). A GPU tensor's send is
therefore staged: its copy into page-locked memory is queued on the caller's stream with an event
after it, and a poster thread waits for that event and only then hands the bytes to UCX. The caller
returns at once and keeps queueing kernels. A synchronous copy there made the host wait for every
kernel queued before it, once per message: the host lost its lead on the device at every send (the
device then idles while the next task's first kernels are launched), and a message's send is a
host-device synchronization, which `torch.cuda.set_sync_debug_mode("error")` refuses.

Messages to a peer keep the order in which they were sent: once one send waits in the poster's
queue, every later send (a host tensor too) queues behind it.
"""
from __future__ import annotations

import collections
import threading
from typing import Callable, Optional

import torch


class DeviceStaging:
    """How a send's bytes reach host memory. A host tensor is there already; a CUDA tensor is copied
    into page-locked memory on its stream (torch's pinned allocator keeps the buffer until the copy
    that uses it has run)."""

    def to_host(self, tensor: torch.Tensor):
        """(the bytes in host memory, an object whose `synchronize()` returns once they are there;
        None when they are there now and the send may be posted by its caller)."""
        if not tensor.is_cuda:
            return tensor, None
        staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        staged.copy_(tensor, non_blocking=True)  # after the kernels that produced the tensor
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(tensor.device))
        return staged, copied


class PendingSend:
    """A send in the poster's queue; `handle` is the posted send once its bytes are in host
    memory, `error` what posting it raised."""

    __slots__ = ("peer", "tag", "staged", "ready", "handle", "error")

    def __init__(self, peer: int, tag: int, staged: torch.Tensor, ready) -> None:
        self.peer, self.tag = peer, tag
        self.staged: Optional[torch.Tensor] = staged
        self.ready = ready
        self.handle = None
        self.error: Optional[BaseException] = None

    @property
    def settled(self) -> bool:
        return self.handle is not None or self.error is not None


class SendPoster:
    """One thread that posts staged sends in the order they were queued. `post(tensor, peer, tag)`
    is the transport's own send of host memory; `changed` is notified whenever a send is posted or
    fails, so waits sleep instead of polling."""

    def __init__(self, post: Callable, name: str) -> None:
        self._post = post
        self.changed = threading.Condition()
        self._queue: collections.deque[PendingSend] = collections.deque()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name)
        self._thread.start()

    def busy(self) -> bool:
        """Sends queued and not yet posted: a new send must queue behind them."""
        with self.changed:
            return bool(self._queue)

    def queue(self, pending: PendingSend) -> None:
        with self.changed:
            if self._closing:
                raise RuntimeError(f"rdma_tensor.isend(peer={pending.peer}, tag={pending.tag}): "
                                   "the context is closed")
            self._queue.append(pending)
            self.changed.notify_all()

    def _run(self) -> None:
        while True:
            with self.changed:
                while not self._queue and not self._closing:
                    self.changed.wait()
                if not self._queue:
                    return  # closing, and every queued send is posted
                pending = self._queue[0]
            try:
                if pending.ready is not None:
                    pending.ready.synchronize()
                handle, error = self._post(pending.staged, pending.peer, pending.tag), None
            except BaseException as failure:  # handed to whoever waits for this send
                handle, error = None, failure
            with self.changed:
                pending.handle, pending.error = handle, error
                pending.staged = pending.ready = None  # the transport copied the bytes
                self._queue.popleft()
                self.changed.notify_all()

    def close(self) -> None:
        """Posts what is queued, then joins the thread."""
        with self.changed:
            self._closing = True
            self.changed.notify_all()
        self._thread.join()
