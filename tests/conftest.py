"""Shared pytest setup: every test process and every rank it starts uses one thread, and runs on the
CPU (an empty CUDA_VISIBLE_DEVICES); GPU tests, marked `gpu` or `gpu(N)`, get the GPUs back through
_gpu.gpu_env() and are skipped here when the machine has fewer than N (default 1). Under
pytest-xdist a test marked `alone` runs while no other test does (_alone.py)."""
import os

import pytest

import _alone
import _gpu
import _hardware_profile
from _alone import pytest_runtest_protocol  # noqa: F401  (a hook: `alone` tests under xdist)

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
_gpu.pin_to_cpu()


def pytest_configure(config):
    _alone.configure(config)
    config.addinivalue_line(
        "markers", "gpu(count=1): needs `count` CUDA GPUs (its GPU work runs in subprocesses with "
                   "_gpu.gpu_env()); skipped with fewer; `pytest -m gpu` runs only these")


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("gpu")
    if marker is not None:
        reason = _gpu.skip_reason(marker.args[0] if marker.args else 1)
        if reason is not None:
            pytest.skip(reason)


@pytest.fixture(scope="session")
def quick_hardware_profile(tmp_path_factory):
    """profile_hardware.sh --quick of this machine, run once per session: (its output directory,
    the finished process). The test of the run asserts that it passed; a reader of its figures
    (the search benchmark) checks the return code too."""
    out = tmp_path_factory.mktemp("quick_hardware_profile") / "hardware"
    return out, _hardware_profile.quick_profile(out)
