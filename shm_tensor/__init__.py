"""shm_tensor: tag-matched, non-blocking point-to-point tensor messages between the processes of one
node, over POSIX shared memory (compiled `shm_tensor._C`).

    ctx = create_context_with_store(store, rank=r, world_size=n, peers=[...])
    handle = ctx.isend(tensor, peer, tag)      # complete once the bytes sit in the peer's slot, or
                                               # (large CPU tensors) once the peer pulled them
    handle = ctx.irecv(peer, tag)              # matched by (peer, tag), in any order
    tensor = handle.wait(timeout=30)           # shape and dtype come from the wire header
    index = ctx.wait_any([h1, h2], timeout=30) # sleeps on one futex doorbell, no spinning

Peers and ranks are global torch.distributed ranks; tags are non-negative 63-bit ints. CUDA tensors
travel by CUDA IPC (device to device, libcudart loaded with dlopen at run time); where the CUDA
runtime does not load, sending one raises ValueError saying why (`cuda_runtime_error()`). The CUDA
path has not been run on a GPU yet (docs/transport.md).
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
    FLAG_CUDA_IPC,
    FLAG_SINGLE_COPY,
    cuda_runtime_error,
    header_flags,
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
    "FLAG_CUDA_IPC",
    "FLAG_SINGLE_COPY",
    "cuda_runtime_error",
    "header_flags",
    "TransportError",
    "TransportTimeout",
    "PeerLostError",
    "ProtocolError",
    "MessageTooLargeError",
]
