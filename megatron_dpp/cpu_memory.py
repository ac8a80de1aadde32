"""CPU ranks keep the memory they free, instead of handing it back to the kernel at once.

glibc's malloc returns the top of its heap to the kernel once more than 128 KiB of it is free
(M_TRIM_THRESHOLD), and serves blocks above a threshold it moves with every free (M_MMAP_THRESHOLD,
up to 32 MiB) with mmap and munmap. A training step frees and reallocates the same activation and
gradient buffers every microbatch, so on CPU each reallocation touches fresh pages, and every page
costs a fault and zeroing. A split backward, which keeps its W tensors alive across other tasks,
moves the heap's top more and paid about 5% of its compute for it (docs/weight_grad.md). On a GPU
torch's caching allocator keeps device memory anyway; this is for CPU processes only.

`keep_freed_memory()` sets, through mallopt: trim only above 2 GiB free, grow the heap 256 MiB at a
time, and serve blocks up to 32 MiB from the heap. A peak's memory then stays with the process for
the next microbatch (what the caching allocator does on a GPU).
"""
from __future__ import annotations

import ctypes
import ctypes.util
from typing import Optional, Tuple

# malloc.h
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3

# (name, mallopt option, value)
SETTINGS: Tuple[Tuple[str, int, int], ...] = (
    ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, 2 * 1024 ** 3 - 1),  # mallopt takes an int: < 2 GiB
    ("M_TOP_PAD", M_TOP_PAD, 256 * 1024 ** 2),
    ("M_MMAP_THRESHOLD", M_MMAP_THRESHOLD, 32 * 1024 ** 2),  # glibc's largest on 64-bit
)


def _glibc_mallopt() -> Optional[ctypes._CFuncPtr]:
    """glibc's mallopt, or None where the C library is not glibc (musl, macOS)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    gnu_get_libc_version = getattr(libc, "gnu_get_libc_version", None)
    mallopt = getattr(libc, "mallopt", None)
    if gnu_get_libc_version is None or mallopt is None:
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


def keep_freed_memory() -> bool:
    """Apply SETTINGS to this process's malloc; False where the C library is not glibc. A setting
    glibc refuses raises (mallopt returns 0 then)."""
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return False
    for name, option, value in SETTINGS:
        if mallopt(option, value) != 1:
            raise OSError(f"mallopt({name}, {value}) refused by glibc")
    return True
