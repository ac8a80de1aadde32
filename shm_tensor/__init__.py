"""shm_tensor: tag-matched, non-blocking point-to-point tensor messages between the processes of one
node, over POSIX shared memory (compiled `shm_tensor._C`).

    ctx = create_context_with_store(store, rank=r, world_size=n, peers=[...])
    handle = ctx.isend(tensor, peer, tag)      # complete once the bytes sit in the peer's slot, or
                                               # (large CPU tensors) once the peer pulled them
    handle = ctx.irecv(peer, tag)              # matched by (peer, tag), in any order
    tensor = handle.wait(timeout=30)           # shape and dtype come from the wire header
    index = ctx.wait_any([h1, h2], timeout=30) # sleeps on one futex doorbell, no spinning

Peers and ranks are global torch.distributed ranks; tags are non-negative 63-bit ints. CUDA tensors
travel by CUDA IPC (libcudart loaded with dlopen at run time): the receiver copies once, straight
from the sender's tensor, on its current stream, and neither side waits for the device on the host
(docs/transport.md, "CUDA IPC"); where the CUDA runtime does not load, sending one raises ValueError
saying why (`cuda_runtime_error()`). `fake_cudart_path()` is the fake CUDA runtime the tests run
that protocol on without a GPU.

`ShmConfig` (shm_tensor.config) is pure Python. Every other name loads torch and the compiled
transport on first use, so `import shm_tensor.config` (a parser showing the defaults, the launcher's
check of a job's flags) loads neither. The compiled `_C` links against torch's libraries: as with any
torch extension, import torch before importing `shm_tensor._C` itself (the names here do it).
"""
from __future__ import annotations

import importlib

from shm_tensor.config import ShmConfig

_CONTEXT_NAMES = (
    "Context", "Handle", "create_context", "create_context_with_store", "encode_header",
    "decode_header", "HEADER_BYTES", "FLAG_CUDA_IPC", "FLAG_SINGLE_COPY", "cuda_runtime_error",
    "header_flags",
)
_ERROR_NAMES = (
    "TransportError", "TransportTimeout", "PeerLostError", "ProtocolError", "MessageTooLargeError",
)

__all__ = ["ShmConfig", *_CONTEXT_NAMES, *_ERROR_NAMES]


def __getattr__(name: str):
    import torch  # noqa: F401 -- loads the libraries _C links against (libc10, libtorch)

    if name in _CONTEXT_NAMES:
        module = importlib.import_module("shm_tensor.context")
    elif name in _ERROR_NAMES:
        module = importlib.import_module("shm_tensor._C")
    else:
        raise AttributeError(f"module 'shm_tensor' has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value
    return value


def fake_cudart_path() -> str:
    """Absolute path of the fake CUDA runtime built next to this file (csrc/fake_cudart): tests name
    it in SHM_TENSOR_CUDART to run the CUDA IPC path on machines without a GPU."""
    import glob
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_fake_cudart*.so")))
    if not found:
        raise FileNotFoundError("shm_tensor: the fake CUDA runtime (_fake_cudart*.so) is not built; "
                                "rebuild with run_scripts/setup_env.sh")
    return found[0]
