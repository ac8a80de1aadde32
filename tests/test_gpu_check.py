"""run_scripts/gpu_check.sh on the CPU: without a GPU one line and exit 0; --help; bad flags one
line, exit 2, before anything runs. Its table (run_scripts/_gpu_check_report.py) from a real CPU
training log, a real anchor JSON (--device cpu --quick) and a transport JSON as
benchmarks/transport_bench_cuda.py writes it: tokens/s, the ratio to the anchor, failed steps, IPC
figures with a refused size."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from _train_util import REPO_ROOT, TINY_GPT_ARGS, _env, run_training

SCRIPT = str(REPO_ROOT / "run_scripts" / "gpu_check.sh")
REPORT = str(REPO_ROOT / "run_scripts" / "_gpu_check_report.py")
SEQ = int(TINY_GPT_ARGS[TINY_GPT_ARGS.index("--seq-length") + 1])


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=100,
                          env=_env(), cwd=REPO_ROOT)


@pytest.mark.timeout(120)
def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(tmp_path):
    result = _script("--output-dir", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("gpu_check: no CUDA GPU here (torch.cuda.is_available() is "
                                     "False); nothing to check")
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(60)
def test_help_explains_every_flag():
    result = _script("--help")
    assert result.returncode == 0
    for flag in ("--output-dir", "--train-iters", "--gpt-global-batch-size",
                 "--bert-global-batch-size", "--anchor-steps", "--step-timeout", "--skip-tests",
                 "--skip-mps", "--whole-suite", "--test-workers", "--pipeline", "--pipeline-layers",
                 "--pipeline-hidden-size", "--pipeline-seq-length", "--pipeline-iters",
                 "--pipeline-v-policy", "--dry-run", "--help"):
        assert flag in result.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,message", [
    (["--bogus"], "unknown argument --bogus (see --help)"),
    (["--train-iters", "x"], "--train-iters x: expected a positive whole number"),
    (["--train-iters", "5"], "--train-iters 5: expected at least 10"),
    (["--anchor-steps", "0"], "--anchor-steps 0: expected a positive whole number"),
    (["--output-dir"], "--output-dir needs a value (see --help)"),
    (["--step-timeout", "-1"], "--step-timeout -1: expected a positive whole number"),
    (["--gpt-global-batch-size", "30"], "expected a multiple of the micro-batch, 4"),
    (["--test-workers", "0"], "--test-workers 0: expected a positive whole number"),
    (["--skip-tests", "--whole-suite"], "--skip-tests leaves the tests out"),
    (["--skip-tests", "--test-workers", "4"], "--skip-tests leaves the tests out"),
    (["--dry-run"], "--dry-run prints the pipeline runs; add --pipeline"),
    (["--pipeline", "--pipeline-layers", "12"], "--pipeline-layers 12: expected a multiple of 8"),
    (["--pipeline", "--pipeline-hidden-size", "100"], "expected a multiple of 64 (heads of 64)"),
    (["--pipeline", "--pipeline-iters", "5"], "--pipeline-iters 5: expected at least 6"),
    (["--pipeline", "--pipeline-v-policy", "a b"], "expected a --dpp-policy name"),
])
def test_bad_flags_are_one_line_exit_2(args, message):
    result = _script(*args)
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr


@pytest.mark.timeout(60)
def test_test_workers_need_pytest_xdist(tmp_path):
    """Refused in one line, before anything runs, where the environment lacks pytest-xdist (a
    virtual environment made here without it: the check asks the script's own interpreter)."""
    import venv

    bare = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(bare)
    result = subprocess.run(["bash", SCRIPT, "--test-workers", "4"], capture_output=True, text=True,
                            timeout=60, env={**_env(), "DPP_VENV": str(bare)}, cwd=REPO_ROOT)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == (f"gpu_check: --test-workers 4 needs pytest-xdist in {bare} "
                                     f"(pip install pytest-xdist)")


def _transport_json() -> dict:
    def row(transport, size, us, refused=None):
        return {"transport": transport, "bytes": size, "one_way_us_p50": us, "one_way_us_mean": us,
                "gbps": None if us is None else size / us / 1e3, "refused": refused}

    return {"device": "cuda", "gpu": "GPU", "gpus": 1, "skipped": {"nccl": "needs 2 GPUs"},
            "config": {"sizes": [4096, 1 << 28]},
            "results": [row("shm", 4096, 270.0), row("shm-host", 4096, 22.5), row("shm", 1 << 28, None, "exceeds the slot"),
                        row("d2d", 4096, 11.0), row("d2d", 1 << 28, 182.0), row("events", 4096, 250.0)]}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_report_table_from_real_logs(tmp_path):
    rc, losses, _, log = run_training(["--pipeline-model-parallel-size", "1", "--train-iters", "12",
                                       "--log-interval", "2"], nproc=1, timeout=240)
    assert rc == 0 and losses[-1] < losses[0], log[-3000:]
    assert "memory (MB)" not in log  # Megatron-LM's memory line is a GPU rank's
    (tmp_path / "gpt.log").write_text(log)
    (tmp_path / "gpt_fused.log").write_text(re.sub(  # every time 1000 ms longer: slower
        r"elapsed time per iteration \(ms\): ([0-9.]+)",
        lambda m: f"elapsed time per iteration (ms): {float(m.group(1)) + 1000:.3f}", log))
    memory = ("[Rank 0] (after 2 iterations) memory (MB) | allocated: 1800.5 | max allocated: "
              "2560.0 | reserved: 3000.0 | max reserved: 3000.0\n")  # as a GPU rank prints it
    (tmp_path / "gpt_graphs.log").write_text(memory + re.sub(  # every time a tenth: faster
        r"elapsed time per iteration \(ms\): ([0-9.]+)",
        lambda m: f"elapsed time per iteration (ms): {float(m.group(1)) / 10:.3f}", log))
    (tmp_path / "bert.log").write_text("Traceback ...\nRuntimeError: out of memory\n")
    anchor = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "gpu_speed_anchor.py"),
                             "--device", "cpu", "--quick", "--json", str(tmp_path / "anchor_sdpa.json")],
                            capture_output=True, text=True, timeout=110, env=_env())
    assert anchor.returncode == 0, anchor.stderr
    (tmp_path / "anchor.log").write_text(anchor.stdout)
    (tmp_path / "transport.log").write_text("")
    (tmp_path / "transport_cuda.json").write_text(json.dumps(_transport_json()))
    under_mps = _transport_json()
    under_mps["results"][0]["one_way_us_p50"] = 23.9  # shm at 4 KiB
    (tmp_path / "transport_cuda_mps.json").write_text(json.dumps(under_mps))
    (tmp_path / "transport_mps.log").write_text("")
    (tmp_path / "steps.tsv").write_text("gpt\t0\tgpt.log\t30\ngpt-fused\t0\tgpt_fused.log\t30\n"
                                        "gpt-graphs\t0\tgpt_graphs.log\t30\n"
                                        "bert\t1\tbert.log\t5\n"
                                        "anchor\t0\tanchor.log\t9\ntransport\t0\ttransport.log\t4\n"
                                        "transport-mps\t0\ttransport_mps.log\t4\n"
                                        "anchor-unfused\t124\tanchor_unfused.log\t600\n")
    (tmp_path / "anchor_unfused.log").write_text("")  # stopped by --step-timeout before a line
    result = subprocess.run([sys.executable, REPORT, str(tmp_path), "--gpt-seq-length", str(SEQ),
                             "--bert-seq-length", "512"], capture_output=True, text=True,
                            timeout=60, env=_env())
    assert result.returncode == 1, result.stdout + result.stderr  # the BERT step failed
    summary = json.loads((tmp_path / "summary.json").read_text())
    steps = {step["name"]: step for step in summary["steps"]}
    assert steps["gpt"]["passed"] and not steps["bert"]["passed"]
    assert steps["bert"]["detail"] == "RuntimeError: out of memory"
    assert not steps["anchor-unfused"]["passed"]
    assert steps["anchor-unfused"]["detail"] == "timed out after 600 s"
    gpt = steps["gpt"]
    assert gpt["first_loss"] == pytest.approx(losses[0], rel=1e-6)
    assert gpt["last_loss"] == pytest.approx(losses[-1], rel=1e-6)
    assert gpt["tokens_per_s"] == pytest.approx(8 * SEQ / (gpt["ms_per_iteration"] / 1e3))
    anchor_rate = json.loads((tmp_path / "anchor_sdpa.json").read_text())["tokens_per_s"]
    assert summary["gpt_vs_anchor"] == pytest.approx(gpt["tokens_per_s"] / anchor_rate)
    fused = steps["gpt-fused"]  # the same log, every time 1000 ms longer: read as its own
    assert fused["passed"] and fused["ms_per_iteration"] > gpt["ms_per_iteration"] + 999
    assert summary["gpt_fused_vs_anchor"] == pytest.approx(fused["tokens_per_s"] / anchor_rate)
    graphs = steps["gpt-graphs"]
    assert graphs["passed"] and graphs["max_allocated_mb"] == 2560.0
    assert graphs["detail"].endswith(", peak 2.5 GiB allocated") and gpt["max_allocated_mb"] is None
    assert graphs["ms_per_iteration"] == pytest.approx(gpt["ms_per_iteration"] / 10, rel=1e-3)
    assert summary["gpt_graphs_vs_anchor"] == pytest.approx(graphs["tokens_per_s"] / anchor_rate)
    lines = result.stdout.splitlines()
    assert f"our GPT with CUDA graphs / SDPA anchor: {summary['gpt_graphs_vs_anchor']:.2f}x" in lines
    assert any(line.startswith("gpt ") and "pass" in line and "tokens/s" in line for line in lines)
    assert any(line.startswith("bert ") and "FAIL" in line for line in lines)
    assert any(line.startswith("our GPT / SDPA anchor: ") and "target 0.8x" in line for line in lines)
    assert f"our GPT with the compiled fusions / SDPA anchor: {summary['gpt_fused_vs_anchor']:.2f}x" in lines
    assert "4096 B one-way: shm 270.0 us, host side 22.5 us, device copy 11.0 us, bare event hand-over 250.0 us" in result.stdout
    assert "268435456 B one-way: shm refused (slot too small), device copy 182.0 us" in result.stdout
    assert "nccl: skipped: needs 2 GPUs" in result.stdout
    ipc, mps = result.stdout.split("CUDA IPC under MPS (the two processes share the GPU without "
                                   "switching):")
    assert "4096 B one-way: shm 270.0 us" in ipc and "4096 B one-way: shm 23.9 us" in mps
    assert steps["transport-mps"]["passed"] and steps["transport-mps"]["detail"] == "CUDA IPC figures below"


@pytest.mark.timeout(200)
def test_report_gives_what_a_new_sequence_length_costs_each_attention_backend(tmp_path):
    """The attention-shapes step's JSON, written by benchmarks/sdpa_shapes.py itself (on the CPU)."""
    bench = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "sdpa_shapes.py"),
                            "--device", "cpu", "--quick", "--json", str(tmp_path / "sdpa_shapes.json")],
                           capture_output=True, text=True, timeout=120, env=_env())
    assert bench.returncode == 0, bench.stderr
    (tmp_path / "attention_shapes.log").write_text(bench.stdout)
    (tmp_path / "steps.tsv").write_text("attention-shapes\t0\tattention_shapes.log\t3\n")
    result = subprocess.run([sys.executable, REPORT, str(tmp_path), "--gpt-seq-length", str(SEQ),
                             "--bert-seq-length", "512"], capture_output=True, text=True,
                            timeout=60, env=_env())
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"][0]["detail"] == "SDPA figures below"
    assert summary["attention_shapes"]["default_backend"] == "math"
    lines = result.stdout.split("SDPA forward+backward at length 32 repeated / a new length each "
                                "call (torch's choice here: math):\n")[1].splitlines()
    assert [line.split(":")[0].strip() for line in lines] == [
        "default", "cudnn", "flash", "efficient", "math"]
    math_row = next(row for row in summary["attention_shapes"]["results"] if row["backend"] == "math")
    assert lines[4] == (f"  math: {math_row['repeated_ms']:.2f} / {math_row['fresh_ms']:.2f} ms "
                        f"(a new shape {math_row['new_shape_ms']:+.2f} ms)")
    assert lines[1].startswith("  cudnn: unavailable: ")


def test_memory_report_is_megatron_lms_line():
    from megatron_dpp.training.loop import memory_report

    class FakeCuda:  # the caching allocator's counters, in bytes
        memory_allocated = staticmethod(lambda: 3 << 20)
        max_memory_allocated = staticmethod(lambda: 5 << 20)
        memory_reserved = staticmethod(lambda: 8 << 20)
        max_memory_reserved = staticmethod(lambda: 9 << 19)

    line = memory_report(FakeCuda, rank=3, iteration=10)
    assert line == ("[Rank 3] (after 10 iterations) memory (MB) | allocated: 3.0 | max allocated: "
                    "5.0 | reserved: 8.0 | max reserved: 4.5")

