"""tools/host_profile.py: one rank's training iterations under cProfile (and, on a GPU, torch's
sync debug mode), written as a report."""
import subprocess
import sys

import pytest

from _train_util import REPO_ROOT, TINY_GPT_ARGS, _env, data_args

TOOL = str(REPO_ROOT / "tools" / "host_profile.py")


def _run(argv, timeout=240):
    return subprocess.run([sys.executable, TOOL, *argv], cwd=REPO_ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(300)
def test_profiles_the_iterations_from_the_one_asked(tmp_path):
    report = tmp_path / "host.txt"
    flags = [*TINY_GPT_ARGS, "--pipeline-model-parallel-size", "1", "--train-iters", "4",
             *data_args()]
    result = _run(["--report", str(report), "--from-iteration", "3", "--top", "15", "--", *flags])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"host_profile: 2 iterations profiled; report: {report}" in result.stdout
    text = report.read_text()
    times = text.splitlines()[0].split(": ", 1)[1].split(", ")
    assert len(times) == 4 and all(float(ms) > 0 for ms in times), text[:300]
    assert "profiled iterations: 2" in text
    assert "synchronizing calls: not checked (no CUDA device)" in text
    # the profile holds the training step's work: the backward pass and Megatron-Core's schedule
    assert "run_backward" in text and "forward_backward_no_pipelining" in text


@pytest.mark.parametrize("argv, message", [
    (["--report", "r.txt"], "put the trainer's flags after `--`"),
    (["--report", "r.txt", "--from-iteration", "0", "--"], "--from-iteration 0: expected 1 or more"),
    (["--report", "/nonexistent/dir/r.txt", "--"], "--report /nonexistent/dir/r.txt: no directory"),
    (["--model", "t5", "--report", "r.txt", "--"], "invalid choice: 't5'"),
])
def test_bad_usage_is_one_line_exit_2(argv, message):
    result = _run(argv, timeout=60)
    assert result.returncode == 2 and message in result.stderr.splitlines()[-1], result.stderr


@pytest.mark.timeout(300)
def test_a_run_shorter_than_the_first_profiled_iteration_fails(tmp_path):
    flags = [*TINY_GPT_ARGS, "--pipeline-model-parallel-size", "1", "--train-iters", "2",
             *data_args()]
    result = _run(["--report", str(tmp_path / "r.txt"), "--from-iteration", "3", "--", *flags])
    assert result.returncode == 1
    assert ("the run had 2 iterations, fewer than --from-iteration 3: nothing was profiled"
            in result.stderr), result.stderr[-2000:]


def test_sync_sites_are_counted_per_profiled_iteration():
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    from host_profile import IterationProfiler

    profiler = IterationProfiler(first=2)
    profiler.cuda, profiler.calls = True, 3  # iterations 2 and 3 profiled

    def show_warning():  # as warnings._showwarnmsg calls warnings.showwarning
        profiler._count_sync(UserWarning("called a synchronizing CUDA operation (Triggered "
                                         "internally at CUDAFunctions.cpp:162.)"), UserWarning,
                             "clip_grads.py", 133)

    for _ in range(2):
        show_warning()
    text = profiler.report(top=5)
    assert "1 x clip_grads.py:133: called a synchronizing CUDA operation" in text
    assert "test_sync_sites_are_counted_per_profiled_iteration" in text  # the stack of the call


class _Builtins:
    as_text = classmethod(repr)  # a C function called as a bound method


def _background_step():
    return sum(range(100))


def _background_work(stop):
    while not stop.is_set():
        _background_step()


def _leaf():
    return sum(range(2000))


def _profiled_step():
    for _ in range(50):
        _Builtins.as_text()
        _leaf()


@pytest.mark.timeout(60)
def test_thread_profile_keeps_the_call_tree_of_its_thread_only():
    """From Python 3.12 on cProfile sees every thread's calls, and a builtin called as a bound
    method pops its caller's frame (tools/host_profile.py's ThreadProfile mends both): the step
    is one call whose cumulative time holds its callees, and the other thread is absent, even
    when the threads take turns while the profile is being enabled."""
    import pstats
    import threading

    sys.path.insert(0, str(REPO_ROOT / "tools"))
    from host_profile import ThreadProfile

    stop = threading.Event()
    background = threading.Thread(target=_background_work, args=(stop,))
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the threads take turns often, inside enable() too
    background.start()
    try:
        profile = ThreadProfile()
        for _ in range(2):  # enabled twice, as for two profiled iterations
            profile.enable()
            _profiled_step()
            profile.disable()
    finally:
        stop.set()
        background.join(timeout=10)
        sys.setswitchinterval(switch_interval)
    stats = pstats.Stats(profile.profile).stats
    by_name = {name: values for (_file, _line, name), values in stats.items()}
    calls, primitive_calls, _own, cumulative, callers = by_name["_profiled_step"]
    assert (calls, primitive_calls) == (2, 2)
    assert by_name["_leaf"][:2] == (100, 100)
    assert by_name["<built-in method builtins.repr>"][:2] == (100, 100)
    assert cumulative >= by_name["_leaf"][3]
    assert "_background_step" not in by_name
    # every profiled call descends from the step (or from the profiler's own enable/disable)
    roots = {name for (_file, _line, name), values in stats.items() if not values[4]}
    assert "_profiled_step" in roots and "_leaf" not in roots, roots
