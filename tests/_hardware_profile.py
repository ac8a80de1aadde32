"""run_scripts/profile_hardware.sh as the tests run it, and its quick profile of this machine,
measured once per test session (the `quick_hardware_profile` fixture of conftest.py): the hardware
tests check that run, the search benchmark's test reads its figures instead of measuring again."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "run_scripts" / "profile_hardware.sh"
# Variables the script reads: the tests' own choice only, never the caller's shell.
_SCRIPT_VARIABLES = ("NPROC", "OUTPUT_DIR", "NNODES", "NODE_RANK", "NODE_IPS", "MASTER_PORT")


def run_profile_script(env_changes: dict, *args, timeout: float = 120.0) -> subprocess.CompletedProcess:
    env = {name: value for name, value in os.environ.items() if name not in _SCRIPT_VARIABLES}
    env.update(OMP_NUM_THREADS="1", **env_changes)
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def quick_profile(out: Path) -> subprocess.CompletedProcess:
    """profile_hardware.sh --quick with 2 processes into `out` (fp32 matmuls, as the search's CPU
    runs use)."""
    return run_profile_script({"NPROC": "2", "OUTPUT_DIR": str(out)}, "--quick", "--timeout", "60")
