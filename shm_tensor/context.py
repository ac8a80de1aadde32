"""Typed Python API over shm_tensor._C: configuration, rendezvous and handles."""
from __future__ import annotations

import glob
import os
import secrets
from datetime import timedelta
from typing import Callable, Optional, Sequence

import torch

from shm_tensor import _C
from shm_tensor.config import ShmConfig

HEADER_BYTES: int = _C.HEADER_BYTES
FLAG_CUDA_IPC: int = _C.FLAG_CUDA_IPC
FLAG_SINGLE_COPY: int = _C.FLAG_SINGLE_COPY


def _torch_cudart_candidates() -> list[str]:
    """libcudart files next to torch (its lib dir, or the nvidia-* wheels torch's CUDA build uses)."""
    torch_dir = os.path.dirname(torch.__file__)
    site_packages = os.path.dirname(torch_dir)
    patterns = [
        os.path.join(torch_dir, "lib", "libcudart*.so*"),
        os.path.join(site_packages, "nvidia", "cuda_runtime", "lib", "libcudart.so*"),
        os.path.join(site_packages, "nvidia", "cu*", "lib", "libcudart.so*"),
    ]
    return sorted({path for pattern in patterns for path in glob.glob(pattern)})


_C.add_cuda_runtime_candidates(_torch_cudart_candidates())


def cuda_runtime_error() -> str:
    """'' when the CUDA runtime (libcudart) loads, so CUDA tensors travel by CUDA IPC; otherwise
    what was tried and why it failed. Loads it on the first call (once per process)."""
    return _C.cuda_runtime_error()


def _cuda_caller() -> tuple[int, int]:
    """(current device, its current torch stream handle) where received device tensors land;
    (-1, 0) when torch has not initialised CUDA (no CUDA tensor exists in this process yet)."""
    if not torch.cuda.is_initialized():
        return -1, 0
    device = torch.cuda.current_device()
    return device, torch.cuda.current_stream(device).cuda_stream


def _to_c(settings: ShmConfig, host_tensors_by_cuda_ipc: bool = False) -> "_C.ContextConfig":
    settings.validate()
    config = _C.ContextConfig()
    config.host_tensors_by_cuda_ipc = bool(host_tensors_by_cuda_ipc)
    config.num_slots = settings.num_slots
    config.slot_bytes = settings.slot_bytes
    config.copy_threads = settings.copy_threads
    config.bytes_per_thread = settings.bytes_per_thread
    config.timeout_s = settings.timeout_s
    config.recv_cache_bytes = settings.recv_cache_bytes
    config.spin_us = settings.spin_us
    config.single_copy = bool(settings.single_copy)
    config.single_copy_min_bytes = settings.single_copy_min_bytes
    config.zero_copy_receive = bool(settings.zero_copy_receive)
    config.zero_copy_min_bytes = settings.zero_copy_min_bytes
    config.batch_while_sleeping = bool(settings.batch_while_sleeping)
    return config


class Handle:
    """One outstanding isend or irecv."""

    __slots__ = ("_handle",)

    def __init__(self, handle: "_C.Handle") -> None:
        self._handle = handle

    @property
    def peer(self) -> int:
        return self._handle.peer

    @property
    def tag(self) -> int:
        return self._handle.tag

    @property
    def is_send(self) -> bool:
        return self._handle.is_send

    def test(self) -> bool:
        """Makes progress without blocking; True once complete. Raises on a lost peer or bad header."""
        return self._handle.test(*_cuda_caller())

    def wait(self, timeout: Optional[float] = None) -> Optional[torch.Tensor]:
        """Blocks until complete: the received tensor, or None for a send. Raises TransportTimeout
        after `timeout` seconds (None: the context's timeout_s)."""
        return self._handle.wait(-1.0 if timeout is None else float(timeout), *_cuda_caller())

    def __repr__(self) -> str:
        kind = "send to" if self.is_send else "recv from"
        return f"<shm_tensor.Handle {kind} {self.peer} tag {self.tag}>"


class Context:
    """The shared-memory endpoints of one process towards its on-node peers."""

    def __init__(
        self, context: "_C.Context", peers: Sequence[int], config: ShmConfig, job_name: str
    ) -> None:
        self._context = context
        self.peers = tuple(peers)
        self.config = config
        self.job_name = job_name  # /dev/shm names were /<job_name>-r<rank> (unlinked after setup)

    @property
    def rank(self) -> int:
        return self._context.rank

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle:
        """CUDA tensors go by CUDA IPC, ordered after the work queued on the current stream. Such a
        send completes once the receiver has queued its copy; the current stream at isend then
        waits (on the device) for that copy, so the tensor may be overwritten afterwards."""
        if tensor.is_cuda:
            stream = torch.cuda.current_stream(tensor.device).cuda_stream
            return Handle(self._context.isend(tensor, peer, tag, stream))
        return Handle(self._context.isend(tensor, peer, tag))

    def irecv(self, peer: int, tag: int) -> Handle:
        return Handle(self._context.irecv(peer, tag))

    def wait_any(self, handles: Sequence[Handle], timeout: Optional[float] = None) -> int:
        """Index of a completed handle; sleeps on this process's doorbell until one completes."""
        return self._context.wait_any(
            [h._handle for h in handles], -1.0 if timeout is None else float(timeout), *_cuda_caller()
        )

    def test_any(self, handles: Sequence[Handle]) -> int:
        """Index of a completed handle, or -1; never waits. One progress pass for all of them (what
        a test() of each would do). Raises on a lost peer or bad header, as test() does."""
        return self._context.test_any([h._handle for h in handles], *_cuda_caller())

    def single_copy_peers(self) -> tuple[int, ...]:
        """Peers whose large CPU messages this process pulls in one copy (its probe at connect()
        could read their memory, and single_copy is on here)."""
        return tuple(self._context.single_copy_peers())

    def single_copy_fallbacks(self) -> dict[int, str]:
        """Peers whose messages to this process take two copies, with the reason (the failed probe:
        process_vm_readv's errno, or single copy disabled)."""
        return dict(self._context.single_copy_fallbacks())

    def message_counts(self) -> dict[str, int]:
        """CPU messages sent and received so far by path: sent_single_copy, sent_two_copy (copied
        into a slot), received_single_copy, received_two_copy (copied out of a slot),
        received_zero_copy (the received tensor borrows its slot)."""
        return dict(self._context.message_counts())

    def post_stats(self) -> dict[str, int]:
        """What isend did on the caller's thread so far (tensor sends): sends_posted;
        written_at_post (messages the caller wrote into slots inside isend: the posted one when a
        slot was free, and earlier queued ones that found one now) and queued_at_post (the posted
        message found no free slot: queued, written by a later progress call, never waited for);
        bytes_copied_at_post (payload the caller copied into slots); wakes_at_post (FUTEX_WAKE calls
        inside isend: the peer was asleep on its doorbell); post_ns and max_post_ns (time inside
        the compiled isend, GIL released) and wake_ns (the part inside those wake calls, which
        includes any time the caller spent preempted by the peer it woke). sleeps and
        sleeps_as_batch: how often this process's waits slept on the doorbell, and how many of
        those sleeps were SCHED_BATCH (ShmConfig.batch_while_sleeping)."""
        return dict(self._context.post_stats())

    def batch_sleep_fallback(self) -> str:
        """'' when waits sleep as SCHED_BATCH (ShmConfig.batch_while_sleeping); otherwise why not:
        turned off, or the sched_setscheduler call that failed (tried once per context)."""
        return self._context.batch_sleep_fallback()

    def _send_raw_header(self, header: bytes, peer: int, body: bytes = b"") -> Handle:
        """Sends `header` verbatim, then `body`, with no tensor payload (tests of the receiver's
        header and descriptor checks)."""
        return Handle(self._context.send_raw_header(header, peer, body))

    def close(self) -> None:
        self._context.close()

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def encode_header(tensor: torch.Tensor, tag: int, src_rank: int, flags: int = 0) -> bytes:
    """The wire header (HEADER_BYTES bytes) describing `tensor` as message `tag`; `flags`:
    FLAG_CUDA_IPC for a device message, FLAG_SINGLE_COPY for a payload the receiver pulls from the
    sender's memory (shm_tensor sets both itself)."""
    return _C.encode_header(tensor, tag, src_rank, flags)


def header_flags(header: bytes, peer: int) -> int:
    """The flags of a valid header; ProtocolError when the header is invalid."""
    return _C.header_flags(header, peer)


def decode_header(header: bytes, max_payload_bytes: int, peer: int) -> tuple[int, int, torch.Tensor]:
    """(tag, src_rank, empty tensor of the header's shape and dtype); ProtocolError when invalid."""
    return _C.decode_header(header, max_payload_bytes, peer)


def create_context(
    *,
    rank: int,
    peers: Sequence[int],
    job_name: str,
    barrier: Callable[[], None],
    config: ShmConfig = ShmConfig(),
    host_tensors_by_cuda_ipc: bool = False,
) -> Context:
    """Collective over `rank` and its peers: creates this process's inbox `/<job_name>-r<rank>`
    (mode 0600), maps the peers' inboxes after `barrier()`, and unlinks the names after a second
    barrier, so nothing is left in /dev/shm however the processes end afterwards.
    `host_tensors_by_cuda_ipc` (tests): CPU tensors take the CUDA IPC path through the fake CUDA
    runtime named by SHM_TENSOR_CUDART (`fake_cudart_path()`); refused with a real runtime."""
    context = _C.Context(rank, list(peers), job_name, _to_c(config, host_tensors_by_cuda_ipc))
    try:
        barrier()
        context.connect()
        barrier()
    finally:
        context.unlink()
    return Context(context, peers, config, job_name)


def store_barrier(store: torch.distributed.Store, key: str, world_size: int, timeout_s: float) -> None:
    """Every one of `world_size` processes arrives at `key` before any leaves."""
    arrived = store.add(f"{key}/arrived", 1)
    if arrived == world_size:
        store.set(f"{key}/open", "1")
    try:
        store.wait([f"{key}/open"], timedelta(seconds=timeout_s))
    except RuntimeError as error:
        raise TimeoutError(
            f"shm_tensor rendezvous: waited {timeout_s} s at barrier {key} for {world_size} "
            f"processes: {error}"
        ) from error


def create_context_with_store(
    store: torch.distributed.Store,
    *,
    rank: int,
    world_size: int,
    peers: Sequence[int],
    config: ShmConfig = ShmConfig(),
    prefix: str = "shm_tensor",
    rendezvous_timeout_s: float = 120.0,
    host_tensors_by_cuda_ipc: bool = False,
) -> Context:
    """create_context with the rendezvous done over a torch.distributed Store shared by
    `world_size` processes (all of them call this). Rank 0 draws a random job token so concurrent
    jobs on one node never share a /dev/shm name; `prefix` separates contexts of one job."""
    token_key = f"{prefix}/job_token"
    if rank == 0:
        store.set(token_key, f"dpp-{secrets.token_hex(8)}")
    try:
        store.wait([token_key], timedelta(seconds=rendezvous_timeout_s))
    except RuntimeError as error:
        raise TimeoutError(
            f"shm_tensor rendezvous: waited {rendezvous_timeout_s} s for rank 0 to publish "
            f"{token_key}: {error}"
        ) from error
    job_name = store.get(token_key).decode()
    phase = [0]

    def barrier() -> None:
        phase[0] += 1
        store_barrier(store, f"{prefix}/barrier{phase[0]}", world_size, rendezvous_timeout_s)

    return create_context(rank=rank, peers=peers, job_name=job_name, barrier=barrier, config=config,
                          host_tensors_by_cuda_ipc=host_tensors_by_cuda_ipc)
