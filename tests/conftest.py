"""Shared pytest setup: every test process and every rank it starts uses one thread, and runs on the
CPU (an empty CUDA_VISIBLE_DEVICES); GPU tests, marked `gpu` or `gpu(N)`, get the GPUs back through
_gpu.gpu_env() and are skipped here when the machine has fewer than N (default 1)."""
import os

import pytest

import _gpu

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
_gpu.pin_to_cpu()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu(count=1): needs `count` CUDA GPUs (its GPU work runs in subprocesses with "
                   "_gpu.gpu_env()); skipped with fewer; `pytest -m gpu` runs only these")


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("gpu")
    if marker is not None:
        reason = _gpu.skip_reason(marker.args[0] if marker.args else 1)
        if reason is not None:
            pytest.skip(reason)
