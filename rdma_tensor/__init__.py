"""rdma_tensor: tag-matched, non-blocking point-to-point tensor messages between nodes over UCX's
tag API (compiled `rdma_tensor._C`, built against the system UCX: InfiniBand/RoCE verbs on a
cluster, TCP elsewhere; UCX picks per link, UCX_TLS / UCX_NET_DEVICES steer it).

    ctx = create_context_with_store(store, rank=r, world_size=n, peers=[...], node_address="10.0.0.1")
    handle = ctx.isend(tensor, peer, tag)      # returns at once; the caller may reuse tensor
    handle = ctx.irecv(peer, tag)              # matched by (peer, tag), in any order
    tensor = handle.wait(timeout=30)           # shape and dtype come from the wire header
    index = ctx.wait_any([h1, h2], timeout=30) # sleeps on a condition variable, no spinning

Same semantics as shm_tensor (megatron_dpp/comm/transport.py); see csrc/rdma_tensor/context.h for
the design. `RdmaConfig` (rdma_tensor.config) is pure Python; every other name loads torch and the
compiled extension on first use, and `unavailable_reason()` says why it cannot be loaded, if so. As
with any torch extension, import torch before importing `rdma_tensor._C` itself.
"""
from __future__ import annotations

import importlib

from rdma_tensor.config import RdmaConfig

_CONTEXT_NAMES = ("Context", "Handle", "create_context_with_store", "ucx_version", "HEADER_BYTES")
_ERROR_NAMES = ("TransportError", "TransportTimeout", "PeerLostError", "ProtocolError")

__all__ = ["RdmaConfig", "unavailable_reason", *_CONTEXT_NAMES, *_ERROR_NAMES]


def unavailable_reason() -> str:
    """"" when rdma_tensor._C loads; otherwise one sentence saying why and what to do."""
    if importlib.util.find_spec("rdma_tensor._C") is None:
        return ("rdma_tensor._C is not built (it needs UCX's headers: apt-get install libucx-dev, then "
                "`pip install --no-build-isolation -e .` or run_scripts/setup_env.sh)")
    try:
        import torch  # noqa: F401 -- loads the libraries _C links against

        importlib.import_module("rdma_tensor._C")
    except ImportError as error:
        return f"rdma_tensor._C does not load: {error}"
    return ""


def __getattr__(name: str):
    import torch  # noqa: F401 -- loads the libraries _C links against

    if name in _CONTEXT_NAMES:
        module = importlib.import_module("rdma_tensor.context")
    elif name in _ERROR_NAMES:
        module = importlib.import_module("rdma_tensor._C")
    else:
        raise AttributeError(f"module 'rdma_tensor' has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value
    return value
