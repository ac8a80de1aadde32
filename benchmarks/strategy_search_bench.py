"""How long the strategy search takes on a large case, and how far its extrapolated pipeline times
are from simulating every microbatch.

Case (issue 17's target): GPT-3 175B (96 layers, hidden 12288, 96 heads, seq 2048, vocab 51200,
global batch 1536, bf16) on 128 nodes x 8 GPUs of the 8xH100-nvlink-ib400 preset, 80 GB per GPU.
The target: the whole search (start-search.sh, a fresh Python process) in under 60 s on this
machine.

    python benchmarks/strategy_search_bench.py                 # the search, then the check
    python benchmarks/strategy_search_bench.py --json runs/strategy_search.json
    python benchmarks/strategy_search_bench.py --seq-length-distribution lognormal:800:0.6
                                               # the same with variable lengths (no target)

The check re-prices the top layouts simulating all their microbatches (no extrapolation) and
reports the relative difference of the pipeline time.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from megatron_dpp.search import cost
from megatron_dpp.search.cli import build_parser, problem_from_args
from megatron_dpp.search.engine import search

CASE_175B = ["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
             "--seq-length", "2048", "--global-batch-size", "1536", "--vocab-size", "51200",
             "--num-nodes", "128", "--num-gpus-per-node", "8", "--hardware", "8xH100-nvlink-ib400",
             "--memory-budget-gb", "80", "--bf16"]
TARGET_SECONDS = 60.0


def timed_cli(argv: list[str]) -> tuple[float, str]:
    """Wall seconds of the CLI in a fresh process (imports included) and its stdout."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "megatron_dpp.search.cli", *argv], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    seconds = time.monotonic() - started
    if done.returncode != 0:
        sys.exit(f"the search failed ({done.returncode}): {done.stderr.strip()}")
    return seconds, done.stdout


def extrapolation_errors(argv: list[str], top: int) -> list[dict]:
    """For the top layouts: the pipeline time extrapolated vs simulated over every microbatch."""
    problem, _ = problem_from_args(build_parser().parse_args(argv))
    result = search(problem, top)
    rows = []
    for priced in result.best:
        pricer = cost.Pricer(problem)
        full = pricer.simulate(priced.layout, priced.layout.num_microbatches).makespan
        rows.append({"layout": priced.layout.describe(), "microbatches": priced.layout.num_microbatches,
                     "simulated_microbatches": priced.simulated_microbatches,
                     "pipeline_ms_extrapolated": priced.pipeline_ms, "pipeline_ms_full": full,
                     "relative_error": priced.pipeline_ms / full - 1.0})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=5, help="layouts to list and check (default 5)")
    parser.add_argument("--seq-length-distribution", metavar="SPEC", default=None,
                        help="search with --variable-seq-lengths and this distribution instead")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args()
    argv = CASE_175B + ["--top", str(args.top)]
    if args.seq_length_distribution is not None:
        argv += ["--variable-seq-lengths", "--seq-length-distribution", args.seq_length_distribution]
    seconds, stdout = timed_cli(argv)
    print(stdout)
    print(f"search wall time (fresh process): {seconds:.1f} s (target < {TARGET_SECONDS:.0f} s): "
          f"{'met' if seconds < TARGET_SECONDS else 'MISSED'}")
    errors = extrapolation_errors(argv, args.top)
    print("| layout | M | simulated | extrapolated ms | full ms | error |")
    print("|---|---|---|---|---|---|")
    for row in errors:
        print(f"| {row['layout']} | {row['microbatches']} | {row['simulated_microbatches']} | "
              f"{row['pipeline_ms_extrapolated']:.1f} | {row['pipeline_ms_full']:.1f} | "
              f"{100 * row['relative_error']:+.2f}% |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"case": argv, "seconds": seconds, "target_seconds": TARGET_SECONDS,
                       "extrapolation": errors}, handle, indent=1)
    return 0 if seconds < TARGET_SECONDS else 1


if __name__ == "__main__":
    sys.exit(main())
