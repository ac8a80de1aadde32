"""--profile, --use-pytorch-profiler and --nvtx.

--profile --use-pytorch-profiler on the tiny GPT (pp=2, --use-dpp, beside --trace): every listed
rank writes its torch profile into the run directory the trace uses, for the iterations of the
window. Without processes: the window's arithmetic (Megatron-LM's counting) and a run stopped inside
it. --profile alone (Megatron-LM's nsys capture range): cudaProfilerStart/Stop at the window's
iterations on the listed ranks only, with torch.cuda.cudart replaced by a recorder (on CPU there is
no CUDA runtime; the flag check refuses --profile alone there, tests/test_args_validation.py).
--nvtx: the DPP runtime pushes one NVTX range per task (F, B and W), named like the task, around its
step (torch.cuda.nvtx is replaced by a recorder here: on CPU it has nothing to annotate; the flag
check refuses --nvtx there); for Megatron's own schedules, the same names around each forward and
backward step; the trainer a range around the gradient sync and one around the optimizer step."""
import argparse
import json
import threading
from types import SimpleNamespace

import pytest
import torch

from _runtime_harness import run_pipeline
from _train_util import run_training
from megatron_dpp.trace.recorder import GRADIENT_SYNC, OPTIMIZER_STEP
from megatron_dpp.training.observe.profiler_window import (
    NSYS_COMMAND,
    NsysCaptureRange,
    TorchProfilerWindow,
    make_profiler,
)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_profile_writes_a_torch_trace_per_listed_rank_beside_the_trace(tmp_path):
    rc, losses, _, out = run_training(
        ["--pipeline-model-parallel-size", "2", "--use-dpp", "--variable-seq-lengths",
         "--train-iters", "4", "--trace", "--trace-dir", str(tmp_path), "--profile",
         "--use-pytorch-profiler", "--profile-step-start", "1", "--profile-step-end", "3", "--profile-ranks", "0", "1"],
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
    profiler = TorchProfilerWindow(start=1, end=3, path=str(path))
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
    profiler = TorchProfilerWindow(start=0, end=10, path=str(path))
    profiler.iteration_starts(0)
    torch.ones(8, 8) @ torch.ones(8, 8)
    profiler.iteration_ended(1)
    assert not path.exists()
    profiler.close()  # Trainer.close on a stop signal
    assert profiler.profiled == 1 and json.loads(path.read_text())["traceEvents"]


class _FakeCudart:
    """torch.cuda.cudart() on CPU: notes each call, returns cudaSuccess (0)."""

    def __init__(self, calls, when):
        self.calls, self.when = calls, when

    def cudaProfilerStart(self):
        self.calls.append(("start", self.when()))
        return 0

    def cudaProfilerStop(self):
        self.calls.append(("stop", self.when()))
        return 0


def _check_success(result):
    """torch.cuda.check_error's stand-in: cudaSuccess only."""
    assert result == 0, result


def _no_cudart():
    raise AssertionError("torch.cuda.cudart() called for torch.profiler")


def _profile_args(**overrides):
    args = dict(profile=True, use_pytorch_profiler=False, profile_step_start=2,
                profile_step_end=4, profile_ranks=[1, 3])
    return argparse.Namespace(**{**args, **overrides})


def _train(profiler, iterations, ran):
    """The trainer's calls around each training step (training/step.py's train_step)."""
    for iteration in range(iterations):
        if profiler is not None:
            profiler.iteration_starts(iteration)
        ran.append(iteration)
        if profiler is not None:
            profiler.iteration_ended(iteration + 1)
    if profiler is not None:
        profiler.close()


def test_profile_opens_the_nsys_capture_range_on_listed_ranks_only(monkeypatch, capsys):
    """--profile --profile-step-start 2 --profile-step-end 4 --profile-ranks 1 3 on 4 ranks:
    cudaProfilerStart as iteration 2 (the third) starts, cudaProfilerStop once iteration 3 ended,
    on ranks 1 and 3 only, as Megatron-LM."""
    calls = {}
    monkeypatch.setattr(torch.cuda, "check_error", _check_success)
    for rank in range(4):
        ran = []
        monkeypatch.setattr(torch.cuda, "cudart",
                            lambda: _FakeCudart(calls.setdefault(rank, []), lambda: len(ran)))
        profiler = make_profiler(_profile_args(), rank, run_directory=None)
        assert (profiler is not None) == (rank in (1, 3))
        assert profiler is None or isinstance(profiler, NsysCaptureRange)
        _train(profiler, 6, ran)
    # (call, training steps run before it): start before step 2 runs, stop after step 3 ran.
    assert calls == {1: [("start", 2), ("stop", 4)], 3: [("start", 2), ("stop", 4)]}
    out = capsys.readouterr().out
    assert out.count(f"nsys capture range opened (cudaProfilerStart) at iteration 3, for "
                     f"`{NSYS_COMMAND}`") == 2, out
    assert out.count("nsys capture range closed (cudaProfilerStop) after 2 iteration(s) (from "
                     "[2, 4))") == 2, out


def test_capture_range_closes_when_a_run_stops_inside_it(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "check_error", _check_success)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _FakeCudart(calls, lambda: None))
    capture = NsysCaptureRange(start=0, end=10, rank=0)
    capture.iteration_starts(0)
    capture.iteration_ended(1)
    assert [call for call, _ in calls] == ["start"]
    capture.close()  # Trainer.close on a stop signal
    capture.close()  # closed once
    assert [call for call, _ in calls] == ["start", "stop"]


def test_use_pytorch_profiler_selects_torch_profiler(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "cudart", _no_cudart)
    profiler = make_profiler(_profile_args(use_pytorch_profiler=True), 3, str(tmp_path))
    assert isinstance(profiler, TorchProfilerWindow)
    assert profiler.path == str(tmp_path / "profile-rank3.json")
    _train(profiler, 5, [])
    assert json.loads((tmp_path / "profile-rank3.json").read_text())["traceEvents"]


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

    for split_backward, phases in ((False, "FB"), (True, "FBW")):
        calls.clear()
        result = run_pipeline(2, 1, [5, 9, 3, 7], "dpp:adaptive", split_backward=split_backward,
                              rank_fn=run_with_nvtx)
        assert not result.errors, result.errors
        assert sorted(calls) == ["harness-rank-0", "harness-rank-1"]
        for thread, sequence in calls.items():
            pushes = [name for kind, name in sequence[0::2]]
            assert [kind for kind, _ in sequence] == ["push", "pop"] * 4 * len(phases), \
                (thread, sequence)
            assert sorted(pushes) == sorted(f"{p}{m}.0" for p in phases for m in range(4)), pushes


def test_nvtx_range_around_every_megatron_step_named_like_its_task(monkeypatch):
    """Megatron's schedule, not traced (no recorder): its forward_step/backward_step timers push
    and pop one range each, named like the task the k-th step of each phase is (1F1B order)."""
    from megatron_dpp.training.observe.megatron_tracing import MegatronScheduleTracer

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


def test_nvtx_range_around_gradient_sync_and_optimizer_step(monkeypatch):
    """The trainer's --nvtx ranges beside the schedule's: GRADIENT_SYNC around
    config.finalize_model_grads_func (which the DPP runtime and Megatron's schedules both call),
    OPTIMIZER_STEP around the optimizer's step (Trainer.traced_step)."""
    from megatron_dpp.training.setup import nvtx_around_gradient_sync as _nvtx_around_gradient_sync
    from megatron_dpp.training.step import Trainer

    calls = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop", None)))
    config = SimpleNamespace(finalize_model_grads_func=lambda *a, **k: calls.append(("sync", a)))
    _nvtx_around_gradient_sync(config)
    config.finalize_model_grads_func(["model"], num_tokens=3)
    trainer = SimpleNamespace(args=argparse.Namespace(nvtx=True), step_tracer=None)
    with Trainer.traced_step(trainer, OPTIMIZER_STEP):
        calls.append(("step", None))
    assert calls == [("push", GRADIENT_SYNC), ("sync", (["model"],)), ("pop", None),
                     ("push", OPTIMIZER_STEP), ("step", None), ("pop", None)]
    calls.clear()
    with Trainer.traced_step(SimpleNamespace(args=argparse.Namespace(nvtx=False), step_tracer=None),
                             OPTIMIZER_STEP):
        calls.append(("step", None))
    assert calls == [("step", None)]
