"""CPU ranks keep the memory they free (megatron_dpp.cpu_memory): a 16 MiB block, touched and freed,
leaves the process's resident memory where it was under glibc's defaults, and stays resident once
keep_freed_memory() ran, as setup_platform does on CPU."""
import subprocess
import sys

import pytest

from _train_util import REPO_ROOT, _env

SCRIPT = """
import ctypes, sys
from megatron_dpp import cpu_memory
if sys.argv[1] == "keep":
    assert cpu_memory.keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
size = 16 * 1024 * 1024
block = libc.malloc(size)
ctypes.memset(block, 1, size)
touched = rss_kib()
libc.free(block)
print(touched - rss_kib())
"""


def _released_kib(mode: str) -> int:
    result = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                            timeout=120, env=_env(), cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    return int(result.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_blocks_stay_with_the_process():
    assert _released_kib("default") > 12 * 1024  # glibc hands the 16 MiB back at once
    assert _released_kib("keep") < 1024  # kept for the next allocation


def test_setup_platform_keeps_freed_memory_on_cpu():
    script = ("import megatron_dpp.cpu_memory as m, megatron_dpp.platform as p; calls = []; "
              "m.keep_freed_memory = lambda: calls.append(1) or True; "
              "p.keep_freed_memory = m.keep_freed_memory; p.setup_platform(); print(len(calls))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, env=dict(_env(), CUDA_VISIBLE_DEVICES=""), cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "1"
