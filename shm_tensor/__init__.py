"""shm_tensor: tag-matched, non-blocking point-to-point tensor messages between the processes of one
node, over POSIX shared memory (compiled `shm_tensor._C`).

    ctx = create_context_with_store(store, rank=r, world_size=n, peers=[...])
    handle = ctx.isend(tensor, peer, tag)      # complete once the bytes sit in the peer's slot
    handle = ctx.irecv(peer, tag)              # matched by (peer, tag), in any order
    tensor = handle.wait(timeout=30)           # shape and dtype come from the wire header
    index = ctx.wait_any([h1, h2], timeout=30) # sleeps on one futex doorbell, no spinning

Peers and ranks are global torch.distributed ranks; tags are non-negative 63-bit ints. CPU tensors
only: a CUDA tensor raises ValueError naming --p2p-transport torch (CUDA IPC is not built).
"""
from shm_tensor.context import (
    Context,
    Handle,
    ShmConfig,
    create_context,
    create_context_with_store,
    encode_header,
    decode_header,
    HEADER_BYTES,
)
from shm_tensor._C import (
    MessageTooLargeError,
    PeerLostError,
    ProtocolError,
    TransportError,
    TransportTimeout,
)

__all__ = [
    "Context",
    "Handle",
    "ShmConfig",
    "create_context",
    "create_context_with_store",
    "encode_header",
    "decode_header",
    "HEADER_BYTES",
    "TransportError",
    "TransportTimeout",
    "PeerLostError",
    "ProtocolError",
    "MessageTooLargeError",
]
