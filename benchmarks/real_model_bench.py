"""The real GPT at pp=2 over variable-length data: Megatron-Core's 1F1B against the DPP runtime's
policies, paired iteration by iteration.

Variants: Megatron's 1F1B (the reference, over the same shm_tensor transport), 1f1b-sorted and
dpp:adaptive (the runtime with fused backwards) and dpp:adaptive+W (the same with
--dpp-split-backward). Every rank runs on a core of its own (benchmarks/pinned_rank.py;
OMP_NUM_THREADS=1). Every variant trains the same model with the same seed and data, so iteration i
of every run sees the same samples. The variants run in rounds, one run of each per round, their
order rotating from round to round. Reported per variant, over all rounds: its time / the
reference's for the same round and iteration, as a median with quartiles, the median's 95% interval
and each round's median. Every run is traced (--trace costs under 2%, docs/tracing.md), and from
the traces it also reports per variant: the median forward time per rank (the default model is
sized so that a microbatch's forward takes about 20 ms or more on one core: the benchmark then
measures schedules, not Python overhead), the runtime's per-task overhead (the time in the
pipeline's window that is neither compute nor a wait for a reason outside the runtime: the
transport's send posting and the loop between tasks, per task), and measured time / critical path.
This script reports; it does not judge.

    python benchmarks/real_model_bench.py --json runs/real_model.json   # about 15 minutes here
    python benchmarks/real_model_bench.py --quick                       # smoke run, four launches
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
from pathlib import Path
from typing import Dict, List

from paired import REPO, describe, ensure_sample_data, paired_ratios, run_gpt, sample_data_args

sys.path.insert(0, REPO)  # profiling/ (megatron_dpp is installed)

from profiling.analysis import OTHER, POSTING, iteration_time  # noqa: E402
from profiling.critical_path import critical_path  # noqa: E402
from profiling.load import find_run_directory, load_run  # noqa: E402
from profiling.timeline import run_timeline  # noqa: E402

REFERENCE = "megatron-1f1b"
# name -> extra flags. Megatron's 1F1B goes over the same transport as DPP (--p2p-transport auto:
# shm_tensor between the two ranks), so the variants differ in the schedule alone.
VARIANTS: Dict[str, List[str]] = {
    REFERENCE: [],
    "1f1b-sorted": ["--use-dpp", "--dpp-policy", "1f1b-sorted"],
    "dpp:adaptive": ["--use-dpp", "--dpp-policy", "dpp:adaptive"],
    # Every backward split into B and W (docs/dpp_runtime.md, "Split backwards").
    "dpp:adaptive+W": ["--use-dpp", "--dpp-policy", "dpp:adaptive", "--dpp-split-backward"],
}
PINNED_ENTRY = (os.path.join(REPO, "benchmarks", "pinned_rank.py"),)


def gpt_flags(args: argparse.Namespace, trace_dir: str) -> List[str]:
    return [*sample_data_args(),
            "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", str(args.attention_heads),
            "--ffn-hidden-size", str(4 * args.hidden_size),
            "--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length),
            "--micro-batch-size", "1", "--global-batch-size", str(args.microbatches),
            "--train-iters", str(args.iters), "--lr", "1e-3", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--seed", "1234", "--log-interval", "1", "--eval-iters", "0",
            "--pipeline-model-parallel-size", "2", "--variable-seq-lengths",
            "--trace", "--trace-dir", trace_dir]


def trace_stats(trace_dir: str, skip: int) -> dict:
    """From one run's traces, over its iterations after the first `skip`: the median forward per
    rank, the per-task overhead and measured time / critical path."""
    run_directory, _ = find_run_directory(Path(trace_dir))
    run = run_timeline(load_run(run_directory))
    chosen = [i for i in run.training_iterations if i >= skip]
    times = [iteration_time(run, i) for i in chosen]
    paths = [critical_path(run, i) for i in chosen]
    tasks = sum(len(rank.tasks_of(i)) for rank in run.ranks for i in chosen)
    overhead_us = sum(r.idle[POSTING] + r.idle[OTHER] for it in times for r in it.ranks)
    posting_us = sum(r.idle[POSTING] for it in times for r in it.ranks)
    return {
        "forward_ms": [statistics.median(t.duration for t in rank.tasks if t.phase == "F"
                                         and t.iteration in chosen) / 1000.0 for rank in run.ranks],
        "per_task_overhead_ms": overhead_us / tasks / 1000.0,
        "per_task_send_posting_ms": posting_us / tasks / 1000.0,
        "time_over_critical_path": statistics.mean(it.duration / p.length for it, p in zip(times, paths)),
        "bubble": statistics.mean(it.bubble for it in times),
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        help=f"Variants to run; {REFERENCE} (the reference) is always among them.")
    parser.add_argument("--rounds", type=int, default=5, help="Rounds; each runs every variant once.")
    parser.add_argument("--iters", type=int, default=12, help="Iterations per run (default 12).")
    parser.add_argument("--skip", type=int, default=2,
                        help="First iterations of every run left out as warm-up (default 2).")
    parser.add_argument("--microbatches", type=int, default=8,
                        help="Microbatches per iteration, one sample each (default 8).")
    parser.add_argument("--seq-length", type=int, default=512, help="Longest sample (default 512).")
    parser.add_argument("--hidden-size", type=int, default=768, help="Hidden size (default 768).")
    parser.add_argument("--attention-heads", type=int, default=12, help="Attention heads (default 12).")
    parser.add_argument("--num-layers", type=int, default=4,
                        help="Transformer layers, split evenly over the 2 stages (default 4).")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="Seconds one run may take before it is killed (default 900).")
    parser.add_argument("--quick", action="store_true",
                        help="Smoke run: 1 round of 3 iterations (skip 1), 4 microbatches of up to "
                             "64 tokens, hidden size 64, 2 layers.")
    parser.add_argument("--json", type=str, default=None,
                        help="Write the settings, every run's iteration times and trace figures, and "
                             "the summary here.")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.iters, args.skip, args.microbatches = 1, 3, 1, 4
        args.seq_length, args.hidden_size, args.attention_heads, args.num_layers = 64, 64, 4, 2
    if REFERENCE not in args.variants:
        args.variants = [REFERENCE, *args.variants]
    if min(args.rounds, args.iters, args.microbatches) < 1 or args.seq_length < 8:
        parser.error("--rounds, --iters and --microbatches must be positive, --seq-length >= 8")
    if not 0 <= args.skip < args.iters:
        parser.error(f"--skip must be in [0, --iters {args.iters})")
    if args.num_layers % 2 or args.hidden_size % args.attention_heads:
        parser.error("--num-layers must be even (2 stages) and --hidden-size divisible by "
                     "--attention-heads")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    ensure_sample_data(args.timeout)
    times: Dict[str, List[List[float]]] = {name: [] for name in args.variants}
    stats: Dict[str, List[dict]] = {name: [] for name in args.variants}
    started = time.time()
    scratch = tempfile.mkdtemp(prefix="real_model_bench-")
    try:
        for round_index in range(args.rounds):
            shift = round_index % len(args.variants)
            order = args.variants[shift:] + args.variants[:shift]
            for name in order:
                trace_dir = os.path.join(scratch, f"{name.replace(':', '-')}-round{round_index}")
                times[name].append(run_gpt([*gpt_flags(args, trace_dir), *VARIANTS[name]], args.iters,
                                           args.timeout, name, entry=PINNED_ENTRY))
                stats[name].append(trace_stats(trace_dir, args.skip))
            print(f"round {round_index + 1}/{args.rounds} ({', '.join(order)}): median ms "
                  + ", ".join(f"{name} {statistics.median(times[name][-1][args.skip:]):.1f}"
                              for name in args.variants), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    summary = {}
    print(f"real GPT pp=2, variable lengths (hidden {args.hidden_size}, {args.num_layers} layers, "
          f"{args.microbatches} microbatches of up to {args.seq_length} tokens), one core per rank: "
          f"{args.rounds} rounds x {args.iters} iterations, the first {args.skip} of each run left out")
    for name in args.variants:
        runs = stats[name]
        summary[name] = {
            "median_ms": statistics.median(t for run in times[name] for t in run[args.skip:]),
            "ratio_to_reference": paired_ratios(times[name], times[REFERENCE], args.skip),
            "forward_ms": [statistics.median(run["forward_ms"][rank] for run in runs) for rank in range(2)],
            "per_task_overhead_ms": statistics.median(run["per_task_overhead_ms"] for run in runs),
            "per_task_send_posting_ms": statistics.median(run["per_task_send_posting_ms"] for run in runs),
            "time_over_critical_path": statistics.median(run["time_over_critical_path"] for run in runs),
            "bubble": statistics.median(run["bubble"] for run in runs),
        }
        row = summary[name]
        print(f"  {name:14s} median {row['median_ms']:.1f} ms/iteration; forward (median) rank 0 "
              f"{row['forward_ms'][0]:.1f} ms, rank 1 {row['forward_ms'][1]:.1f} ms; per-task overhead "
              f"{row['per_task_overhead_ms']:.2f} ms (send posting {row['per_task_send_posting_ms']:.2f}); "
              f"time / critical path {row['time_over_critical_path']:.2f}; bubble {100 * row['bubble']:.1f}%")
        if name != REFERENCE:
            print(f"  {'':14s} / {REFERENCE}: {describe(row['ratio_to_reference'])}")
    print(f"({time.time() - started:.0f} s)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        settings = {key: getattr(args, key) for key in
                    ("variants", "rounds", "iters", "skip", "microbatches", "seq_length", "hidden_size",
                     "attention_heads", "num_layers", "quick")}
        with open(args.json, "w") as f:
            json.dump({"settings": settings, "reference": REFERENCE, "summary": summary,
                       "times_ms": times, "trace_stats": stats}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
