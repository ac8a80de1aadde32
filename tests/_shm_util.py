"""Helpers for the shm_tensor tests: run a function in N spawned processes that share a FileStore,
collect what each returns (or its traceback), always within a timeout."""
from __future__ import annotations

import os
import queue
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def _entry(fn: Callable, rank: int, world_size: int, store_path: str, results, args) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        from torch.distributed import FileStore

        store = FileStore(store_path, world_size)
        value = fn(rank, world_size, store, *args)
        results.put((rank, "ok", value))
    except BaseException:  # reported to the parent, which fails the test with it
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(
    fn: Callable, world_size: int, tmp_path, *args: Any, timeout_s: float = 120.0,
    expect_killed: tuple[int, ...] = (),
) -> dict[int, Any]:
    """Runs fn(rank, world_size, store, *args) in `world_size` spawned processes; returns
    {rank: return value}. Ranks in `expect_killed` may die without reporting."""
    context = mp.get_context("spawn")
    results = context.Queue()
    store_path = str(tmp_path / f"store-{os.getpid()}-{id(fn)}")
    processes = [
        context.Process(target=_entry, args=(fn, rank, world_size, store_path, results, args))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    outcome: dict[int, Any] = {}
    errors: list[str] = []
    expected = world_size - len(expect_killed)
    try:
        while len(outcome) + len(errors) < expected:
            try:
                rank, status, value = results.get(timeout=timeout_s)
            except queue.Empty:
                raise AssertionError(f"ranks did not report within {timeout_s} s; got {sorted(outcome)}")
            if status == "ok":
                outcome[rank] = value
            else:
                errors.append(f"rank {rank} failed:\n{value}")
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
    assert not errors, "\n".join(errors)
    return outcome


def shm_names(prefix: str = "dpp-") -> list[str]:
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(prefix))


def payload(sender: int, tag: int, dtype: torch.dtype, shape) -> torch.Tensor:
    """The deterministic tensor `sender` sends under `tag`: the receiver rebuilds it to compare."""
    generator = torch.Generator().manual_seed(sender * 100_003 + tag)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    return torch.randint(0, 100, shape, generator=generator).to(dtype)
