"""Build script: the Python packages, and (added by the transport work) the C++ extensions.

Install with `pip install --no-build-isolation -e .` (run_scripts/setup_env.sh does this) so the
extensions compile against the torch already installed instead of a fresh one pulled by pip.
"""
from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["megatron_dpp*", "shm_tensor*"]),
)
