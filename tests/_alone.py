"""Tests marked `alone` run with no other test running, when pytest-xdist runs the suite in several
workers (run_tests.sh: two). Such a test checks timing that another worker's ranks on the same
cores would change: how the CPU is shared between its own processes (who runs first after a
wake-up), or a deadline of a fraction of a second.

A readers-writer lock over the workers, two flock()ed files in the session's shared temporary
directory: every test holds the room shared; an `alone` test holds it exclusively. The turnstile in
front of the room gives the exclusive holder its turn (flock() alone lets shared holders that keep
coming starve it). Without xdist the suite runs one test at a time and nothing is locked."""
from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

import pytest

MARKER = "alone"
WAIT_S = 1800  # longer than any test the other workers may be running (pytest's timeout: 600 s)


class _Lock:
    """One worker's handles on the turnstile and the room."""

    def __init__(self, directory: Path):
        self.turnstile = os.open(directory / "alone.turnstile", os.O_RDWR | os.O_CREAT, 0o600)
        self.room = os.open(directory / "alone.room", os.O_RDWR | os.O_CREAT, 0o600)

    def _take(self, fd: int, mode: int, what: str, test: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{test}: waited {WAIT_S} s for {what}") from None
                time.sleep(0.05)

    def enter(self, alone: bool, test: str) -> None:
        self._take(self.turnstile, fcntl.LOCK_EX, "the turnstile (another worker's alone test)", test)
        if alone:  # keeps the turnstile until it is done: no test starts meanwhile
            try:
                self._take(self.room, fcntl.LOCK_EX, "the other workers' tests to end", test)
            except BaseException:
                fcntl.flock(self.turnstile, fcntl.LOCK_UN)
                raise
        else:
            try:
                self._take(self.room, fcntl.LOCK_SH, "an alone test to end", test)
            finally:
                fcntl.flock(self.turnstile, fcntl.LOCK_UN)

    def leave(self, alone: bool) -> None:
        fcntl.flock(self.room, fcntl.LOCK_UN)
        if alone:
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)


_lock: _Lock | None = None


def configure(config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}: runs while no other test runs (under pytest-xdist's workers): it "
                   f"checks timing that another worker's load would change")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Around a test's setup, call and teardown (module fixtures started or ended by it included)."""
    global _lock
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        yield
        return
    if _lock is None:  # the workers' temporary directories share their parent
        _lock = _Lock(item.config._tmp_path_factory.getbasetemp().parent)
    alone = item.get_closest_marker(MARKER) is not None
    _lock.enter(alone, item.nodeid)
    try:
        yield
    finally:
        _lock.leave(alone)
