"""A synchronous torch_dist save without Megatron-Core's multiprocessing Manager.

Megatron-Core's file writer (dist_checkpointing/strategies/filesystem_async.py) hands the write
results back through `_results_queue`, which `_get_write_results_queue` makes on first use as a
queue of a multiprocessing Manager: a process spawned per rank that imports torch to unpickle the
results (about 2 s of CPU at each rank's first save) and, when the rank is killed during a save,
stays behind with its resource tracker, reparented to init. A synchronous save runs the writer's
`write_preloaded_data_multiproc` in the rank's own process (it forks the bucket writers, collects
their results and puts them into the queue once), so an in-process queue serves it.
`in_process_write_results` gives the writer one for the save and puts back what was there.
"""
from __future__ import annotations

import contextlib
import queue
from typing import Iterator


@contextlib.contextmanager
def in_process_write_results() -> Iterator[None]:
    """Around a synchronous dist_checkpointing.save: the write results pass through a
    queue.Queue of this process, and no Manager process is started."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    previous = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = previous
