"""A trace never fails a run (training/observe/tracing.py, trace/chrome.py's write_trace).

- In this process: a trace file that cannot be written (ENOSPC while writing, a path under a file,
  the run directory gone) raises from write_trace with no temporary file left, and is one warning
  line from RunTrace.write, after the end-of-run clock measurement (the collective every rank
  enters); the start-of-run free-space warning and the estimate it compares against.
- The real trainer (two ranks): --trace on a 64 KiB tmpfs (root only, skipped elsewhere; ENOSPC),
  and, for any user, under a 40 KiB file-size limit (RLIMIT_FSIZE: EFBIG; Python ignores SIGXFSZ):
  training finishes with its losses and exit code 0, each rank prints one warning line naming its
  file and the errno, and no temporary file stays.
"""
import argparse
import errno
import glob
import json
import os
import re
import resource
import signal
import subprocess

import pytest

from _tmpfs import mounted_tmpfs
from _train_util import (REPO_ROOT, TINY_GPT_ARGS, _env, data_args, parse_log, run_training,
                         torchrun_command)
from megatron_dpp.trace import chrome
from megatron_dpp.trace.clock import OffsetSample
from megatron_dpp.trace.recorder import TraceRecorder
from megatron_dpp.training.observe import tracing

WRITE_WARNING_RE = re.compile(r"^megatron_dpp: warning: could not write the trace .*$",
                              re.MULTILINE)
SPACE_WARNING_RE = re.compile(r"^megatron_dpp: warning: trace directory .*$", re.MULTILINE)
EVENTS = [chrome.process_name(0, "rank 0")]


def _leftovers(directory) -> list[str]:
    return glob.glob(os.path.join(str(directory), "**", "*.tmp*"), recursive=True)


# ----------------------------------------------------------------------------------------------
# write_trace: whole or not at all, no temporary file left
# ----------------------------------------------------------------------------------------------
def test_a_write_that_fails_midway_leaves_no_temporary_file(tmp_path, monkeypatch):
    def full_disk(document, handle):
        handle.write('{"traceEvents": [')  # a partial file, as a full disk leaves it
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(chrome.json, "dump", full_disk)
    path = tmp_path / "benchmark-rank0.json"
    with pytest.raises(OSError) as caught:
        chrome.write_trace(str(path), EVENTS)
    assert caught.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []


def test_a_path_under_a_file_raises_not_a_directory_and_makes_nothing(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(OSError) as caught:
        chrome.write_trace(str(tmp_path / "a-file" / "benchmark-rank0.json"), EVENTS)
    assert caught.value.errno == errno.ENOTDIR
    assert sorted(os.listdir(tmp_path)) == ["a-file"]


def test_a_written_trace_is_whole_and_alone(tmp_path):
    path = tmp_path / "benchmark-rank0.json"
    chrome.write_trace(str(path), EVENTS, {"rank": 0})
    assert json.loads(path.read_text())["otherData"] == {"rank": 0}
    assert os.listdir(tmp_path) == ["benchmark-rank0.json"]


# ----------------------------------------------------------------------------------------------
# RunTrace.write: the collective first, then the file; a failure is one warning line
# ----------------------------------------------------------------------------------------------
def _run_trace(path, monkeypatch, calls):
    def measure(group):
        calls.append("clock measurement")
        return OffsetSample(at_us=2e6, offset_us=0.0, error_us=1.0)

    monkeypatch.setattr(tracing, "measure_offset", measure)
    real_write = chrome.write_trace

    def write(*args, **kwargs):
        calls.append("write")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(chrome, "write_trace", write)
    return tracing.RunTrace(TraceRecorder(0, "rank 0"), str(path), {"rank": 0}, clock_group=None,
                            clock_at_start=OffsetSample(at_us=1e6, offset_us=0.0, error_us=1.0))


@pytest.mark.parametrize("case", ["under_a_file", "directory_gone", "disk_full"])
def test_a_trace_that_cannot_be_written_is_one_warning_line(tmp_path, monkeypatch, capsys, case):
    calls = []
    if case == "under_a_file":
        (tmp_path / "run").write_text("")
        reason = f"[Errno {errno.ENOTDIR}] {os.strerror(errno.ENOTDIR)}"
    elif case == "directory_gone":
        reason = f"[Errno {errno.ENOENT}] {os.strerror(errno.ENOENT)}"
    else:
        (tmp_path / "run").mkdir()
        reason = f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}"

        def full_disk(document, handle):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(chrome.json, "dump", full_disk)
    path = tmp_path / "run" / "benchmark-rank0.json"
    trace = _run_trace(path, monkeypatch, calls)
    assert trace.write() is False
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        f"megatron_dpp: warning: could not write the trace {path}: {reason}; training is "
        f"unaffected"]
    assert calls == ["clock measurement", "write"]  # the collective entered before the write
    assert _leftovers(tmp_path) == []


def test_only_os_errors_are_warnings(tmp_path, monkeypatch):
    def broken(document, handle):
        raise TypeError("not JSON serializable")

    monkeypatch.setattr(chrome.json, "dump", broken)
    trace = _run_trace(tmp_path / "benchmark-rank0.json", monkeypatch, [])
    with pytest.raises(TypeError):
        trace.write()
    assert os.listdir(tmp_path) == []


def test_a_trace_that_can_be_written_says_nothing(tmp_path, monkeypatch, capsys):
    path = tmp_path / "benchmark-rank0.json"
    assert _run_trace(path, monkeypatch, []).write() is True
    assert capsys.readouterr().err == ""
    assert json.loads(path.read_text())["otherData"]["rank"] == 0


# ----------------------------------------------------------------------------------------------
# At start: the free space against the estimate
# ----------------------------------------------------------------------------------------------
def test_too_little_free_space_is_one_warning_naming_directory_free_and_estimate():
    line = tracing.trace_space_warning("/x/run", ranks=2, per_rank_bytes=100_000, free=65_536)
    assert line == ("megatron_dpp: warning: trace directory /x/run has 65536 bytes free, and the "
                    "traces of this node's 2 rank(s) need about 200000 bytes; they may not be "
                    "written (training is unaffected)")
    assert tracing.trace_space_warning("/x/run", ranks=2, per_rank_bytes=100_000,
                                       free=200_000) is None
    assert tracing.trace_space_warning("/no/such/directory", ranks=2, per_rank_bytes=1) is None


def _args(**overrides):
    parallel = argparse.Namespace(data_parallel_size=1, virtual_pipeline_model_parallel_size=None)
    values = dict(parallel=parallel, global_batch_size=8, micro_batch_size=1, train_iters=4,
                  use_dpp=True, dpp_split_backward=False)
    values.update(overrides)
    return argparse.Namespace(**values)


def test_the_estimate_is_below_a_measured_trace():
    """The tiny GPT at pp=2, M=8, 4 iterations wrote 42 914 to 48 889 bytes a rank (DPP and
    Megatron's 1F1B): the estimate stays under that; it warns only when space is clearly short."""
    estimate = tracing.estimated_trace_bytes(_args())
    assert 4 * 8 * 2 * 500 < estimate < 42_914
    assert tracing.estimated_trace_bytes(_args(dpp_split_backward=True)) == estimate * 3 // 2
    vpp = argparse.Namespace(data_parallel_size=1, virtual_pipeline_model_parallel_size=2)
    assert tracing.estimated_trace_bytes(_args(parallel=vpp)) == estimate * 2
    assert tracing.estimated_trace_bytes(_args(global_batch_size=16)) == estimate * 2


# ----------------------------------------------------------------------------------------------
# The real trainer, its traces unwritable
# ----------------------------------------------------------------------------------------------
ITERATIONS = 8  # about 90 KiB of trace a rank: neither rank's file fits in 64 KiB


def test_a_traced_run_on_a_full_disk_trains_and_warns_once_per_rank(tmp_path):
    with mounted_tmpfs(tmp_path, "64k") as trace_dir:
        rc, losses, _, out = run_training(
            ["--pipeline-model-parallel-size", "2", "--train-iters", str(ITERATIONS), "--trace",
             "--trace-dir", trace_dir, "--use-dpp", "--p2p-transport", "shm"],
            nproc=2, timeout=240)
        _check_warned_run(rc, losses, out, trace_dir,
                          f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}")
        (space,) = SPACE_WARNING_RE.findall(out)  # at start, one line for the node
        (run,) = os.listdir(trace_dir)
        assert f"trace directory {os.path.join(trace_dir, run)} has " in space


def _check_warned_run(rc, losses, out, trace_dir, reason):
    assert rc == 0, out[-3000:]
    assert len(losses) == ITERATIONS, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    (run,) = os.listdir(trace_dir)
    assert sorted(WRITE_WARNING_RE.findall(out)) == [
        f"megatron_dpp: warning: could not write the trace "
        f"{os.path.join(trace_dir, run, f'benchmark-rank{rank}.json')}: {reason}; training is "
        f"unaffected" for rank in (0, 1)], out[-3000:]
    assert _leftovers(trace_dir) == []
    assert os.listdir(os.path.join(trace_dir, run)) == []


FILE_SIZE_LIMIT = 40 * 1024


def _limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE,
                       (FILE_SIZE_LIMIT, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def test_a_traced_run_past_a_file_size_limit_trains_and_warns_once_per_rank(tmp_path):
    """Any user: the ranks under RLIMIT_FSIZE (started under torchrun with the limit, gloo between
    them: shm_tensor's segments are files too). Each rank's trace (about 90 KiB) is past it."""
    trace_dir = str(tmp_path / "traces")
    args = [*data_args(), *TINY_GPT_ARGS, "--pipeline-model-parallel-size", "2", "--train-iters",
            str(ITERATIONS), "--trace", "--trace-dir", trace_dir, "--p2p-transport", "torch"]
    process = subprocess.Popen(torchrun_command(args, 2), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=_env(), cwd=REPO_ROOT,
                               start_new_session=True, preexec_fn=_limit_file_size)
    try:
        out, _ = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, _ = process.communicate()
        raise AssertionError(f"training did not finish within 240 s:\n{out[-4000:]}")
    losses, _ = parse_log(out)
    _check_warned_run(process.returncode, losses, out, trace_dir,
                      f"[Errno {errno.EFBIG}] {os.strerror(errno.EFBIG)}")
    assert SPACE_WARNING_RE.findall(out) == []  # the disk itself has room
