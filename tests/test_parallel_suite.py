"""The suite in pytest-xdist's workers (run_scripts/run_tests.sh): tests/_alone.py's `alone` test
runs while no other test runs, and the others still run side by side (a small suite of its own, run
by `pytest -n 2`: each test writes when it started and ended); a bad worker count stops in one line."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
RUN_TESTS = TESTS.parent / "run_scripts" / "run_tests.sh"

SUITE = '''
import json, os, time
import pytest

def _record(name):
    start = time.monotonic()
    time.sleep(0.4)
    with open(os.path.join(os.environ["SPANS"], name), "w") as out:
        json.dump([start, time.monotonic()], out)

@pytest.mark.parametrize("n", range(6))
def test_shared(n):
    _record(f"shared{n}")

@pytest.mark.alone
def test_by_itself():
    _record("alone")

@pytest.mark.parametrize("n", range(6, 12))
def test_shared_after(n):
    _record(f"shared{n}")
'''


def test_an_alone_test_overlaps_no_other_while_the_others_overlap(tmp_path):
    pytest.importorskip("xdist")
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text("import _alone\nfrom _alone import pytest_runtest_protocol\n\n"
                                       "def pytest_configure(config):\n    _alone.configure(config)\n")
    (suite / "test_spans.py").write_text(textwrap.dedent(SUITE))
    spans = tmp_path / "spans"
    spans.mkdir()
    env = {**os.environ, "SPANS": str(spans), "PYTHONPATH": str(TESTS)}
    env.pop("PYTEST_XDIST_WORKER", None)  # this suite may itself run in a worker
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                             "--dist", "load", "--basetemp", str(tmp_path / "base"), str(suite)],
                            capture_output=True, text=True, timeout=180, cwd=suite, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    recorded = {path.name: json.loads(path.read_text()) for path in spans.iterdir()}
    assert len(recorded) == 13, sorted(recorded)
    alone_start, alone_end = recorded.pop("alone")
    overlapping = [name for name, (start, end) in recorded.items() if start < alone_end and end > alone_start]
    assert overlapping == []
    # The other tests did run two at a time (else the check above could not fail).
    shared = sorted(recorded.values())
    assert any(later[0] < earlier[1] for earlier, later in zip(shared, shared[1:]))


def test_a_worker_count_that_is_no_number_stops_before_the_setup():
    env = {**os.environ, "DPP_TEST_WORKERS": "two", "DPP_VENV": "/nonexistent/venv"}
    result = subprocess.run(["bash", str(RUN_TESTS)], capture_output=True, text=True, timeout=60, env=env)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == "run_tests: DPP_TEST_WORKERS=two is not a number of workers (0 for none)\n"
