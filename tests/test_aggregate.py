"""profiling/aggregate.py: a synthetic pp=2 trace with hand-computed busy, idle, bubble and critical
path; a real traced tiny GPT run merged (each task once, no overlap, every receive with its send's
flow arrow, the plots); --compare; the input errors (one line, exit 2)."""
import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _train_util import PYTHON, REPO_ROOT, run_training

sys.path.insert(0, str(REPO_ROOT))

from megatron_dpp.trace import chrome  # noqa: E402
from megatron_dpp.trace.recorder import (GRADIENT_SYNC, IN_COLLECTIVE, OPTIMIZER_STEP,  # noqa: E402
                                         POSTING_SEND, TraceRecorder)
from trace_analysis.analysis import (COLLECTIVE, DRAIN, FILL, HELD_BACK, INPUT, OTHER, POSTING,  # noqa: E402
                               TENSOR_PARALLEL, iteration_time, mean_step_times)
from trace_analysis.critical_path import critical_path  # noqa: E402
from trace_analysis.load import load_run  # noqa: E402
from trace_analysis.replay import replay  # noqa: E402
from trace_analysis.timeline import run_timeline  # noqa: E402

AGGREGATE = str(REPO_ROOT / "profiling" / "aggregate.py")
INPUT_WAIT = "no task ready: waiting for an input"
HELD = "the policy held back ready tasks (memory budget or its order): B0.0"

# One iteration of a pp=2 run, M=2, in ms from the iteration's start: (name, start, end) per rank,
# the end including the posting of the output send where the task sends one: the last 1 ms, after
# the compute span (rank 0's F, rank 1's B). Window 0..90; each rank computes 58 ms.
RANK0 = [("F0.0", 0, 10), ("F1.0", 10, 20), ("B0.0", 41, 61), ("B1.0", 70, 90)]
RANK1 = [("F0.0", 10, 20), ("B0.0", 20, 40), ("F1.0", 40, 50), ("B1.0", 50, 70)]
WAITS0 = [(20, 30, HELD), (30, 40, INPUT_WAIT), (61, 70, INPUT_WAIT)]  # 40..41 recorded by nothing
# After its last task rank 1 is in the gradient sync from 70 ms: its collectives' waits 70..72 and
# 75..95 (17 ms of them inside the window); 72..75 recorded by nothing.
DP_REDUCTION = f"{IN_COLLECTIVE} data-parallel gradient reduction"
EMBEDDING = f"{IN_COLLECTIVE} embedding gradient all-reduce (first and last pipeline stage)"
STOP = f"{IN_COLLECTIVE} agreeing on a stop signal (all ranks)"
WAITS1 = [(0, 10, INPUT_WAIT), (70, 72, DP_REDUCTION), (75, 95, EMBEDDING)]
# The step around the schedule, per rank: (name, start, end) on the step lane, and the loop's
# stop-signal collective. Rank 0: gradient sync 90..95 (its embedding all-reduce), optimizer
# 95..105, stop 105..110; rank 1: gradient sync 70..95, optimizer 95..103, stop 103..110.
STEPS0 = [(GRADIENT_SYNC, 90, 95), (OPTIMIZER_STEP, 95, 105)]
AFTER0 = [(90, 95, EMBEDDING), (105, 110, STOP)]
STEPS1 = [(GRADIENT_SYNC, 70, 95), (OPTIMIZER_STEP, 95, 103)]
AFTER1 = [(103, 110, STOP)]
RECEIVED0 = {"B0.0": 40, "B1.0": 70}  # when rank 0 took each input in
RECEIVED1 = {"F0.0": 10, "F1.0": 40}
BUDGETS = (200, 100)  # the default budgets at 100 activation bytes per microbatch (1F1B: 2 and 1 held)


def _tag(iteration: int, task: str) -> int:
    return iteration * 1000 + int(task[1]) * 10 + (task[0] == "B")


def write_synthetic_run(directory: Path, name: str = "synthetic-pp2-dpp", scale: float = 1.0,
                        iterations: int = 2, world_size: int = 2, rank1_clock_offset_us: float = 0.0) -> Path:
    """Iteration i starts at 1 s * i and runs the schedule above; iteration 0 twice as slow (a
    warm-up), every iteration `scale` times as slow. With rank1_clock_offset_us, rank 1's events are
    written on a clock that far ahead, with the uncorrected alignment that says so."""
    run = directory / name
    run.mkdir(parents=True)
    for rank, (tasks, waits, received, steps) in enumerate(((RANK0, WAITS0 + AFTER0, RECEIVED0, STEPS0),
                                                            (RANK1, WAITS1 + AFTER1, RECEIVED1, STEPS1))):
        recorder = TraceRecorder(rank, f"rank {rank} (pp {rank}, tp 0, dp 0)")
        held = 0
        for iteration in range(iterations):
            factor = scale * (2.0 if iteration == 0 else 1.0)

            def at(ms: float) -> float:
                return 1.0 * iteration + ms * factor / 1000.0

            recorder.mark(f"iteration {iteration}", at(0), {"forward_only": False, "policy": "1f1b"})
            for start, end, reason in waits:
                recorder.wait(at(start), at(end), reason)
            for step, start, end in steps:
                recorder.step(step, at(start), at(end))
            for task, time in received.items():
                recorder.message(f"recv {task}", at(time), {"peer": 1 - rank, "tag": _tag(iteration, task),
                                                            "bytes": 64})
            for task, start, end in tasks:
                sends = (task[0] == "F" and rank == 0) or (task[0] == "B" and rank == 1)
                computed = end - 1 if sends else end
                recorder.task(task, "forward" if task[0] == "F" else "backward", at(start), at(computed),
                              {"iteration": iteration, "microbatch": int(task[1]), "chunk": 0,
                               "virtual_stage": rank, "tokens": 100})
                held += 100 if task[0] == "F" else -100
                recorder.memory(at(computed), held, BUDGETS[rank])
                if sends:
                    recorder.message(f"send {task}", at(computed), {"peer": 1 - rank, "tag": _tag(iteration, task),
                                                                    "bytes": 64})
                    recorder.wait(at(computed), at(end), f"{POSTING_SEND} {task}")
        metadata = {"run": name, "rank": rank, "world_size": world_size, "pipeline_rank": rank,
                    "tensor_rank": 0, "data_rank": 0, "policy": "1f1b"}
        events = recorder.events
        if rank == 1 and rank1_clock_offset_us:
            events = [{**e, "ts": e["ts"] + rank1_clock_offset_us} if "ts" in e else e for e in events]
            metadata["clock_alignment"] = {"offset_us": rank1_clock_offset_us, "drift": 0.0,
                                           "measured_at_us": 0.0, "timestamps_corrected": False}
        chrome.write_trace(str(run / f"benchmark-rank{rank}.json"), events, metadata)
    return run


def aggregate_command(*args, timeout=180):
    """`python profiling/aggregate.py ARGS`, the command users run."""
    return subprocess.run([PYTHON, AGGREGATE, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO_ROOT)


def aggregate(*args):
    """The same analysis in this process, its exit code and output as the command's (a process
    of its own spends 1.5 s importing matplotlib)."""
    from trace_analysis.aggregate import main

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main([str(arg) for arg in args])
        except SystemExit as exit_:  # argparse's usage errors
            code = exit_.code
    return subprocess.CompletedProcess(args, code, stdout.getvalue(), stderr.getvalue())


def test_synthetic_run_busy_idle_bubble_and_critical_path(tmp_path):
    run = run_timeline(load_run(write_synthetic_run(tmp_path)))
    assert run.training_iterations == [0, 1]
    it = iteration_time(run, 1)
    assert it.duration == pytest.approx(90_000, abs=1e-3)
    rank0, rank1 = it.ranks
    assert rank0.busy == pytest.approx(58_000) and rank1.busy == pytest.approx(58_000)
    assert rank0.idle[HELD_BACK] == pytest.approx(10_000)
    assert rank0.idle[INPUT] == pytest.approx(19_000)
    assert rank0.idle[POSTING] == pytest.approx(2_000) and rank1.idle[POSTING] == pytest.approx(2_000)
    assert rank0.idle[OTHER] == pytest.approx(1_000, abs=1e-3)
    assert rank1.idle[INPUT] == pytest.approx(10_000)
    assert rank1.idle[COLLECTIVE] == pytest.approx(17_000, abs=1e-3)  # 70..72 and 75..90
    # 72..75, after rank 1's last task (70) and recorded by nothing: the drain, not `other`.
    assert rank1.idle[DRAIN] == pytest.approx(3_000, abs=1e-3) and rank1.idle[OTHER] == pytest.approx(0, abs=1e-3)
    assert rank0.idle[FILL] == rank0.idle[DRAIN] == rank1.idle[FILL] == 0  # input waits cover rank 1's fill
    assert rank0.idle[COLLECTIVE] == 0  # its collectives come after the window
    assert rank0.idle[TENSOR_PARALLEL] == rank1.idle[TENSOR_PARALLEL] == 0
    assert it.bubble == pytest.approx(64 / 180)
    # Outputs are there at their sends (at the compute's end, 1 ms before the posting ends), and a
    # rank's next task may start at its last one's compute end, so with the order the ranks ran:
    # r0 F0 0-9 (sent 9), r1 F0 9-19, r1 B0 19-38 (sent 38), r1 F1 38-48, r1 B1 48-67 (sent 67),
    # r0 B1 67-87.
    path = critical_path(run, 1)
    assert path.length == pytest.approx(87_000, abs=1e-3)
    assert [(t.rank, t.name) for t in path.tasks] == [
        (0, "F0.0"), (1, "F0.0"), (1, "B0.0"), (1, "F1.0"), (1, "B1.0"), (0, "B1.0")]
    # The whole step of iteration 1 (the last: up to the rank's last event, 110 ms), per rank; the
    # collective inside the gradient sync counts as gradient sync, not as "other collectives".
    step0, step1 = mean_step_times(run, [1])
    assert (step0.step, step0.tasks, step0.gradient_sync, step0.optimizer, step0.collectives, step0.rest) == \
        pytest.approx((110_000, 58_000, 5_000, 10_000, 5_000, 32_000), abs=1e-3)
    assert (step1.step, step1.tasks, step1.gradient_sync, step1.optimizer, step1.collectives, step1.rest) == \
        pytest.approx((110_000, 58_000, 25_000, 8_000, 7_000, 12_000), abs=1e-3)
    # Iteration 0's step runs from its start to iteration 1's.
    assert mean_step_times(run, [0])[0].step == pytest.approx(1_000_000, abs=1e-3)
    # The warm-up iteration is the same schedule, twice as slow.
    assert iteration_time(run, 0).duration == pytest.approx(180_000, abs=1e-3)
    # 1F1B replayed on these compute durations with free messages and free posting: the critical
    # path's 87 ms (r0 B0.0 fits in 38-58, before B1.0's input at 67).
    replayed = {p.policy: p for p in replay(run, [1]).policies}
    assert replayed["1f1b"].makespans == [pytest.approx(87.0)]
    assert not replayed["dpp:adaptive"].problem


def test_uncorrected_clock_alignment_is_applied(tmp_path):
    run = run_timeline(load_run(write_synthetic_run(tmp_path, rank1_clock_offset_us=5e6)))
    it = iteration_time(run, 1)
    assert it.duration == pytest.approx(90_000, abs=1e-3)
    assert critical_path(run, 1).length == pytest.approx(87_000, abs=1e-3)


@pytest.mark.timeout(240)
def test_synthetic_run_table_plots_and_compare(tmp_path):
    a = write_synthetic_run(tmp_path / "a", "run-a")
    b = write_synthetic_run(tmp_path / "b", "run-b", scale=1.5)
    result = aggregate("--benchmark_dir", tmp_path / "a", "--compare", b, "--replay")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"{tmp_path / 'a'} holds one run: taking run-a" in out
    lines = out.splitlines()
    # busy, input wait, held back, tp decision, send posting, collective, fill, drain, other, bubble:
    # summed over iteration 1, both ranks
    totals = [line.split() for line in lines if line.startswith("total")]
    assert totals[0] == ["total", "116.0", "29.0", "10.0", "0.0", "4.0", "17.0", "0.0", "3.0", "1.0", "35.6%"]
    assert totals[1] == ["total", "174.0", "43.5", "15.0", "0.0", "6.0", "25.5", "0.0", "4.5", "1.5", "35.6%"]
    # The training step per rank: step, tasks, gradient sync, optimizer step, other collectives, rest.
    steps = [line.split()[-6:] for line in lines if line.startswith("rank 1 (pp 1")]
    assert ["110.0", "58.0", "25.0", "8.0", "7.0", "12.0"] in steps, out
    assert ["165.0", "87.0", "37.5", "12.0", "10.5", "18.0"] in steps, out
    assert ["1", "90.0", "87.0", "1.03", "35.6%"] in [line.split() for line in lines]
    assert "critical path of iteration 1 (87.0 ms, 6 tasks): rank 0: F0.0 | rank 1: F0.0 B0.0 F1.0 B1.0 " \
           "| rank 0: B1.0" in out
    assert ["1", "90.0", "135.0", "1.50", "35.6%", "35.6%", "1.00"] in [line.split() for line in lines]
    assert ["1f1b", "*", "87.0", "0.97", "1.00"] in [line.split() for line in lines]
    for png in (a / "run-a-timeline.png", a / "run-a-bubble.png", a / "run-a-vs-run-b-timeline.png",
                a / "run-a-vs-run-b-iterations.png", b / "run-b-timeline.png"):
        assert png.stat().st_size > 1000, png
    merged = json.loads((a / "run-a-aggregated.json").read_text())
    flows = [e for e in merged["traceEvents"] if e["ph"] in "sf"]
    assert len(flows) == 2 * 4 * 2  # 4 messages per iteration, 2 iterations, a start and an end each


def _error(result) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def _edit_rank_file(path: Path, edit) -> None:
    """Rewrite one rank file (still valid JSON) after edit(document) changed it in place."""
    document = json.loads(path.read_text())
    edit(document)
    path.write_text(json.dumps(document))


def _drop_events(path: Path, keep) -> None:
    """Keep only the events keep(event) accepts."""
    _edit_rank_file(path, lambda d: d.update(traceEvents=[e for e in d["traceEvents"] if keep(e)]))


def _is_task(event: dict, name: str = "", iteration=None) -> bool:
    return (event.get("cat") in ("forward", "backward", "weight-grad")
            and event["name"].startswith(name)
            and (iteration is None or event["args"]["iteration"] == iteration))


def _set_metadata(path: Path, **values) -> None:
    _edit_rank_file(path, lambda d: d["otherData"].update(values))


def _del_metadata(path: Path, *keys) -> None:
    _edit_rank_file(path, lambda d: [d["otherData"].pop(key) for key in keys])


def _halve_events(path: Path) -> None:
    """The first half of the events (a recorder's file cut where an iteration ends or midway)."""
    _edit_rank_file(path, lambda d: d.update(traceEvents=d["traceEvents"][:len(d["traceEvents"]) // 2]))


def _duplicate_task(path: Path) -> None:
    def edit(document):
        first = next(e for e in document["traceEvents"] if _is_task(e))
        document["traceEvents"].append(dict(first))
    _edit_rank_file(path, edit)


# Damaged rank files: (what is done to benchmark-rank1.json of a complete run, the one-line error).
# Each is refused before any table is printed (nothing on stdout). The same damage to a real traced
# run is refused in test_real_traced_runs_aggregate_and_compare.
RANK1_FILE = "benchmark-rank1.json"
BAD_RANK_FILES = {
    "no_events": (lambda p: _drop_events(p, lambda e: False),
                  f"{RANK1_FILE}: no task events (an empty or cut rank file"),
    "only_metadata_events": (lambda p: _drop_events(p, lambda e: e.get("ph") == "M"),
                             f"{RANK1_FILE}: no task events"),
    "half_its_events": (_halve_events, f"{RANK1_FILE}: no events of iteration(s) 1, which other ranks "
                                       f"record (an incomplete rank file)"),
    "an_iteration_missing": (lambda p: _drop_events(p, lambda e: "iteration" not in e.get("args", {})
                                                    or e["args"]["iteration"] != 1
                                                    if e.get("cat") != "iteration"
                                                    else e["name"] != "iteration 1"),
                             f"{RANK1_FILE}: no events of iteration(s) 1"),
    "backwards_missing": (lambda p: _drop_events(p, lambda e: not _is_task(e, "B", iteration=1)),
                          f"{RANK1_FILE}: iteration 1 lacks 2 of the 4 tasks every rank runs (B0.0, "
                          f"B1.0; 2 microbatches x 1 chunks x F/B): an incomplete rank file"),
    "one_task_missing": (lambda p: _drop_events(p, lambda e: not _is_task(e, "F1.0", iteration=0)),
                         f"{RANK1_FILE}: iteration 0 lacks 1 of the 4 tasks every rank runs (F1.0;"),
    "a_task_twice": (_duplicate_task, f"{RANK1_FILE}: iteration 0 records F0.0 more than once"),
    "world_size_a_string": (lambda p: _set_metadata(p, world_size="two"),
                            f"{RANK1_FILE}: otherData.world_size is 'two'; expected an integer above 0 "
                            f"(the number of ranks)"),
    "world_size_zero": (lambda p: _set_metadata(p, world_size=0),
                        f"{RANK1_FILE}: otherData.world_size is 0; expected an integer above 0"),
    "rank_a_float": (lambda p: _set_metadata(p, rank=1.0),
                     f"{RANK1_FILE}: otherData.rank is 1.0; expected an integer >= 0 (the global rank)"),
    "pipeline_rank_negative": (lambda p: _set_metadata(p, pipeline_rank=-1),
                               f"{RANK1_FILE}: otherData.pipeline_rank is -1; expected an integer >= 0"),
    "policy_a_number": (lambda p: _set_metadata(p, policy=3),
                        f"{RANK1_FILE}: otherData.policy is 3; expected a string"),
    "node_a_string": (lambda p: _set_metadata(p, node="0"),
                      f"{RANK1_FILE}: otherData.node is '0'; expected an integer >= 0 (the node rank)"),
    "clock_alignment_a_list": (lambda p: _set_metadata(p, clock_alignment=[1, 2]),
                               f"{RANK1_FILE}: otherData.clock_alignment is [1, 2]; expected an object"),
    "world_size_missing": (lambda p: _del_metadata(p, "world_size"),
                           f"{RANK1_FILE}: otherData lacks world_size (a rank trace has run, rank, "
                           f"world_size, pipeline_rank, tensor_rank, data_rank, policy)"),
    "keys_missing": (lambda p: _del_metadata(p, "rank", "pipeline_rank"),
                     f"{RANK1_FILE}: otherData lacks rank, pipeline_rank"),
    "rank_mismatch": (lambda p: _set_metadata(p, rank=0), f"{RANK1_FILE}: its otherData says rank 0"),
    "truncated_json": (lambda p: p.write_text(p.read_text()[: len(p.read_text()) // 2]),
                       f"{RANK1_FILE}: truncated or invalid JSON"),
    "not_a_trace": (lambda p: p.write_text("[]"), f"{RANK1_FILE}: not a rank trace"),
    "uncorrected_clock_without_numbers": (
        lambda p: _set_metadata(p, clock_alignment={"timestamps_corrected": False}),
        f"{RANK1_FILE}: clock_alignment"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(BAD_RANK_FILES))
def test_bad_rank_file_is_one_line_and_exit_2(tmp_path, case):
    damage, expected = BAD_RANK_FILES[case]
    run = write_synthetic_run(tmp_path / "runs")
    damage(run / RANK1_FILE)
    result = aggregate("--benchmark_dir", run)
    assert expected in _error(result), result.stderr
    assert result.stdout == "", result.stdout  # no table measured from the damaged file


@pytest.mark.timeout(300)
def test_bad_input_is_one_line_and_exit_2(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no benchmark-rank*.json" in _error(aggregate("--benchmark_dir", empty))
    assert "no such directory" in _error(aggregate("--benchmark_dir", tmp_path / "nowhere"))

    gap = write_synthetic_run(tmp_path / "gap")
    (gap / "benchmark-rank1.json").rename(gap / "benchmark-rank2.json")
    assert "missing for rank(s) 1" in _error(aggregate("--benchmark_dir", gap))

    short = write_synthetic_run(tmp_path / "short", world_size=4)
    assert "2 rank files, but the run had 4 ranks" in _error(aggregate("--benchmark_dir", short))

    mixed = write_synthetic_run(tmp_path / "mixed", "run-one")
    other = write_synthetic_run(tmp_path / "other", "run-two")
    shutil.copy(other / "benchmark-rank1.json", mixed / "benchmark-rank1.json")
    assert "files from different runs" in _error(aggregate("--benchmark_dir", mixed))

    two = tmp_path / "two"
    write_synthetic_run(two, "run-x")
    write_synthetic_run(two, "run-y")
    assert "holds 2 runs (run-x, run-y)" in _error(aggregate("--benchmark_dir", two))

    good = write_synthetic_run(tmp_path / "good")
    assert "--iterations 'x'" in _error(aggregate("--benchmark_dir", good, "--iterations", "x"))
    assert "selects none" in _error(aggregate("--benchmark_dir", good, "--iterations", "5:9"))
    assert "--no-such-flag" in _error(aggregate("--benchmark_dir", good, "--no-such-flag"))


ITERATIONS, MICROBATCHES = 3, 8


def _traced_run(tmp_path, name: str, schedule_flags: list) -> Path:
    """The tiny GPT at pp=2 with variable lengths, traced; its run directory."""
    rc, _, _, out = run_training(
        ["--pipeline-model-parallel-size", "2", "--p2p-transport", "shm", *schedule_flags,
         "--variable-seq-lengths", "--train-iters", str(ITERATIONS), "--trace",
         "--trace-dir", str(tmp_path / name)], nproc=2, timeout=240)
    assert rc == 0, out[-3000:]
    (run_dir,) = (tmp_path / name).iterdir()
    return run_dir


def _check_merged(run_dir: Path) -> None:
    """Each task once per iteration per rank, no overlap on a rank, every receive with its send."""
    merged = json.loads((run_dir / f"{run_dir.name}-aggregated.json").read_text())
    events = merged["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert sorted(names) == [0, 1]
    assert all(names[r].startswith(f"rank {r} (pp {r}, tp 0, dp 0, node ") for r in range(2)), names
    for rank in range(2):
        tasks = [e for e in events if e["pid"] == rank and e.get("cat") in ("forward", "backward")]
        for iteration in range(ITERATIONS):
            got = sorted(e["name"] for e in tasks if e["args"]["iteration"] == iteration)
            assert got == sorted(f"{p}{m}.0" for p in "FB" for m in range(MICROBATCHES)), (rank, iteration)
        spans = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in tasks)
        for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
            assert start >= end - 1.0, f"rank {rank}: {second} starts before {first} ends"

    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert starts and starts.keys() == ends.keys()
    messages = [e for e in events if e.get("cat") == "message" and e["ph"] == "i"]
    receives = [e for e in messages if e["name"].startswith("recv")]
    send_of = {e["args"]["flow_id"]: e for e in messages if e["name"].startswith("send")}
    assert len(receives) == len(send_of) == len(starts) == ITERATIONS * 2 * MICROBATCHES  # F and B each way
    # The ranks' clocks are aligned within the error each rank's file states (half the shortest
    # ping-pong round trip, which grows on a loaded machine): a receive may appear up to the two
    # ranks' errors before its send.
    error_us = {rank: json.loads((run_dir / f"benchmark-rank{rank}.json").read_text())
                ["otherData"]["clock_alignment"]["error_us"] for rank in range(2)}
    for recv in receives:
        send = send_of[recv["args"]["flow_id"]]  # KeyError: a receive without its send
        assert (send["pid"], send["args"]["peer"]) == (recv["args"]["peer"], recv["pid"])
        assert send["args"]["tag"] == recv["args"]["tag"]
        assert send["ts"] <= recv["ts"] + error_us[send["pid"]] + error_us[recv["pid"]], (send, recv)
        assert starts[recv["args"]["flow_id"]]["pid"] == send["pid"]
        assert ends[recv["args"]["flow_id"]]["pid"] == recv["pid"]
    # Each arrow end lies inside the task it names, on the compute lane, so it binds to that slice.
    task_spans = [e for e in events if e.get("cat") in ("forward", "backward")]
    for flow in [*starts.values(), *ends.values()]:
        task = flow["name"].split(" -> ")[0 if flow["ph"] == "s" else 1]
        enclosing = [e["name"] for e in task_spans if (e["pid"], e["tid"]) == (flow["pid"], flow["tid"])
                     and e["ts"] < flow["ts"] < e["ts"] + e["dur"]]
        assert enclosing == [task], (flow, enclosing)


@pytest.mark.timeout(600)
def test_real_traced_runs_aggregate_and_compare(tmp_path):
    """--use-dpp against Megatron's own 1F1B, both traced by the same recorder, aggregated with
    --compare."""
    dpp_dir = _traced_run(tmp_path, "dpp", ["--use-dpp"])
    megatron_dir = _traced_run(tmp_path, "megatron", [])
    result = aggregate("--benchmark_dir", megatron_dir, "--iterations", "0:")
    assert result.returncode == 0, result.stderr
    result = aggregate_command("--benchmark_dir", dpp_dir, "--iterations", "0:", "--replay",
                               "--compare", megatron_dir)
    assert result.returncode == 0, result.stderr
    assert "every send matched to its receive" in result.stdout
    assert "dpp:adaptive *" in result.stdout
    for run_dir in (dpp_dir, megatron_dir):
        _check_merged(run_dir)
    run_dir, other = dpp_dir, megatron_dir
    for suffix in ("timeline", "bubble", f"vs-{other.name}-timeline", f"vs-{other.name}-iterations"):
        png = run_dir / f"{run_dir.name}-{suffix}.png"
        assert png.stat().st_size > 1000, png
    # A real trace satisfies the completeness rule (above); the same run with rank 1's file
    # damaged is refused in one line, before any table.
    for case, damage, expected in (
            ("empty", lambda p: _drop_events(p, lambda e: False), "no task events"),
            ("half", _halve_events, "no events of iteration(s) "),
            ("backwards", lambda p: _drop_events(p, lambda e: not _is_task(e, "B", iteration=1)),
             f"iteration 1 lacks {MICROBATCHES} of the {2 * MICROBATCHES} tasks every rank runs"),
            ("world_size", lambda p: _set_metadata(p, world_size="two"),
             "otherData.world_size is 'two'")):
        damaged = tmp_path / f"damaged-{case}" / dpp_dir.name
        shutil.copytree(dpp_dir, damaged)
        damage(damaged / RANK1_FILE)
        result = aggregate("--benchmark_dir", damaged)
        assert expected in _error(result), (case, result.stderr)
        assert result.stdout == "", (case, result.stdout)


@pytest.mark.timeout(600)
def test_a_traced_v_placement_run_aggregates_and_replays_on_its_placement(tmp_path):
    """The v placement's traces say so (otherData.placement); the critical path follows its
    stages (a dependency graph of the interleaved placement would have the turn's tasks run before
    their inputs, which aggregate refuses) and the replay tries the policies of that placement."""
    run_dir = _traced_run(tmp_path, "v", ["--use-dpp", "--num-virtual-stages-per-pipeline-rank", "2",
                                          "--dpp-stage-placement", "v", "--dpp-split-backward"])
    placements = {json.loads((run_dir / f"benchmark-rank{rank}.json").read_text())
                  ["otherData"]["placement"] for rank in range(2)}
    assert placements == {"v:2"}
    result = aggregate_command("--benchmark_dir", run_dir, "--iterations", "0:", "--replay")
    assert result.returncode == 0, result.stderr
    assert "every send matched to its receive" in result.stdout
    assert "zb-v" in result.stdout and "interleaved-1f1b" not in result.stdout, result.stdout
