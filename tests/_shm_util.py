"""Helpers for the shm_tensor tests: run a function in N spawned processes that share a FileStore,
collect what each returns (or its traceback), always within a timeout."""
from __future__ import annotations

import os
import queue
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def _entry(fn: Callable, rank: int, world_size: int, store_path: str, results, args,
           env: dict[str, str] | None) -> None:
    if env is not None:  # before anything initializes CUDA in this process
        os.environ.clear()
        os.environ.update(env)
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
    expect_killed: tuple[int, ...] = (), env: dict[str, str] | None = None,
) -> dict[int, Any]:
    """Runs fn(rank, world_size, store, *args) in `world_size` spawned processes; returns
    {rank: return value}. Ranks in `expect_killed` may die without reporting. `env`: the
    environment of each process (GPU tests: _gpu.gpu_env(), so that the ranks see the GPUs)."""
    context = mp.get_context("spawn")
    results = context.Queue()
    store_path = str(tmp_path / f"store-{os.getpid()}-{id(fn)}")
    processes = [
        context.Process(target=_entry, args=(fn, rank, world_size, store_path, results, args, env))
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


def block_syscall(number: int, errno_value: int, name: str) -> None:
    """Makes syscall `number` (x86_64 numbering) fail with `errno_value` in this thread and the
    threads it starts later, as a restrictive seccomp profile would: a seccomp filter, installed
    without privileges after PR_SET_NO_NEW_PRIVS. `name` is for the error on other machines."""
    import ctypes
    import platform

    if platform.machine() != "x86_64":
        raise RuntimeError(f"blocking {name} knows the x86_64 syscall number only")
    libc = ctypes.CDLL(None, use_errno=True)

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                    ("k", ctypes.c_uint32)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    program = (SockFilter * 4)(
        SockFilter(0x20, 0, 0, 0),  # load seccomp_data.nr
        SockFilter(0x15, 0, 1, number),  # equal? next : skip one
        SockFilter(0x06, 0, 0, 0x00050000 | errno_value),  # SECCOMP_RET_ERRNO | errno_value
        SockFilter(0x06, 0, 0, 0x7FFF0000),  # SECCOMP_RET_ALLOW
    )
    fprog = SockFprog(len(program), program)
    pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2
    if libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(pr_set_seccomp, seccomp_mode_filter, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def block_process_vm_readv() -> None:
    """process_vm_readv fails with ENOSYS from now on (single-copy receives fall back)."""
    block_syscall(310, 38, "process_vm_readv")


def wait_until_dead(pid: int, timeout_s: float) -> None:
    """Until process `pid` has exited (gone or a zombie nobody reaped yet)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except FileNotFoundError:
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} still alive after {timeout_s} s")
