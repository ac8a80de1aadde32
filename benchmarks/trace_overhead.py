"""What --trace costs: the tiny GPT (pp=2, --use-dpp, --variable-seq-lengths) with and without it.

The two variants run in rounds, one run of each per round, the order alternating from round to
round (so load from other jobs, and whatever the first run of a round pays, hits both alike). Both
use the same seed and data, so iteration i of one sees the samples of iteration i of the other: the
comparison is per iteration, traced time / untraced time of the same round, leaving out the first
--skip iterations (warm-up). The report: the median ratio, its quartiles, a 95% interval for the
median (order statistics, no distribution assumed) and each round's median ratio. The issue's
target is a median ratio of at most 1.02; this script reports, it does not judge.

    python benchmarks/trace_overhead.py --json runs/trace_overhead.json
    python benchmarks/trace_overhead.py --quick
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Dict, List

from paired import describe, ensure_sample_data, paired_ratios, run_gpt, sample_data_args

TRACED, UNTRACED = "traced", "untraced"
TARGET_RATIO = 1.02


def gpt_args(args: argparse.Namespace) -> List[str]:
    return [*sample_data_args(),
            "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length),
            "--micro-batch-size", "1", "--global-batch-size", str(args.microbatches),
            "--train-iters", str(args.iters), "--lr", "1e-3", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--seed", "1234", "--log-interval", "1", "--eval-iters", "0",
            "--pipeline-model-parallel-size", "2", "--use-dpp", "--variable-seq-lengths"]


def run_once(args: argparse.Namespace, traced: bool, trace_dir: str) -> List[float]:
    """Milliseconds of iterations 1..--iters of one run, in order."""
    extra = ["--trace", "--trace-dir", trace_dir] if traced else []
    return run_gpt([*gpt_args(args), *extra], args.iters, args.timeout,
                   TRACED if traced else UNTRACED)


def summarize(times: Dict[str, List[List[float]]], skip: int) -> dict:
    return paired_ratios(times[TRACED], times[UNTRACED], skip)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6,
                        help="Rounds; each runs both variants once (default 6).")
    parser.add_argument("--iters", type=int, default=40, help="Iterations per run (default 40).")
    parser.add_argument("--skip", type=int, default=5,
                        help="First iterations of every run left out as warm-up (default 5).")
    parser.add_argument("--microbatches", type=int, default=16,
                        help="Microbatches per iteration, one sample each (default 16).")
    parser.add_argument("--seq-length", type=int, default=256,
                        help="Longest sample in tokens (default 256).")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="Seconds one run may take before it is killed (default 600).")
    parser.add_argument("--quick", action="store_true",
                        help="Smoke run (about a minute: two launches): 1 round of 3 iterations "
                             "(skip 1), 4 microbatches of up to 64 tokens.")
    parser.add_argument("--json", type=str, default=None,
                        help="Write the settings, every run's iteration times and the summary here.")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.iters, args.skip, args.microbatches, args.seq_length = 1, 3, 1, 4, 64
    if args.rounds < 1 or args.iters < 1 or args.microbatches < 1 or args.seq_length < 8:
        parser.error("--rounds, --iters and --microbatches must be positive, --seq-length >= 8")
    if not 0 <= args.skip < args.iters:
        parser.error(f"--skip must be in [0, --iters {args.iters})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    ensure_sample_data(args.timeout)
    times: Dict[str, List[List[float]]] = {TRACED: [], UNTRACED: []}
    started = time.time()
    trace_dir = tempfile.mkdtemp(prefix="trace_overhead-")
    try:
        for round_index in range(args.rounds):
            order = (TRACED, UNTRACED) if round_index % 2 == 0 else (UNTRACED, TRACED)
            for variant in order:
                times[variant].append(run_once(args, variant == TRACED, trace_dir))
            print(f"round {round_index + 1}/{args.rounds} ({' then '.join(order)}): median ms "
                  f"traced {statistics.median(times[TRACED][-1][args.skip:]):.1f}, untraced "
                  f"{statistics.median(times[UNTRACED][-1][args.skip:]):.1f}", flush=True)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)
    summary = summarize(times, args.skip)
    print(f"--trace overhead, tiny GPT pp=2 --use-dpp varlen ({args.microbatches} microbatches of "
          f"up to {args.seq_length} tokens): traced / untraced per iteration, {summary['pairs']} "
          f"pairs over {args.rounds} rounds (first {args.skip} iterations of each run left out)")
    print(f"  {describe(summary)}")
    print(f"  target: median <= {TARGET_RATIO} ({time.time() - started:.0f} s)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        report = {"settings": {key: getattr(args, key) for key in
                               ("rounds", "iters", "skip", "microbatches", "seq_length", "quick")},
                  "target_ratio": TARGET_RATIO, "ratio": summary,
                  "times_ms": times}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
