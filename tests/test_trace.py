"""--trace on the tiny GPT (pp=2): the DPP runtime and Megatron's own 1F1B and interleaved schedules,
recorded by the same recorder. One Chrome trace per rank; every task once per iteration; no two tasks
of a rank at once; every receive matches a send of the task that feeds it, and (on rank 0's clock,
within the stored error) comes after it; memory within budget under DPP; each iteration's gradient
sync (with Megatron's collectives inside it), optimizer step, loss all-reduce and stop-signal
agreement once, in that order, after the iteration's tasks.

Also, without processes: the clock-alignment arithmetic, Megatron's task order and message pairing,
and the timers hook."""
import pytest

from _trace_checks import check_clock_alignment, check_messages, load_traces
from _train_util import run_training
from megatron_dpp.pipeline import Phase, Task, TaskGraph
from megatron_dpp.trace.recorder import GRADIENT_SYNC, IN_COLLECTIVE, OPTIMIZER_STEP, POSTING_SEND
from megatron_dpp.training.observe.step_tracing import FINALIZE_COLLECTIVES, LOSS_ALL_REDUCE, STOP_AGREEMENT
from megatron_dpp.trace.clock import ClockAlignment, OffsetSample, offset_from_rounds

ITERATIONS, MICROBATCHES = 3, 8
VARLEN = ["--variable-seq-lengths"]

# name -> (flags, run-name suffix, model chunks per rank)
RUNS = {
    "dpp": (["--use-dpp", "--p2p-transport", "shm", *VARLEN], "-pp2-dpp", 1),
    "megatron_1f1b": (["--p2p-transport", "torch", *VARLEN], "-pp2-1f1b", 1),
    # Fixed shapes: the interleaved schedule then overlaps its messages (waits on them later).
    "megatron_interleaved": (["--p2p-transport", "shm", "--num-virtual-stages-per-pipeline-rank",
                              "2"], "-pp2-vpp2-interleaved", 2),
}


def _traced_run(tmp_path, flags):
    rc, losses, _, out = run_training(
        ["--pipeline-model-parallel-size", "2", "--train-iters", str(ITERATIONS), "--trace",
         "--trace-dir", str(tmp_path), *flags], nproc=2, timeout=240)
    assert rc == 0, out[-3000:]
    assert len(losses) == ITERATIONS, out[-3000:]
    return load_traces(tmp_path, world_size=2)


def _check_rank(rank, trace, run_name, chunks):
    meta = trace["otherData"]
    assert meta["run"] == run_name and meta["rank"] == rank and meta["world_size"] == 2
    events = trace["traceEvents"]
    tasks = [e for e in events if e.get("cat") in ("forward", "backward")]
    for iteration in range(ITERATIONS):
        names = sorted(e["name"] for e in tasks if e["args"]["iteration"] == iteration)
        expected = sorted(f"{phase}{m}.{c}" for phase in "FB" for m in range(MICROBATCHES)
                          for c in range(chunks))
        assert names == expected, (rank, iteration, names)
    for e in tasks:
        task = Task.parse(e["name"])
        assert (e["args"]["microbatch"], e["args"]["chunk"]) == (task.microbatch, task.chunk)
        assert e["args"]["virtual_stage"] == task.chunk * 2 + meta["pipeline_rank"]
        assert e["args"]["tokens"] > 0
    busy = sorted((e["ts"], e["ts"] + e["dur"], e["name"])
                  for e in events if e.get("ph") == "X" and e["tid"] == 0)
    for (_, end, first), (start, _, second) in zip(busy, busy[1:]):
        assert start >= end - 1.0, f"rank {rank}: {second} starts before {first} ends"
    assert all(e["args"]["reason"] for e in events if e.get("cat") == "idle")
    marks = [e["name"] for e in events if e.get("cat") == "iteration"]
    assert marks == [f"iteration {i}" for i in range(ITERATIONS)], marks
    _check_messages_sit_at_their_tasks(rank, events)
    _check_step_parts(rank, events, is_last_stage=meta["pipeline_rank"] == 1)


def _check_step_parts(rank, events, is_last_stage):
    """Per iteration (from its mark to the next): one gradient sync after the iteration's last task,
    holding a wait for each of Megatron's finalize collectives; then one optimizer step; then the
    loss all-reduce (last stage only) and the stop-signal agreement, each once."""
    marks = sorted(e["ts"] for e in events if e.get("cat") == "iteration") + [float("inf")]
    for iteration in range(ITERATIONS):
        low, high = marks[iteration], marks[iteration + 1]
        within = [e for e in events if low <= e.get("ts", -1) < high]
        steps = sorted((e for e in within if e.get("cat") == "step"), key=lambda e: e["ts"])
        assert [e["name"] for e in steps] == [GRADIENT_SYNC, OPTIMIZER_STEP], (rank, iteration, steps)
        assert all(e["tid"] == 2 for e in steps)
        sync, optimizer = steps
        last_task_end = max(e["ts"] + e["dur"] for e in events if e.get("cat") in ("forward", "backward")
                            and e["args"]["iteration"] == iteration)
        assert sync["ts"] >= last_task_end - 1.0, (rank, iteration)
        assert optimizer["ts"] >= sync["ts"] + sync["dur"] - 1.0, (rank, iteration)
        collectives = [(e["ts"], e["args"]["reason"][len(IN_COLLECTIVE) + 1:]) for e in within
                       if e.get("cat") == "idle" and e["args"]["reason"].startswith(IN_COLLECTIVE)]
        in_sync = sorted(what for ts, what in collectives if ts < sync["ts"] + sync["dur"])
        assert in_sync == sorted(FINALIZE_COLLECTIVES.values()), (rank, iteration, in_sync)
        after = [what for ts, what in sorted(collectives) if ts >= optimizer["ts"] + optimizer["dur"] - 1.0]
        assert after == ([LOSS_ALL_REDUCE] if is_last_stage else []) + [STOP_AGREEMENT], (rank, after)


def _check_messages_sit_at_their_tasks(rank, events):
    """Ties the names of tasks to the names of messages: `recv X` comes before X starts, and
    `send X` at or after X's end (a span is compute only) and before the rank's next task starts,
    with the posting's wait starting at the send. (The pairing of messages across ranks is by tag,
    which the transport matched, so a wrong task order would show up here.)"""
    marks = sorted(e["ts"] for e in events if e.get("cat") == "iteration")
    tasks = sorted((e["ts"], e["args"]["iteration"], e["name"], e["ts"] + e["dur"]) for e in events
                   if e.get("cat") in ("forward", "backward"))
    starts = {(iteration, name): start for start, iteration, name, _ in tasks}
    ends = {(iteration, name): end for _, iteration, name, end in tasks}
    next_start = {(iteration, name): following[0] for (_, iteration, name, _), following
                  in zip(tasks, tasks[1:])}
    # Each send's posting is a wait that starts at the send instant (one time value recorded twice).
    postings = [(e["args"]["reason"], e["ts"]) for e in events
                if e.get("cat") == "idle" and e["args"]["reason"].startswith(POSTING_SEND)]
    sends = 0
    for e in events:
        if e.get("cat") != "message":
            continue
        iteration = sum(1 for mark in marks if mark <= e["ts"]) - 1
        kind, _, name = e["name"].partition(" ")
        start = starts[(iteration, name)]
        if kind == "recv":
            assert e["ts"] <= start, f"rank {rank}: {e['name']} after {name} started"
            continue
        sends += 1
        # 1 us: the clock correction rounds each event on its own.
        assert ends[(iteration, name)] - 1.0 <= e["ts"] <= next_start.get((iteration, name), float("inf")), (
            f"rank {rank}: {e['name']} not between {name}'s end and the next task's start")
        assert (f"{POSTING_SEND} {name}", e["ts"]) in postings, f"rank {rank}: no posting wait of {name}"
    assert len(postings) == sends, (rank, len(postings), sends)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(RUNS))
def test_traced_run_writes_one_consistent_trace_per_rank(tmp_path, name):
    flags, suffix, chunks = RUNS[name]
    run, traces = _traced_run(tmp_path, flags)
    assert run.name.endswith(suffix), run.name
    for rank, trace in traces.items():
        _check_rank(rank, trace, run.name, chunks)
    check_messages(traces, chunks, MICROBATCHES)
    check_clock_alignment(traces)
    memory = [e["args"] for trace in traces.values() for e in trace["traceEvents"]
              if e.get("ph") == "C"]
    if name == "dpp":
        assert memory and all(0 <= m["held"] <= m["budget"] for m in memory)
    else:
        assert not memory  # Megatron's schedules keep no activation budget
    waits = [e["args"]["reason"] for trace in traces.values() for e in trace["traceEvents"]
             if e.get("cat") == "idle"]
    if name != "dpp":
        assert any(reason.startswith("waiting for an input from rank ") for reason in waits), waits


# ---- clock alignment arithmetic ---------------------------------------------------------------
def test_offset_comes_from_the_shortest_round_trip():
    # The peer's clock runs 500 us ahead; the first round queued (long and lopsided).
    rounds = [(1000.0, 100.0, 3000.0), (4000.0, 3550.0, 4100.0), (5000.0, 4560.0, 5120.0)]
    sample = offset_from_rounds(rounds)
    assert sample.error_us == 50.0 and sample.at_us == 4050.0
    assert sample.offset_us == 500.0


def test_alignment_corrects_offset_and_drift():
    start = OffsetSample(at_us=1_000.0, offset_us=200.0, error_us=30.0)
    end = OffsetSample(at_us=1_001_000.0, offset_us=300.0, error_us=40.0)
    alignment = ClockAlignment.from_samples(0, start, end)
    assert alignment.drift == pytest.approx(1e-4) and alignment.error_us == 40.0
    assert alignment.corrected(1_000.0) == pytest.approx(800.0)
    assert alignment.corrected(1_001_000.0) == pytest.approx(1_000_700.0)
    span, instant, meta = alignment.correct_events([
        {"ph": "X", "ts": 1_000.0, "dur": 1_000_000.0}, {"ph": "i", "ts": 501_000.0},
        {"ph": "M", "name": "process_name"}])
    assert span["ts"] == pytest.approx(800.0) and span["dur"] == pytest.approx(999_900.0)
    assert instant["ts"] == pytest.approx(500_750.0)
    assert meta == {"ph": "M", "name": "process_name"}
    written = alignment.metadata()
    assert written["offset_us"] == 200.0 and written["timestamps_corrected"] is True


# ---- Megatron's schedule: task order, message pairing, timers hook ------------------------------
@pytest.mark.parametrize("P,V,M,group", [(2, 1, 8, None), (4, 1, 6, None), (2, 2, 8, 2),
                                         (4, 2, 8, 4), (2, 3, 5, 2)])
def test_megatron_order_pairs_every_send_with_the_task_it_feeds(P, V, M, group):
    """Megatron pairs messages in program order: the k-th send of a direction on one rank is the
    k-th receive of that direction on the neighbour; it must feed the task named for it there."""
    from megatron_dpp.training.observe.megatron_tracing import MegatronTaskOrder

    graph = TaskGraph(P, V, M)
    orders = [MegatronTaskOrder(graph, rank, group) for rank in range(P)]
    for rank, order in enumerate(orders):
        for phase in (Phase.F, Phase.B):
            steps = order.tasks["steps"][phase]
            assert sorted(steps) == sorted(Task(phase, m, c) for m in range(M) for c in range(V))
            receiver = (rank + (1 if phase is Phase.F else -1)) % P
            for sent, read in zip(order.tasks["sends"][phase],
                                  orders[receiver].tasks["reads"][phase], strict=True):
                assert graph.output_target(rank, sent) == (receiver, read), (rank, sent, read)
        # Each chunk runs its microbatches in order, forwards and backwards alike.
        for phase in (Phase.F, Phase.B):
            for c in range(V):
                ms = [t.microbatch for t in order.tasks["steps"][phase] if t.chunk == c]
                assert ms == list(range(M))


class _FakeTimers:
    def __init__(self):
        self.calls = []

    def __call__(self, name, log_level=None):
        calls = self.calls

        class Timer:
            def start(self, barrier=False):
                calls.append(("start", name, log_level))

            def stop(self, barrier=False):
                calls.append(("stop", name, log_level))

        return Timer()


class _ListRecorder:
    def __init__(self):
        self.tasks, self.marks = [], []

    def task_starts(self):
        return None  # no device clock: host times

    def task_ends(self, device_start):
        return None

    def task(self, name, category, start, end, args, device_span=None):
        self.tasks.append((name, category, start <= end, args))

    def iteration_starts(self, iteration, time, args):
        self.marks.append(f"iteration {iteration}")


def test_schedule_timers_record_steps_and_pass_every_timer_on():
    """forward_step's and backward_step's timers become task spans; every timer call still reaches
    the timers they stand in for."""
    from megatron_dpp.training.observe.megatron_tracing import MegatronScheduleTracer

    recorder = _ListRecorder()
    tracer = MegatronScheduleTracer(recorder, pipeline_rank=1, pipeline_size=2,
                                    microbatch_work=lambda item: len(item), policy="megatron test")
    replaced = _FakeTimers()

    class Config:
        timers = replaced
        microbatch_group_size_per_vp_stage = None

    def schedule(*, data_iterator, model, num_microbatches, forward_only):
        for _ in range(num_microbatches):
            Config.timers("forward-compute", log_level=2).start()
            next(data_iterator)
            Config.timers("forward-compute").stop()
        Config.timers("all-grads-sync", log_level=1).start(barrier=False)
        for _ in range(num_microbatches):
            Config.timers("backward-compute", log_level=2).start()
            Config.timers("backward-compute").stop()
        return "losses"

    result = tracer.run(schedule, Config, {"data_iterator": iter(["ab", "abc"]), "model": object(),
                                           "num_microbatches": 2, "forward_only": False})
    assert result == "losses" and Config.timers is replaced
    assert recorder.marks == ["iteration 0"]
    assert [(name, category, ordered) for name, category, ordered, _ in recorder.tasks] == [
        ("F0.0", "forward", True), ("F1.0", "forward", True),
        ("B0.0", "backward", True), ("B1.0", "backward", True)]
    assert [args["tokens"] for *_, args in recorder.tasks] == [2, 3, 2, 3]
    assert all(args["virtual_stage"] == 1 for *_, args in recorder.tasks)
    assert ("start", "all-grads-sync", 1) in replaced.calls
    assert replaced.calls.count(("start", "backward-compute", 2)) == 2
    assert replaced.calls.count(("stop", "forward-compute", None)) == 2


def test_gradient_sync_span_holds_a_wait_per_finalize_collective():
    """The wrapped finalize_model_grads is one GRADIENT_SYNC span on the step lane; each of Megatron's
    collective timers inside it is a wait on the compute lane within the span; every timer call
    still reaches the timers the stand-in replaced, which are back in place afterwards."""
    from megatron_dpp.trace.recorder import TraceRecorder
    from megatron_dpp.training.observe.step_tracing import StepTracer

    recorder = TraceRecorder(0, "rank 0")
    replaced = _FakeTimers()

    class Config:
        timers = replaced

    def finalize(models, num_tokens, **kwargs):
        for name in ("all-grads-sync", "embedding-grads-all-reduce"):
            Config.timers(name, log_level=1).start(barrier=False)
            Config.timers(name).stop()
        return kwargs["force_all_reduce"]

    wrapped = StepTracer(recorder).traced_finalize(Config, finalize)
    assert wrapped([], None, force_all_reduce="passed on") == "passed on"
    assert Config.timers is replaced
    assert replaced.calls == [("start", "all-grads-sync", 1), ("stop", "all-grads-sync", None),
                              ("start", "embedding-grads-all-reduce", 1),
                              ("stop", "embedding-grads-all-reduce", None)]
    spans = [e for e in recorder.events if e.get("ph") == "X"]
    (sync,) = [e for e in spans if e["cat"] == "step"]
    assert sync["name"] == GRADIENT_SYNC and sync["tid"] == 2
    waits = [e for e in spans if e["cat"] == "idle"]
    assert [e["args"]["reason"] for e in waits] == [
        f"{IN_COLLECTIVE} {FINALIZE_COLLECTIVES['all-grads-sync']}",
        f"{IN_COLLECTIVE} {FINALIZE_COLLECTIVES['embedding-grads-all-reduce']}"]
    for wait in waits:
        assert wait["tid"] == 0
        assert sync["ts"] <= wait["ts"] and wait["ts"] + wait["dur"] <= sync["ts"] + sync["dur"]


def test_gradient_sync_without_timers_of_its_own_and_after_an_error():
    """config.timers None (the DPP runtime's default): the stand-in still sees the collectives; an
    exception inside finalize leaves config.timers as it was and still records the span."""
    from megatron_dpp.trace.recorder import TraceRecorder
    from megatron_dpp.training.observe.step_tracing import StepTracer

    recorder = TraceRecorder(0, "rank 0")

    class Config:
        timers = None

    def finalize():
        Config.timers("all-grads-sync", log_level=1).start()
        Config.timers("all-grads-sync").stop()
        raise RuntimeError("peer lost")

    with pytest.raises(RuntimeError, match="peer lost"):
        StepTracer(recorder).traced_finalize(Config, finalize)()
    assert Config.timers is None
    assert sorted(e["cat"] for e in recorder.events if e.get("ph") == "X") == ["idle", "step"]
