"""Two spawned benchmark ranks that meet through a file store and report through a queue (shared by
transport_bench.py and transport_bench_cuda.py)."""
from __future__ import annotations

import tempfile
from typing import Any, Callable, List

import torch.multiprocessing as mp


def run_two_ranks(worker: Callable, args: Any, timeout: float) -> List[Any]:
    """Starts worker(rank, args, store_path, results) for ranks 0 and 1 and returns the two items
    they put on `results` (in arrival order). Waits at most `timeout` seconds for them; a rank still
    alive 30 s after is killed; a rank that exited non-zero raises RuntimeError."""
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        processes = [context.Process(target=worker, args=(rank, args, f"{tmp}/store", results))
                     for rank in range(2)]
        for process in processes:
            process.start()
        try:
            reports = [results.get(timeout=timeout) for _ in range(2)]
        finally:
            for process in processes:
                process.join(timeout=30)
                if process.is_alive():
                    process.kill()
                    process.join()
    if any(process.exitcode != 0 for process in processes):
        raise RuntimeError(f"benchmark ranks exited with {[p.exitcode for p in processes]}")
    return reports
