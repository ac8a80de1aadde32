"""What --trace costs: the tiny GPT (pp=2, --use-dpp, --variable-seq-lengths) with and without it.

Two measures, from the same runs (every rank pinned to a core of its own):

1. Paired runs. The two variants run in rounds, one run of each per round, the order alternating
   from round to round. Both use the same seed and data, so iteration i of one sees the samples of
   iteration i of the other: traced time / untraced time of the same round and iteration, leaving
   out the first --skip iterations (warm-up); the median, its quartiles, the median's 95% interval
   over all pairs and over the round medians. On shared cores a whole run is often 20-30% faster
   or slower than the next (the machine's speed changes on a scale of tens of seconds, longer than
   a run), so the interval over rounds, the honest one, is wide.
2. Recording time, inside the traced runs: a stopwatch on every recorder method that records an
   event (benchmarks/recording_time_rank.py) gives, per iteration, the time both ranks together
   spent recording, divided by that iteration's time. Summing both ranks errs high (only the
   critical path's share slows an iteration). It does not see indirect costs (caches, memory).

The issue's target is a slowdown of at most 2%; this script reports, it does not judge.

    python benchmarks/trace_overhead.py --json runs/trace_overhead.json
    python benchmarks/trace_overhead.py --quick
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Tuple

from paired import (PINNED_ENTRY, RECORDING_TIME_ENTRY, describe, ensure_sample_data, median_interval,
                    paired_ratios, run_gpt, run_gpt_with_output, sample_data_args)
from recording_time_rank import RECORDING_PREFIX

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


def run_untraced(args: argparse.Namespace) -> List[float]:
    """Milliseconds of iterations 1..--iters of one run, in order."""
    return run_gpt(gpt_args(args), args.iters, args.timeout, UNTRACED, entry=PINNED_ENTRY)


def run_traced(args: argparse.Namespace, trace_dir: str) -> Tuple[List[float], List[float]]:
    """Milliseconds of iterations 1..--iters of one traced run, and of each of them the
    milliseconds both ranks together spent recording."""
    times, output = run_gpt_with_output([*gpt_args(args), "--trace", "--trace-dir", trace_dir],
                                        args.iters, args.timeout, TRACED, entry=RECORDING_TIME_ENTRY)
    per_rank = [json.loads(match)["ms"] for match in
                re.findall(re.escape(RECORDING_PREFIX) + r"(\{[^}]*\})", output)]
    if len(per_rank) != 2 or any(len(ms) != args.iters for ms in per_rank):
        raise RuntimeError(f"the traced run: expected {args.iters} recording times from each of 2 "
                           f"ranks, got {[len(ms) for ms in per_rank]}")
    return times, [sum(ms) for ms in zip(*per_rank)]


def recording_share(times: List[List[float]], recording: List[List[float]], skip: int) -> dict:
    """Per traced iteration (after `skip`), recording ms / iteration ms: median, its 95% interval,
    the 95th percentile and the largest."""
    shares = sorted(r / t for run_times, run_recording in zip(times, recording)
                    for t, r in list(zip(run_times, run_recording))[skip:])
    low, high = median_interval(shares)
    return {"median": statistics.median(shares), "interval_95": [low, high],
            "p95": shares[min(len(shares) - 1, int(0.95 * len(shares)))], "max": shares[-1],
            "iterations": len(shares),
            "median_recording_ms": statistics.median(
                r for run in recording for r in run[skip:])}


def summarize(times: Dict[str, List[List[float]]], skip: int) -> dict:
    return paired_ratios(times[TRACED], times[UNTRACED], skip)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Many short rounds rather than few long ones: a run's speed is one draw of the machine's state,
    # so the rounds are the sample size of the paired measure.
    parser.add_argument("--rounds", type=int, default=12,
                        help="Rounds; each runs both variants once (default 12).")
    parser.add_argument("--iters", type=int, default=20, help="Iterations per run (default 20).")
    parser.add_argument("--skip", type=int, default=4,
                        help="First iterations of every run left out as warm-up (default 4).")
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
    recording: List[List[float]] = []
    started = time.time()
    trace_dir = tempfile.mkdtemp(prefix="trace_overhead-")
    try:
        for round_index in range(args.rounds):
            order = (TRACED, UNTRACED) if round_index % 2 == 0 else (UNTRACED, TRACED)
            for variant in order:
                if variant == TRACED:
                    traced_times, recorded = run_traced(args, trace_dir)
                    times[TRACED].append(traced_times)
                    recording.append(recorded)
                else:
                    times[UNTRACED].append(run_untraced(args))
            print(f"round {round_index + 1}/{args.rounds} ({' then '.join(order)}): median ms "
                  f"traced {statistics.median(times[TRACED][-1][args.skip:]):.1f}, untraced "
                  f"{statistics.median(times[UNTRACED][-1][args.skip:]):.1f}", flush=True)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)
    summary = summarize(times, args.skip)
    share = recording_share(times[TRACED], recording, args.skip)
    print(f"--trace overhead, tiny GPT pp=2 --use-dpp varlen ({args.microbatches} microbatches of "
          f"up to {args.seq_length} tokens): traced / untraced per iteration, {summary['pairs']} "
          f"pairs over {args.rounds} rounds (first {args.skip} iterations of each run left out)")
    print(f"  {describe(summary)}")
    low, high = share["interval_95"]
    print(f"  recording time / iteration time in the traced runs ({share['iterations']} "
          f"iterations, both ranks summed): median {share['median']:.2%} (95% interval "
          f"{low:.2%}-{high:.2%}), 95th percentile {share['p95']:.2%}, largest {share['max']:.2%}; "
          f"median {share['median_recording_ms']:.2f} ms per iteration")
    print(f"  target: median <= {TARGET_RATIO} ({time.time() - started:.0f} s)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        report = {"settings": {key: getattr(args, key) for key in
                               ("rounds", "iters", "skip", "microbatches", "seq_length", "quick")},
                  "target_ratio": TARGET_RATIO, "ratio": summary,
                  "recording_share": share, "times_ms": times, "recording_ms": recording}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
