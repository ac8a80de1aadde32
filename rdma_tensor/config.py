"""RdmaConfig: the limits of one rdma_tensor context, with their defaults and checks.

Pure Python (no compiled code): importing `rdma_tensor.config` does not load UCX, so a parser can
show these defaults on a machine without libucx.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RdmaConfig:
    """Limits of one context. Every message is staged in (sender) and lands in (receiver) a host
    buffer registered with UCX once and then recycled; received tensors point into their buffer
    until they are freed. At most `pool_cache_bytes` of free buffers wait for reuse."""

    timeout_s: float = 300.0  # waits without an explicit timeout use this
    pool_cache_bytes: int = 512 << 20  # free registered buffers kept for reuse
    close_timeout_s: float = 10.0  # longest close() waits for the links to flush
    spin_us: float = 50.0  # the progress thread polls this long after activity before it sleeps

    def validate(self) -> None:
        """Raise ValueError naming the field for a value the transport refuses."""
        if self.timeout_s <= 0:
            raise ValueError(f"RdmaConfig.timeout_s={self.timeout_s}: must be > 0")
        if self.pool_cache_bytes < 0:
            raise ValueError(f"RdmaConfig.pool_cache_bytes={self.pool_cache_bytes}: must be >= 0")
        if self.spin_us < 0:
            raise ValueError(f"RdmaConfig.spin_us={self.spin_us}: must be >= 0")
        if self.close_timeout_s <= 0:
            raise ValueError(f"RdmaConfig.close_timeout_s={self.close_timeout_s}: must be > 0")
