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
from typing import Dict, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(REPO, "data", "sample")
# torchrun entries that pin each rank to a core of its own, then run megatron_dpp.pretrain_gpt; the
# second also times the trace recorder's methods (recording_time_rank.py).
PINNED_ENTRY = (os.path.join(REPO, "benchmarks", "pinned_rank.py"),)
RECORDING_TIME_ENTRY = (os.path.join(REPO, "benchmarks", "recording_time_rank.py"),)
ELAPSED_RE = re.compile(r" iteration\s+(\d+)/.*\| elapsed time per iteration \(ms\): ([0-9.]+)")
# The loss's tokens per second of an iteration (training/loop.py): padding and masked tokens left out.
TOKENS_RE = re.compile(r" iteration\s+(\d+)/.*\| tokens/s: ([0-9.]+)")


def ensure_sample_data(timeout: float) -> None:
    if not os.path.isfile(os.path.join(SAMPLE, "sample_text_document.idx")):
        subprocess.run([sys.executable, "-m", "megatron_dpp.data.prepare_sample", "--output-dir",
                        SAMPLE, "--no-progress"], check=True, cwd=REPO, timeout=timeout,
                       stdout=subprocess.DEVNULL)


def sample_data_args(data_prefix: Optional[str] = None) -> List[str]:
    """The data flags of the sample corpus, or of another dataset made with its tokenizer
    (`data_prefix`, e.g. long_tailed_corpus.py's)."""
    return ["--data-path", data_prefix or os.path.join(SAMPLE, "sample_text_document"),
            "--vocab-file", os.path.join(SAMPLE, "vocab.json"),
            "--merge-file", os.path.join(SAMPLE, "merges.txt"), "--split", "98,2,0"]


def run_gpt(flags: Sequence[str], iterations: int, timeout: float, what: str,
            entry: Sequence[str] = ("-m", "megatron_dpp.pretrain_gpt"), nproc: int = 2) -> List[float]:
    """Train with `flags` under torchrun (`entry`: the module or script each rank runs, with
    --log-interval 1 among the flags) and return the milliseconds of iterations 1..`iterations`, in
    order. A failure or a run past `timeout` seconds raises RuntimeError naming `what`."""
    return run_gpt_with_output(flags, iterations, timeout, what, entry, nproc)[0]


def run_gpt_with_output(flags: Sequence[str], iterations: int, timeout: float, what: str,
                        entry: Sequence[str] = ("-m", "megatron_dpp.pretrain_gpt"),
                        nproc: int = 2, extra_env: Optional[Dict[str, str]] = None
                        ) -> Tuple[List[float], str]:
    """run_gpt's iteration times, and the run's whole output (stdout and stderr). `extra_env`:
    variables set for the ranks on top of this process's environment."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", *entry, *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               **(extra_env or {}))
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
    return [times[i] for i in range(1, iterations + 1)], output


def tokens_per_s(output: str, iterations: int) -> List[float]:
    """The tokens/s of iterations 1..`iterations` in a run's log, in order."""
    rates = {int(m.group(1)): float(m.group(2)) for m in TOKENS_RE.finditer(output)}
    if sorted(rates) != list(range(1, iterations + 1)):
        raise RuntimeError(f"expected tokens/s of iterations 1..{iterations} in the log, got "
                           f"{sorted(rates)}")
    return [rates[i] for i in range(1, iterations + 1)]


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
    out: the median, quartiles, the median's 95% interval, each round's median, and the 95% interval
    of the median over round medians (iterations of one run are not independent: a run that landed
    badly is slow throughout, so the rounds are the honest sample size)."""
    ratios, round_medians = [], []
    for mine, theirs in zip(numerator, denominator):
        pairs = [a / b for a, b in zip(mine[skip:], theirs[skip:])]
        ratios.extend(pairs)
        round_medians.append(statistics.median(pairs))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    low, high = median_interval(ratios)
    rounds_low, rounds_high = median_interval(round_medians)
    return {"median": statistics.median(ratios), "q1": quartiles[0], "q3": quartiles[2],
            "interval_95": [low, high], "pairs": len(ratios), "round_medians": round_medians,
            "median_of_rounds": statistics.median(round_medians),
            "rounds_interval_95": [rounds_low, rounds_high], "ratios": ratios}


def describe(summary: Dict) -> str:
    low, high = summary["interval_95"]
    return (f"median {summary['median']:.3f}  quartiles {summary['q1']:.3f}-{summary['q3']:.3f}  "
            f"95% interval of the median {low:.3f}-{high:.3f}  round medians "
            + " ".join(f"{r:.3f}" for r in summary["round_medians"])
            + f"  (median of rounds {summary['median_of_rounds']:.3f}, 95% interval over rounds "
              f"{summary['rounds_interval_95'][0]:.3f}-{summary['rounds_interval_95'][1]:.3f})")
