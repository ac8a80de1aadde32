"""ShmConfig: the sizes and limits of one shm_tensor context, with their defaults and checks.

Pure Python (no compiled code): importing `shm_tensor.config` does not load the transport, so a
command-line parser can show these defaults without building or loading `shm_tensor._C`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShmConfig:
    """Sizes and limits of one context. Every receiver owns, per peer, `num_slots` slots of
    `slot_bytes` payload each; a CPU message must fit in one slot (single-copy messages too). A GPU
    message carries only a descriptor in its slot and has no size cap (CUDA IPC's direct path),
    except where its memory cannot be exported (torch's expandable segments: staged, capped).

    Other CPU messages go through a slot: the sender copies them in, and the receiver either copies
    them out or, for messages of at least `zero_copy_min_bytes`, lends the slot: the received
    tensor points into shared memory (no second copy) and the slot returns to the sender when that
    tensor's storage is freed. At most num_slots // 2 slots per sender are lent at a time; later
    messages are copied out, so received tensors held for long (activations kept for backward)
    never stall the sender. `zero_copy_receive=False` always copies out.

    CPU messages of at least `single_copy_min_bytes` travel in one copy when the receiver has no
    slot left to lend: it pulls them from the sender's memory (process_vm_readv), where its probe at
    connect() allowed it, and the send completes once pulled. `single_copy=False` turns that off.

    `batch_while_sleeping`: a thread asleep in a wait is SCHED_BATCH for the sleep only, so the
    peer that wakes it (posting a message, freeing a slot) keeps its CPU instead of being preempted
    by the woken thread inside isend when the cores are oversubscribed; the woken thread then runs at
    once on an idle core, or when the waker's time slice ends. False: plain SCHED_OTHER sleeps."""

    num_slots: int = 4
    slot_bytes: int = 64 << 20
    copy_threads: int = 2  # at most this many threads copy one message
    bytes_per_thread: int = 8 << 20  # --workload: a message gets one copy thread per this many bytes
    timeout_s: float = 300.0  # waits without an explicit timeout use this
    recv_cache_bytes: int = 256 << 20  # recycled buffers of received tensors >= 64 KiB kept for reuse
    spin_us: float = 20.0  # a waiter watches its doorbell this long before sleeping on it
    single_copy: bool = True  # large CPU messages pulled from the sender's memory where allowed
    single_copy_min_bytes: int = 16 << 20  # the measured crossover (docs/transport.md)
    zero_copy_receive: bool = True  # received CPU messages may borrow their slot instead of a copy out
    zero_copy_min_bytes: int = 256 << 10  # smaller messages are copied out (cheap, and keep loans free)
    batch_while_sleeping: bool = True  # waiters sleep as SCHED_BATCH: waking them never preempts the waker

    def validate(self) -> None:
        """Raise ShmConfigError (a ValueError naming the field) for a value the transport refuses."""
        if not 1 <= self.num_slots <= 64:
            raise ShmConfigError("num_slots", f"ShmConfig.num_slots={self.num_slots}: must be 1..64 (one 64-bit free mask)")
        if self.slot_bytes < 0:
            raise ShmConfigError("slot_bytes", f"ShmConfig.slot_bytes={self.slot_bytes}: must be >= 0")
        if self.copy_threads < 1:
            raise ShmConfigError("copy_threads", f"ShmConfig.copy_threads={self.copy_threads}: must be >= 1")
        if self.bytes_per_thread < 4096:
            raise ShmConfigError("bytes_per_thread",
                                 f"ShmConfig.bytes_per_thread={self.bytes_per_thread}: must be >= 4096")
        if self.timeout_s <= 0:
            raise ShmConfigError("timeout_s", f"ShmConfig.timeout_s={self.timeout_s}: must be > 0")
        if self.recv_cache_bytes < 0 or self.spin_us < 0:
            raise ShmConfigError("recv_cache_bytes", "ShmConfig.recv_cache_bytes and spin_us must be >= 0")
        if self.single_copy_min_bytes < 4096:
            raise ShmConfigError("single_copy_min_bytes",
                                 f"ShmConfig.single_copy_min_bytes={self.single_copy_min_bytes}: "
                                 "must be >= 4096")
        if self.zero_copy_min_bytes < 1:
            raise ShmConfigError("zero_copy_min_bytes",
                                 f"ShmConfig.zero_copy_min_bytes={self.zero_copy_min_bytes}: must be >= 1")


class ShmConfigError(ValueError):
    """A ShmConfig value the transport refuses; `field` names it (a flag parser maps it to its flag)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
