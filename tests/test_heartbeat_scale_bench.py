"""benchmarks/heartbeat_scale.py's quick mode: both designs run at 8 and 400 ranks beside a busy
main thread, and the helper (the design in use) delivers its beats and names no healthy peer."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _train_util import REPO_ROOT, _env


@pytest.mark.timeout(300)
def test_quick_run_writes_both_designs_and_the_helper_keeps_up(tmp_path):
    out = tmp_path / "heartbeat_scale.json"
    result = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "benchmarks", "heartbeat_scale.py"), "--quick",
         "--json", str(out)], capture_output=True, text=True, timeout=280, env=_env(),
        cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {(row["ranks"], row["design"]): row for row in report["heartbeat"]}
    assert set(rows) == {(ranks, design) for ranks in (8, 400) for design in ("thread", "helper")}
    for (ranks, design), row in rows.items():
        assert 0 <= row["delivered_share"] <= 1 and row["thread_cpu_ms_per_s"] >= 0, row
        assert (row["helper_cpu_ms_per_s"] is None) == (design == "thread"), row
        if design == "helper":
            # Beside a busy main thread the helper still beats every peer every interval.
            assert row["false_losses"] == 0 and not row["helper_failed"], row
            assert row["delivered_share"] >= 0.8, row
    reading = {row["ranks"]: row for row in report["address_reading"]}
    assert set(reading) == {8, 400}
    assert all(row["one_request_ms"] > 0 and row["request_per_key_ms"] > 0
               for row in reading.values())
    for ranks in (8, 400):
        assert f"{ranks:6d} ranks, helper: false losses" in result.stdout, result.stdout


def test_bad_arguments_are_refused_in_one_line():
    for flags, message in ((["--ranks", "1"], "every rank count must be at least 2"),
                           (["--intervals", "3"], "--intervals must be at least 8"),
                           (["--designs", "fork"], "--designs: unknown fork")):
        result = subprocess.run(
            [sys.executable, os.path.join(REPO_ROOT, "benchmarks", "heartbeat_scale.py"), *flags],
            capture_output=True, text=True, timeout=60, env=_env(), cwd=REPO_ROOT)
        assert result.returncode == 2 and message in result.stderr, (flags, result.stderr)


def test_a_thread_that_ended_keeps_its_last_cpu_reading():
    """The thread design's heartbeat thread ends when it declares a peer lost (what the benchmark
    counts); its CPU time is then the last reading, not a missing /proc file."""
    import threading
    import time

    sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
    from heartbeat_scale import ThreadCpu

    ready, finish = threading.Event(), threading.Event()

    def spin():
        until = time.monotonic() + 0.05
        while time.monotonic() < until:
            pass
        ready.set()
        finish.wait(10)

    thread = threading.Thread(target=spin)
    thread.start()
    ready.wait(10)
    cpu = ThreadCpu(thread.native_id)
    alive = cpu.read()
    assert alive > 0
    finish.set()
    thread.join(10)
    # join() returns once the thread's Python part is done; the kernel task (and its /proc entry)
    # goes a moment later.
    deadline = time.monotonic() + 10
    while os.path.exists(cpu.path) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not os.path.exists(cpu.path), "the ended thread's /proc entry stayed for 10 s"
    assert cpu.read() == alive
    assert ThreadCpu(thread.native_id).read() == 0.0  # gone before its first reading


@pytest.mark.timeout(300)
def test_sealed_beats_keep_up_too(tmp_path):
    """--job-key: the played peers seal their beats for the measured rank, which opens every one
    (a beat that did not open would leave its peer silent: a false loss)."""
    out = tmp_path / "heartbeat_scale.json"
    result = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "benchmarks", "heartbeat_scale.py"), "--quick",
         "--designs", "helper", "--job-key", "--json", str(out)], capture_output=True, text=True,
        timeout=280, env=_env(), cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["settings"]["job_key"] is True
    for row in report["heartbeat"]:
        assert row["job_key"] and row["false_losses"] == 0 and not row["helper_failed"], row
        assert row["delivered_share"] >= 0.8, row
