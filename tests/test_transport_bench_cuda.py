"""benchmarks/transport_bench.py --device cuda on a CPU machine: one line saying there is no GPU,
exit 0, nothing written; its flags checked first (one line, exit 2); and its table (refused sizes,
skipped NCCL) from a document as transport_bench_cuda.run returns it. The measurement itself needs
a GPU: run_scripts/gpu_check.sh runs it there."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from _train_util import REPO_ROOT, _env, main_in_process

BENCH = str(REPO_ROOT / "benchmarks" / "transport_bench.py")
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

import transport_bench  # noqa: E402
import transport_bench_cuda  # noqa: E402


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True,
                          timeout=60, env=_env(), cwd=REPO_ROOT)


def _run_here(*args: str) -> subprocess.CompletedProcess:
    """transport_bench.main in this process (a process of its own spends 2 s importing torch)."""
    return main_in_process(transport_bench.main, args)


@pytest.mark.timeout(60)
def test_without_a_gpu_one_line_and_exit_0(tmp_path):
    result = _run("--device", "cuda", "--json", str(tmp_path / "t.json"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("transport_bench: --device cuda: no CUDA GPU here "
                                     "(torch.cuda.is_available() is False); nothing measured")
    assert not (tmp_path / "t.json").exists()


BAD_FLAGS = [
    (["--device", "cuda", "--transports", "shm,gloo"], "unknown ['gloo']; pick from shm,shm-host,d2d,events,nccl"),
    (["--device", "fake-cuda", "--transports", "nccl"], "unknown ['nccl']; pick from shm,shm-host,d2d"),
    (["--slot-bytes", "1MiB"], "--slot-bytes is for --device cuda"),
    (["--device", "cuda", "--slot-bytes", "1"], "--slot-bytes is for --device cuda, at least 4096"),
    (["--device", "cuda", "--cross-namespace"], "drop --device cuda"),
    (["--device", "gpu"], "invalid choice: 'gpu'"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,message", BAD_FLAGS)
def test_bad_flags_are_refused_before_anything_runs(args, message):
    # The first case through the command (its exit code and output as a process's), the others
    # in this process.
    result = _run(*args) if args == BAD_FLAGS[0][0] else _run_here(*args)
    assert result.returncode == 2 and message in result.stderr
    assert result.stdout == ""


def test_table_shows_refused_sizes_and_skipped_nccl(capsys):
    def row(transport, size, us, refused=None):
        return {"transport": transport, "bytes": size, "one_way_us_p50": us, "one_way_us_mean": us,
                "gbps": None, "refused": refused}

    transport_bench_cuda.print_table({
        "gpu": "H100", "gpus": 1, "skipped": {"nccl": "needs 2 GPUs (NCCL runs one rank per GPU); 1 here"},
        "config": {"sizes": [4096, 1 << 28]},
        "results": [row("shm", 4096, 270.0), row("d2d", 4096, 10.0), row("d2d", 1 << 28, 182.0),
                    row("events", 4096, 250.0),
                    row("shm", 1 << 28, None, "message of 268435456 B exceeds the slot size")]})
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split() == ["4096", "270.0", "-", "10.0", "27.0", "250.0", "-"]
    assert lines[3].split() == ["268435456", "refused", "-", "182.0", "-", "-", "-"]
    assert "shm refused 268435456 B: message of 268435456 B exceeds the slot size" in lines
    assert "nccl: skipped: needs 2 GPUs (NCCL runs one rank per GPU); 1 here" in lines


@pytest.mark.timeout(180)
def test_fake_cuda_quick_mode_runs_the_protocol_on_cpu(tmp_path):
    """--device fake-cuda: the CUDA IPC protocol between two processes through the fake runtime,
    every message direct, the round trip checked; its JSON has the rows the table shows."""
    out = tmp_path / "fake.json"
    result = subprocess.run([sys.executable, BENCH, "--device", "fake-cuda", "--quick",
                             "--latency-iters", "10", "--json", str(out)],
                            capture_output=True, text=True, timeout=170, env=_env(), cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    document = json.loads(out.read_text())
    assert document["device"] == "fake-cuda" and document["gpu"] == "fake CUDA runtime on CPU"
    rows = {(row["transport"], row["bytes"]) for row in document["results"]}
    assert rows == {(name, size) for name in ("shm", "shm-host", "d2d") for size in (4096, 1 << 20)}
    counts = document["message_counts"]
    assert counts["sent_device_direct"] > 0 and counts["sent_device_staged"] == 0
    assert "paths (rank 0): sent" in result.stdout


def _shm_sizes_worker(rank, world, store, sizes, slot_bytes):
    import shm_tensor

    ctx = shm_tensor.create_context_with_store(
        store, rank=rank, world_size=world, peers=[1 - rank],
        config=shm_tensor.ShmConfig(slot_bytes=slot_bytes, timeout_s=30))
    rows = [transport_bench_cuda._shm_size(ctx, store, rank, size, 5, index << 20, device="cpu",
                                           sync_each=True)
            for index, size in enumerate(sizes)]
    shm_tensor.context.store_barrier(store, "done", world, timeout_s=30)
    ctx.close()
    return rows


@pytest.mark.timeout(120)
def test_a_size_above_the_slot_is_a_refused_row_and_the_next_size_still_runs(tmp_path):
    """The benchmark's ping-pong and its refusal handshake, with CPU tensors through shm_tensor."""
    from _shm_util import run_ranks

    sizes = [4096, 256 * 1024, 8192]
    results = run_ranks(_shm_sizes_worker, 2, tmp_path, sizes, 64 * 1024, timeout_s=100)
    assert results[1] == [None, None, None]
    small, refused, after = results[0]
    assert refused["refused"] and "exceeds the slot size of 65536 B" in refused["refused"]
    assert refused["bytes"] == 256 * 1024 and refused["one_way_us_p50"] is None
    for row, size in ((small, 4096), (after, 8192)):
        assert row["transport"] == "shm" and row["bytes"] == size and row["refused"] is None
        assert 0 < row["one_way_us_p50"] and 0 < row["one_way_us_mean"]
