"""Concurrent jobs on one data directory take turns at what they write there.

Two writers share data directories: `prepare_sample` (the sample corpus, tokenizers and datasets)
and Megatron-Core's dataset builder, which caches each dataset's indices as .npy files beside the
data (or under --data-cache-path). Megatron-Core writes those files in place, in four steps, and
its readers take the cache as complete once the four files exist: a second job that starts while
the first one writes can load a half-written index, or rewrite one another job is reading.
`DirectoryLock` is an exclusive flock on a lock file in the directory, waited for with a timeout;
a waiting job says once what it waits for and then every WAIT_NOTICE_S seconds.
"""
from __future__ import annotations

import fcntl
import os
import time
from typing import Callable, Optional

from megatron_dpp.data.errors import DataInputError

POLL_S = 0.2         # how often a waiting job tries the lock again
WAIT_NOTICE_S = 30.0  # how often a waiting job says that it still waits


class DirectoryLock:
    """`with DirectoryLock(path, timeout_s, holder, say):` holds an exclusive flock on the file
    `path` (created if missing). `holder` names who holds it while this one waits ("another
    prepare_sample run"); `say` prints the waiting notices. Waiting past timeout_s raises
    DataInputError naming the lock file and the holder."""

    def __init__(self, path: str, timeout_s: float, holder: str,
                 say: Callable[[str], None] = print):
        self.path = path
        self.timeout_s = timeout_s
        self.holder = holder
        self.say = say
        self.file = None

    def __enter__(self) -> "DirectoryLock":
        self.file = _open_for_locking(self.path)
        started = time.monotonic()
        next_notice = started
        while True:
            try:
                fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                now = time.monotonic()
                waited = now - started
                if waited > self.timeout_s:
                    self.file.close()
                    raise DataInputError(
                        f"waited {self.timeout_s:.0f} s for {self.path}, held by {self.holder}; "
                        f"is it stuck?") from None
                if now >= next_notice:
                    self.say(f"waiting for {self.path}, held by {self.holder} ({waited:.0f} s of "
                             f"at most {self.timeout_s:.0f} s)")
                    next_notice = now + WAIT_NOTICE_S
                time.sleep(POLL_S)

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


def _open_for_locking(path: str):
    """The lock file, made if missing, opened for reading: flock needs no write access, so a job
    of another user takes turns too where the file exists."""
    return os.fdopen(os.open(path, os.O_RDONLY | os.O_CREAT, 0o644), "r")


def lock_file_in(directory: str, name: str) -> Optional[str]:
    """DIRECTORY/NAME, made with its directory if missing; None where it neither exists nor can be
    made: a read-only data directory, whose files this job only reads, and in which no job has
    ever taken turns."""
    try:
        if not os.path.isdir(directory):
            os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, name)
        _open_for_locking(path).close()
    except OSError:
        return None
    return path
