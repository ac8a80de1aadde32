"""A small tmpfs for the full-disk tests: `mounted_tmpfs(folder, size)`, root only (skips the test
elsewhere), unmounted on the way out."""
import contextlib
import os
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Iterator

import pytest


@contextlib.contextmanager
def mounted_tmpfs(folder: Path, size: str) -> Iterator[str]:
    """A tmpfs of `size` (mount's notation: "2m") on a new directory under `folder`."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    mount_point = folder / f"tmpfs-{uuid.uuid4().hex[:8]}"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield str(mount_point)
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)
