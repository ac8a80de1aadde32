"""Megatron-Core's dataset index cache, built by one job at a time.

Megatron-Core's builder writes each dataset's indices (document, sample and shuffle index) as .npy
files under --data-cache-path, or beside the data (`<prefix>/cache/<class>_indices`), and loads them
when they exist. Within a job the first rank builds and the others load after a barrier; between
jobs nothing orders them (dir_lock.py says what goes wrong). `index_cache_lock` makes the rank that
builds first hold the cache directories' lock files while the builder runs, so a second job on
the same data waits, then finds the cache complete and loads it. A read-only directory without a
lock file is not locked: its cache is only read there (dir_lock.lock_file_in).
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, List, Optional, Sequence

from megatron_dpp.data.dir_lock import DirectoryLock, lock_file_in

LOCK_NAME = ".megatron_dpp_index_cache.lock"
HOLDER = "another job building the index cache of the same data"
# The other ranks of a waiting job wait for its first rank at the builder's barrier, for
# --distributed-timeout-minutes: the first rank stops waiting a little earlier, with its message.
LOCK_TIMEOUT_SHARE = 0.9
DEFAULT_DISTRIBUTED_TIMEOUT_MINUTES = 10  # Megatron-LM's, for callers without the flag


def index_cache_dirs(prefixes: Sequence[str], data_cache_path: Optional[str]) -> List[str]:
    """The directories Megatron-Core writes the index caches of these datasets into."""
    if data_cache_path:
        return [data_cache_path]
    return sorted({os.path.join(prefix, "cache") for prefix in prefixes})


def _builds_first() -> bool:
    """Whether this process is the one Megatron-Core's builder lets build first (global rank 0,
    or a process without a process group)."""
    import torch

    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _say(message: str) -> None:
    print(f"[data] {message}", flush=True)


@contextlib.contextmanager
def index_cache_lock(prefixes: Sequence[str], data_cache_path: Optional[str],
                     distributed_timeout_minutes: Optional[int] = None) -> Iterator[None]:
    """Hold the lock files of the datasets' cache directories (sorted: two jobs take them in the
    same order) on the rank that builds first; other ranks pass through."""
    if not _builds_first():
        yield
        return
    minutes = distributed_timeout_minutes or DEFAULT_DISTRIBUTED_TIMEOUT_MINUTES
    timeout_s = LOCK_TIMEOUT_SHARE * 60.0 * minutes
    with contextlib.ExitStack() as held:
        for directory in index_cache_dirs(prefixes, data_cache_path):
            path = lock_file_in(directory, LOCK_NAME)
            if path is not None:
                held.enter_context(DirectoryLock(path, timeout_s, HOLDER, _say))
        yield
