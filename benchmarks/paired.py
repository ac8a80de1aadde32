"""Paired timings of whole training runs: launching the GPT, reading its iteration times, and the
statistics of per-iteration ratios (shared by trace_overhead.py and real_model_bench.py).

Two variants that train with the same seed and data see the same samples in iteration i, so the
ratio of their iteration-i times compares like with like; load from other jobs is spread over both
by alternating their order round by round. The interval of a median is the sign test's (order
statistics, no distribution assumed).
"""
from __future__ import annotations

import math
import os
import re
import signal
import statistics
import subprocess
import sys
from typing import Dict, List, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(REPO, "data", "sample")
ELAPSED_RE = re.compile(r" iteration\s+(\d+)/.*\| elapsed time per iteration \(ms\): ([0-9.]+)")


def ensure_sample_data(timeout: float) -> None:
    if not os.path.isfile(os.path.join(SAMPLE, "sample_text_document.idx")):
        subprocess.run([sys.executable, "-m", "megatron_dpp.data.prepare_sample", "--output-dir",
                        SAMPLE, "--no-progress"], check=True, cwd=REPO, timeout=timeout,
                       stdout=subprocess.DEVNULL)


def sample_data_args() -> List[str]:
    return ["--data-path", os.path.join(SAMPLE, "sample_text_document"),
            "--vocab-file", os.path.join(SAMPLE, "vocab.json"),
            "--merge-file", os.path.join(SAMPLE, "merges.txt"), "--split", "98,2,0"]


def run_gpt(flags: Sequence[str], iterations: int, timeout: float, what: str,
            entry: Sequence[str] = ("-m", "megatron_dpp.pretrain_gpt"), nproc: int = 2) -> List[float]:
    """Train with `flags` under torchrun (`entry`: the module or script each rank runs, with
    --log-interval 1 among the flags) and return the milliseconds of iterations 1..`iterations`, in
    order. A failure or a run past `timeout` seconds raises RuntimeError naming `what`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", *entry, *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               cwd=REPO, env=env, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise RuntimeError(f"the {what} run took more than {timeout:g} s:\n{output[-3000:]}")
    if process.returncode != 0:
        raise RuntimeError(f"the {what} run failed (exit {process.returncode}):\n{output[-3000:]}")
    times = {int(m.group(1)): float(m.group(2)) for m in ELAPSED_RE.finditer(output)}
    if sorted(times) != list(range(1, iterations + 1)):
        raise RuntimeError(f"the {what} run: expected iterations 1..{iterations} in the log, got "
                           f"{sorted(times)}")
    return [times[i] for i in range(1, iterations + 1)]


def median_interval(values: List[float], z: float = 1.96) -> tuple:
    """A ~95% interval for the median: the order statistics n/2 -+ z*sqrt(n)/2 (sign test)."""
    ordered = sorted(values)
    n = len(ordered)
    half_width = z * math.sqrt(n) / 2.0
    low = max(0, int(math.floor(n / 2.0 - half_width)))
    high = min(n - 1, int(math.ceil(n / 2.0 + half_width)) - 1)
    return ordered[low], ordered[high]


def paired_ratios(numerator: List[List[float]], denominator: List[List[float]], skip: int) -> dict:
    """numerator / denominator per (round, iteration), the first `skip` iterations of every run left
    out: the median, quartiles, the median's 95% interval and each round's median."""
    ratios, round_medians = [], []
    for mine, theirs in zip(numerator, denominator):
        pairs = [a / b for a, b in zip(mine[skip:], theirs[skip:])]
        ratios.extend(pairs)
        round_medians.append(statistics.median(pairs))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    low, high = median_interval(ratios)
    return {"median": statistics.median(ratios), "q1": quartiles[0], "q3": quartiles[2],
            "interval_95": [low, high], "pairs": len(ratios), "round_medians": round_medians,
            "ratios": ratios}


def describe(summary: Dict) -> str:
    low, high = summary["interval_95"]
    return (f"median {summary['median']:.3f}  quartiles {summary['q1']:.3f}-{summary['q3']:.3f}  "
            f"95% interval of the median {low:.3f}-{high:.3f}  round medians "
            + " ".join(f"{r:.3f}" for r in summary["round_medians"]))
