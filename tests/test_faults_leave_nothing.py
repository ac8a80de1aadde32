"""Each fault of docs/failures.md that once left debris, end to end (issue 61): the real job as a
user starts it (`bash run_scripts/run_single_gpt.sh`: the CPU defaults, PP=2 and 2 processes, the
sample data), one fault applied, then
  (a) the exit code the docs give;
  (b) the launcher's last stderr line is the expected one line, and no Python traceback anywhere;
  (c) nothing left: no process of the job, no new shm_tensor name in /dev/shm (`dpp-<token>-r<rank>`,
      shm_tensor/context.py), nothing in the job's private TMPDIR (torchrun's `torchelastic_*`, the
      launcher's `dpp-failures-*`, multiprocessing's `pymp-*`), no `iter_N.saving` after the next
      start.

A job's processes are those whose environment holds its marker (MARKER=<a fresh uuid>, set on the
launcher and inherited by every descendant: torchrun, the ranks, their heartbeat helpers and any
writer process). A thread records them every 0.1 s while the job runs (pid, start time, command,
the /dev/shm files they map); once the launcher has exited, none of them may be alive.
"""
from __future__ import annotations

import contextlib
import getpass
import os
import re
import signal
import socket
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from _shm_util import shm_names
from _tmpfs import mounted_tmpfs
from _train_util import ITERATION_RE, REPO_ROOT, _env, ensure_sample_data
from test_data_bin_size import GPT, copy_prefix, empty_line, short_line
from test_heartbeat import MARKER, _pid_of_rank

SCRIPT = REPO_ROOT / "run_scripts" / "run_single_gpt.sh"
HOST = socket.gethostname()
BANNER = "run_single_gpt: 2 processes"  # printed after the pre-check, before torchrun starts
# torch's compile cache, $TMPDIR/torchinductor_<user>: made when Megatron-Core's @jit_fuser
# decorators are imported, and kept across jobs on purpose (a cache, not a job's temporary files).
TORCH_CACHE = f"torchinductor_{getpass.getuser()}"
# The tiny recipe with a wider model: a torch_dist save of 49 MiB, about half a second a rank.
SAVE_MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
              "--seq-length", "64", "--max-position-embeddings", "64", "--eval-iters", "0",
              "--log-interval", "1", "--ckpt-format", "torch_dist", "--save-interval", "1"]


def _start_time(pid: int) -> str | None:
    """/proc/PID/stat's start time (field 22), which tells a pid reused by another process apart;
    None when the process is gone or a zombie (it has exited; its parent has yet to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            fields = file.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _environ_has(pid: int, variable: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as file:
            return variable in file.read().split(b"\0")
    except OSError:
        return False


def _read(path: str, binary: bool = False):
    try:
        with open(path, "rb" if binary else "r") as file:
            return file.read()
    except OSError:
        return b"" if binary else ""


class Job:
    """`bash run_single_gpt.sh ARGS` in its own session, from `tmp_path`, with a private TMPDIR;
    its output read line by line, its processes recorded while it runs. Started by the `start_job`
    fixture, which kill()s it after the test: the checks of what it left come first."""

    def __init__(self, tmp_path: Path, name: str, args: list[str], env: dict | None = None):
        self.name = name
        self.tmpdir = tmp_path / f"tmpdir-{name}"
        self.tmpdir.mkdir()
        self.marker = f"{MARKER}={uuid.uuid4().hex}".encode()
        environment = _env()
        environment.update({MARKER: self.marker.decode().split("=", 1)[1],
                            "TMPDIR": str(self.tmpdir), "DATA_DIR": str(ensure_sample_data())})
        environment.update(env or {})
        self.shm_before = set(shm_names())
        # (pid, start time) -> its command lines (the launcher's shell execs torchrun's Python)
        self.seen: dict[tuple[int, str], set[str]] = {}
        self.shm_mapped: set[str] = set()  # /dev/shm names any process of the job mapped
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.started = time.monotonic()
        self.process = subprocess.Popen(["bash", str(SCRIPT), *args], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env=environment,
                                        cwd=tmp_path, start_new_session=True)
        self._ended = threading.Event()
        self._threads = [threading.Thread(target=self._collect, args=(self.process.stdout, self.stdout)),
                         threading.Thread(target=self._collect, args=(self.process.stderr, self.stderr)),
                         threading.Thread(target=self._watch)]
        for thread in self._threads:
            thread.start()

    # -- while it runs ---------------------------------------------------------------------------
    @staticmethod
    def _collect(stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))

    def _watch(self) -> None:
        while True:
            self.record()
            if self._ended.wait(0.1):
                return

    def processes(self) -> dict[int, tuple[str, str]]:
        """The live processes whose environment holds this job's marker."""
        found = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and _environ_has(int(entry), self.marker):
                start = _start_time(int(entry))
                if start is not None:
                    command = _read(f"/proc/{entry}/cmdline", binary=True)
                    found[int(entry)] = (start, command.replace(b"\0", b" ").decode(errors="replace"))
        return found

    def record(self) -> None:
        for pid, (start, command) in self.processes().items():
            self.seen.setdefault((pid, start), set()).add(command)
            for line in _read(f"/proc/{pid}/maps").splitlines():
                if "/dev/shm/" in line:
                    self.shm_mapped.add(line.split("/dev/shm/", 1)[1].split()[0])

    def output(self) -> str:
        return "\n".join(self.stdout) + "\n" + "\n".join(self.stderr)

    def tail(self) -> str:
        return (f"--- {self.name}: stdout ---\n" + "\n".join(self.stdout[-40:]) +
                f"\n--- {self.name}: stderr ---\n" + "\n".join(self.stderr[-40:]))

    def wait_for(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        """Polls `condition` every 5 ms (a save's staging folder exists for about half a second)."""
        deadline = time.monotonic() + timeout
        while not condition():
            if self.process.poll() is not None:
                raise AssertionError(f"the job ended (exit {self.process.returncode}) before "
                                     f"{what}\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout} s\n{self.tail()}")
            time.sleep(0.005)

    def iterations(self) -> int:
        done = [int(m.group(1)) for line in self.stdout if (m := ITERATION_RE.search(line))]
        return max(done, default=0)

    def rank_pid(self, rank: int) -> int:
        pid = _pid_of_rank(self.marker.decode().split("=", 1)[1], rank)
        assert pid is not None, f"no process of rank {rank} found\n{self.tail()}"
        return pid

    def wait(self, timeout: float) -> int:
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the job did not end within {timeout} s\n{self.tail()}")
        self.ended_at = time.monotonic()
        self._ended.set()
        for thread in self._threads:  # a process left holding the job's output keeps its reader
            thread.join(timeout=5)
        return code

    # -- afterwards ------------------------------------------------------------------------------
    def left_processes(self, grace_s: float = 2.0) -> list[str]:
        """Processes of the job still alive `grace_s` after the launcher exited (time for one that
        is exiting): those recorded while it ran, with the same start time, and any with the
        marker."""
        deadline = time.monotonic() + grace_s
        while True:
            alive = {pid: " | ".join(sorted(commands)) for (pid, start), commands in self.seen.items()
                     if _start_time(pid) == start}
            alive.update({pid: command for pid, (_, command) in self.processes().items()})
            if not alive or time.monotonic() > deadline:
                return [f"pid {pid}: {command}" for pid, command in sorted(alive.items())]
            time.sleep(0.1)

    def left_shm(self) -> list[str]:
        """shm_tensor's names (dpp-*) new since the start and still there a second later (another
        job's names exist for milliseconds, between its setup's two barriers), and any /dev/shm
        name a process of this job mapped."""
        new = set(shm_names()) - self.shm_before
        if new:
            time.sleep(1)
            new &= set(shm_names())
        mapped = {name for name in self.shm_mapped if os.path.exists(f"/dev/shm/{name}")}
        return sorted(new | mapped)

    def left_temporary_files(self) -> list[str]:
        return sorted(str(path.relative_to(self.tmpdir)) for path in self.tmpdir.rglob("*")
                      if path.relative_to(self.tmpdir).parts[0] != TORCH_CACHE)

    def kill(self) -> None:
        # The launcher's session, then every process of the job (a heartbeat helper may have a
        # process group of its own); a stopped process is continued first, as a test may stop one.
        for sent in (signal.SIGCONT, signal.SIGKILL):
            with contextlib.suppress(OSError):
                os.killpg(self.process.pid, sent)
            for pid in self.processes():
                with contextlib.suppress(OSError):
                    os.kill(pid, sent)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)
        for name in self.shm_mapped:  # what a failing job left in /dev/shm
            with contextlib.suppress(OSError):
                os.unlink(f"/dev/shm/{name}")
        self._ended.set()
        for thread in self._threads:
            thread.join(timeout=30)


@dataclass
class Run:
    """One start of the job and what it must show: its exit code, its launcher's last stderr line
    (a regex, None for a finished run: its last lines are the ranks' own), the lines that must
    appear (regex -> how many times), whether torchrun started."""
    job: Job
    exit_code: int
    last_line: str | None
    lines: dict[str, int] = field(default_factory=dict)
    started: bool = True


def _last_stderr_line(job: Job) -> str:
    lines = [line for line in job.stderr if line.strip()]
    return lines[-1] if lines else ""


# ----------------------------------------------------------------------------------------------
# The faults: each starts its job(s) with start(name, args, env), applies the fault and returns
# the runs to check
# ----------------------------------------------------------------------------------------------
def kill_9_during_a_save(tmp_path: Path, start) -> list[Run]:
    """kill -9 of rank 1 while iter_0000002.saving/ is being written (--ckpt-format torch_dist),
    then a second start with --load, which removes that folder (one line) and trains on.

    Deterministic: iteration 1's save completes first (a checkpoint to resume from, and rank 1's
    pid is found then); the moment iteration 2's staging folder appears (polled every 5 ms; it
    lives about half a second) rank 1 is frozen with SIGSTOP, so that the save cannot finish
    without it whatever the scheduler does; one second later the folder must still be there (else
    the save was too quick to catch: the test fails saying so), and rank 1 gets SIGKILL, mid-save."""
    save = tmp_path / "ckpt"
    staging = save / "iter_0000002.saving"
    job = start("killed", [*SAVE_MODEL, "--train-iters", "2", "--save", str(save)],
                {"RECIPE": "gpt3_tiny"})
    job.wait_for(lambda: any("saved checkpoint at iteration 1" in line for line in job.stdout),
                 150, "checkpoint of iteration 1")
    rank_1 = job.rank_pid(1)
    job.wait_for(staging.is_dir, 60, f"{staging}")
    os.kill(rank_1, signal.SIGSTOP)
    time.sleep(1)
    assert staging.is_dir(), f"the save finished before rank 1 was stopped\n{job.tail()}"
    os.kill(rank_1, signal.SIGKILL)
    job.wait(60)
    assert staging.is_dir(), "the killed save's folder should stay for the next start"
    # Rank 0 names the lost rank 1 either way: its collective with it fails ("lost the peer"), or,
    # where it is not in one with it then (seen once with two pytest workers on two cores), its
    # heartbeats stop and rank 0 finds its process gone.
    killed = Run(job, 137, rf"megatron_dpp\.rank_launcher: rank 1 on {re.escape(HOST)} was killed "
                           rf"by SIGKILL; then: \[dpp rank 0\] (lost the peer .*|lost rank 1 "
                           rf"\(node 0, 127\.0\.0\.1\): no heartbeat from it for [\d.]+ s "
                           rf"\(inbound\); its process \(pid {rank_1} on node 0\) has exited .*)")

    resumed = start("resumed", [*SAVE_MODEL, "--train-iters", "2", "--save", str(save), "--load",
                                str(save)], {"RECIPE": "gpt3_tiny"})
    resumed.wait(150)
    # It loaded iteration 1 (trained iteration 2 only) and saved iteration 2 again; no .saving.
    assert resumed.iterations() == 2, resumed.tail()
    assert not any(re.search(r" iteration\s+1/", line) for line in resumed.stdout), \
        f"iteration 1 was trained again: its checkpoint was not loaded\n{resumed.tail()}"
    assert sorted(os.listdir(save)) == ["iter_0000001", "iter_0000002",
                                        "latest_checkpointed_iteration.txt"]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    return [killed, Run(resumed, 0, None, {
        re.escape(f"removed iter_0000002.saving from {save}: the staging folder of a save that did "
                  f"not finish"): 1})]


def damaged_bin(damage: str) -> Callable[[Path, Callable], list[Run]]:
    """The sample data copied into tmp_path, its .bin `damage`d ("half": cut to half; "empty")."""
    def case(tmp_path: Path, start) -> list[Run]:
        prefix, size = copy_prefix(tmp_path, GPT, damage)
        sample = ensure_sample_data()
        data = (f"--data-path {prefix} --vocab-file {sample / 'vocab.json'} "
                f"--merge-file {sample / 'merges.txt'}")
        line = short_line(prefix, size, size // 2) if damage == "half" else empty_line(prefix, size)
        job = start(damage, ["--train-iters", "2"], {"DATA_ARGS": data})
        job.wait(120)
        # The line goes on with what to do about it.
        return [Run(job, 2, re.escape(f"megatron_dpp: error: --data-path {prefix}: {line}") + ".*",
                    started=False)]
    return case


def trace_on_a_full_tmpfs(tmp_path: Path, start) -> list[Run]:
    """--trace into a 64 KiB tmpfs (root only): each rank's trace (about 90 KiB) cannot be
    written; the run finishes, each rank says so once, and nothing is left on the tmpfs but the
    run's folder, empty (the warnings name it)."""
    with mounted_tmpfs(tmp_path, "64k") as trace_dir:
        job = start("trace", ["--train-iters", "8", "--eval-iters", "0", "--trace", "--trace-dir",
                              trace_dir])
        job.wait(150)
        files = [os.path.join(root, name) for root, _dirs, names in os.walk(trace_dir)
                 for name in names]
        assert files == [], files
        (run,) = os.listdir(trace_dir)
        folder = os.path.join(trace_dir, run)
        assert os.listdir(folder) == []
    return [Run(job, 0, None, {
        "^" + re.escape(f"megatron_dpp: warning: could not write the trace {folder}/benchmark-rank"
                        f"{rank}.json: [Errno 28] No space left on device; training is "
                        f"unaffected") + "$": 1
        for rank in (0, 1)})]


def sigstop_until_lost(tmp_path: Path, start) -> list[Run]:
    """Rank 1 frozen with SIGSTOP from iteration 2 on: rank 0 reports it lost after
    --heartbeat-timeout (3 s), exit 4, and the launcher kills the stopped rank at once (not after
    torchrun's 30 s for a SIGTERM it cannot act on)."""
    job = start("stopped", ["--train-iters", "1000", "--log-interval", "1", "--eval-iters", "0",
                            "--heartbeat-interval", "0.5", "--heartbeat-timeout", "3"])
    job.wait_for(lambda: job.iterations() >= 2, 150, "iteration 2")
    rank_1 = job.rank_pid(1)
    os.kill(rank_1, signal.SIGSTOP)
    stopped_at = time.monotonic()
    job.wait(90)
    took = job.ended_at - stopped_at
    assert took < 20, f"the job ended {took:.0f} s after rank 1 was stopped\n{job.tail()}"
    return [Run(job, 4, rf"\[dpp rank 0\] lost rank 1 \(node 0, [^)]*\): no heartbeat from it for "
                        rf"[\d.]+ s \(inbound\); its process \(pid {rank_1} on node 0\) is stopped "
                        rf"or frozen .*")]


FAULTS = [
    pytest.param(kill_9_during_a_save, id="kill_9_rank_1_during_a_torch_dist_save"),
    pytest.param(damaged_bin("half"), id="bin_cut_to_half"),
    pytest.param(damaged_bin("empty"), id="bin_empty"),
    pytest.param(trace_on_a_full_tmpfs, id="trace_on_a_64k_tmpfs"),
    pytest.param(sigstop_until_lost, id="sigstop_rank_1_until_lost"),
]


@pytest.fixture
def start_job(tmp_path):
    """start(name, args, env) -> a started Job; every job is killed after the test (its checks
    first), so that a failing test leaves no process."""
    jobs: list[Job] = []

    def start(name: str, args: list[str], env: dict | None = None) -> Job:
        jobs.append(Job(tmp_path, name, args, env))
        return jobs[-1]

    yield start
    for job in jobs:
        job.kill()


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_ends_in_one_line_and_leaves_nothing(fault, tmp_path, start_job):
    for run in fault(tmp_path, start_job):
        job = run.job
        print(job.tail())  # shown when the test fails
        assert job.process.returncode == run.exit_code, \
            f"exit {job.process.returncode}, expected {run.exit_code}\n{job.tail()}"
        assert "Traceback" not in job.output(), job.tail()
        if run.last_line is not None:
            assert re.fullmatch(run.last_line, _last_stderr_line(job)), job.tail()
        for pattern, count in run.lines.items():
            found = [line for line in job.output().splitlines() if re.search(pattern, line)]
            assert len(found) == count, f"{pattern}: {found}\n{job.tail()}"
        # The watch sees the job's processes (so that it would see any left): torchrun's where
        # the job got that far, none where the pre-check stopped it.
        launched = [command for commands in job.seen.values() for command in commands
                    if "megatron_dpp.rank_launcher" in command]
        assert bool(launched) == run.started, f"{launched}\n{job.tail()}"
        assert (BANNER in job.output()) == run.started, job.tail()
        if not run.started:  # stopped by the pre-check: its line is all the job printed
            assert len([line for line in job.stderr if line.strip()]) == 1, job.tail()
        left = job.left_processes()
        assert left == [], "processes left:\n" + "\n".join(left) + "\n" + job.tail()
        assert job.left_shm() == [], job.tail()
        assert job.left_temporary_files() == [], job.tail()
