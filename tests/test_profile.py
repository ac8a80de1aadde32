"""--profile and --nvtx.

--profile on the tiny GPT (pp=2, --use-dpp, beside --trace): every listed rank writes its torch
profile into the run directory the trace uses, for the iterations of the window. Without processes:
the window's arithmetic (Megatron-LM's counting) and a run stopped inside it. --nvtx: the DPP
runtime pushes one NVTX range per task, named like the task, around its step (torch.cuda.nvtx is
replaced by a recorder here: on CPU it has nothing to annotate; the flag check refuses --nvtx there,
tests/test_args_validation.py); for Megatron's own schedules, the same names around each forward and
backward step."""
import json
import threading

import pytest
import torch

from _runtime_harness import run_pipeline
from _train_util import run_training
from megatron_dpp.training.profiling import IterationProfiler


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_profile_writes_a_torch_trace_per_listed_rank_beside_the_trace(tmp_path):
    rc, losses, _, out = run_training(
        ["--pipeline-model-parallel-size", "2", "--use-dpp", "--variable-seq-lengths",
         "--train-iters", "4", "--trace", "--trace-dir", str(tmp_path), "--profile",
         "--profile-step-start", "1", "--profile-step-end", "3", "--profile-ranks", "0", "1"],
        nproc=2, timeout=240)
    assert rc == 0, out[-3000:]
    assert len(losses) == 4, out[-3000:]
    runs = list(tmp_path.iterdir())
    assert len(runs) == 1 and runs[0].name.endswith("-pp2-dpp"), runs
    names = sorted(path.name for path in runs[0].iterdir())
    assert names == ["benchmark-rank0.json", "benchmark-rank1.json", "profile-rank0.json",
                     "profile-rank1.json"], names
    for rank in (0, 1):
        events = json.loads((runs[0] / f"profile-rank{rank}.json").read_text())["traceEvents"]
        ops = {e["name"] for e in events if e.get("cat") == "cpu_op"}
        assert "aten::mm" in ops or "aten::addmm" in ops, sorted(ops)[:40]
        assert out.count(f"profile of 2 iteration(s) (from [1, 3)) written to "
                         f"{runs[0] / f'profile-rank{rank}.json'}") == 1, out[-3000:]


def test_window_counts_completed_iterations_like_megatron(tmp_path):
    path = tmp_path / "profile.json"
    profiler = IterationProfiler(start=1, end=3, path=str(path))
    active = []
    for iteration in range(5):  # the trainer's calls: iterations completed before and after
        profiler.iteration_starts(iteration)
        active.append(profiler.profiler is not None)
        torch.ones(8, 8) @ torch.ones(8, 8)
        profiler.iteration_ended(iteration + 1)
    profiler.close()  # after the window: nothing more to do
    assert active == [False, True, True, False, False]
    assert profiler.profiled == 2
    assert json.loads(path.read_text())["traceEvents"]


def test_run_stopped_inside_the_window_writes_what_it_has(tmp_path):
    path = tmp_path / "profile.json"
    profiler = IterationProfiler(start=0, end=10, path=str(path))
    profiler.iteration_starts(0)
    torch.ones(8, 8) @ torch.ones(8, 8)
    profiler.iteration_ended(1)
    assert not path.exists()
    profiler.close()  # Trainer.close on a stop signal
    assert profiler.profiled == 1 and json.loads(path.read_text())["traceEvents"]


def test_nvtx_range_around_every_task_named_like_it(monkeypatch):
    calls = {}  # harness thread -> ("push", name) / ("pop", None) in order
    lock = threading.Lock()

    def note(kind, name=None):
        with lock:
            calls.setdefault(threading.current_thread().name, []).append((kind, name))

    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: note("push", name))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: note("pop"))

    def run_with_nvtx(_rank, runner):
        runner.session.nvtx = True
        runner.run()

    result = run_pipeline(2, 1, [5, 9, 3, 7], "dpp:adaptive", rank_fn=run_with_nvtx)
    assert not result.errors, result.errors
    assert sorted(calls) == ["harness-rank-0", "harness-rank-1"]
    for thread, sequence in calls.items():
        pushes = [name for kind, name in sequence[0::2]]
        assert [kind for kind, _ in sequence] == ["push", "pop"] * 8, (thread, sequence)
        assert sorted(pushes) == sorted(f"{p}{m}.0" for p in "FB" for m in range(4)), pushes


def test_nvtx_range_around_every_megatron_step_named_like_its_task(monkeypatch):
    """Megatron's schedule, not traced (no recorder): its forward_step/backward_step timers push
    and pop one range each, named like the task the k-th step of each phase is (1F1B order)."""
    from megatron_dpp.training.megatron_tracing import MegatronScheduleTracer

    calls = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop", None)))
    tracer = MegatronScheduleTracer(None, pipeline_rank=0, pipeline_size=2, microbatch_work=len,
                                    policy="megatron 1f1b", nvtx=True)

    class Config:
        timers = None
        microbatch_group_size_per_vp_stage = None

    def schedule(*, data_iterator, model, num_microbatches, forward_only):
        for phase in ("forward", "forward", "backward", "forward", "backward", "backward"):
            Config.timers(f"{phase}-compute", log_level=2).start()
            Config.timers(f"{phase}-compute").stop()

    tracer.run(schedule, Config, {"data_iterator": iter([]), "model": object(), "num_microbatches": 3,
                                  "forward_only": False})
    assert Config.timers is None
    assert calls == [(kind, name) for task in ["F0.0", "F1.0", "B0.0", "F2.0", "B1.0", "B2.0"]
                     for kind, name in (("push", task), ("pop", None))]
