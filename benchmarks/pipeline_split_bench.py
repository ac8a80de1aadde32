"""An even pipeline split against uneven ones (--decoder-first-pipeline-num-layers), paired.

A GPT with GPT-2's vocabulary at pp=2 on generated data (--mock-data): the last stage also runs the
output layer over 50k tokens and the loss, which at hidden 512 costs about as much as eight
transformer layers, so an even split leaves the first stage waiting. Each split trains with the
same seed and data, one run of each per round, order rotating, every rank on a core of its own
(benchmarks/pinned_rank.py); iteration i of every run sees the same samples, so each uneven run's
iteration time over the even run's of the same round and iteration is a paired ratio (median, its
95% interval, each round's median: benchmarks/paired.py). The losses of all splits agree within
1e-5 relative (initialization does not depend on the layout; sums run in another order), which
the script checks and reports. It reports; it does not judge.

    python benchmarks/pipeline_split_bench.py --json runs/pipeline_split.json   # ~8 minutes here
    python benchmarks/pipeline_split_bench.py --schedule megatron               # Megatron's 1F1B
    python benchmarks/pipeline_split_bench.py --quick                           # smoke run
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from typing import Dict, List

from paired import PINNED_ENTRY, describe, paired_ratios, run_gpt_with_output

EVEN = "even"
# The splits sum gradients and norms in another order: equal losses within the parity tests' 1e-5.
LOSS_REL_TOL = 1e-5
SCHEDULES = {"dpp": ["--use-dpp", "--dpp-timeout", "120"], "megatron": []}
LOSS_RE = re.compile(r" iteration\s+(\d+)/.*\| lm loss: ([-+0-9.eE]+)")
PARAMETERS_RE = re.compile(r"model parallel rank \(0, (\d+)\): (\d+)")


def max_relative_difference(runs: List[List[float]], reference: List[List[float]]) -> float:
    """The largest |a - b| / |b| over the runs' losses, iteration by iteration (inf if the runs
    logged different numbers of losses)."""
    pairs = [(a, b) for mine, theirs in zip(runs, reference) for a, b in
             zip(mine, theirs, strict=False)]
    if [len(run) for run in runs] != [len(run) for run in reference] or not pairs:
        return float("inf")
    return max(abs(a - b) / abs(b) for a, b in pairs)


def split_name(first: int | None) -> str:
    return EVEN if first is None else f"first={first}"


def gpt_flags(args: argparse.Namespace, first: int | None) -> List[str]:
    flags = [
        "--num-layers", args.num_layers, "--hidden-size", args.hidden_size,
        "--num-attention-heads", args.attention_heads, "--seq-length", args.seq_length,
        "--max-position-embeddings", args.seq_length, "--micro-batch-size", 1,
        "--global-batch-size", args.microbatches, "--train-iters", args.iters,
        "--lr", "1e-4", "--min-lr", "1e-5", "--hidden-dropout", 0, "--attention-dropout", 0,
        "--log-interval", 1, "--eval-iters", 0, "--seed", 1234,
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", args.vocab_size,
        "--pipeline-model-parallel-size", 2, *SCHEDULES[args.schedule]]
    if first is not None:
        flags += ["--decoder-first-pipeline-num-layers", first]
    return [str(flag) for flag in flags]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--first-stage-layers", type=int, nargs="+", default=[6, 7],
                        help="Uneven splits to compare with the even one: the first stage's "
                             "transformer layers, the last stage gets the rest (default 6 7).")
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="dpp",
                        help="dpp: --use-dpp (default); megatron: Megatron-Core's 1F1B.")
    parser.add_argument("--rounds", type=int, default=3,
                        help="Rounds; each trains every split once (default 3).")
    parser.add_argument("--iters", type=int, default=6, help="Iterations per run (default 6).")
    parser.add_argument("--skip", type=int, default=2,
                        help="First iterations of every run left out as warm-up (default 2).")
    parser.add_argument("--microbatches", type=int, default=8,
                        help="Micro-batches per iteration, one sample each (default 8).")
    parser.add_argument("--num-layers", type=int, default=8, help="Transformer layers (default 8).")
    parser.add_argument("--hidden-size", type=int, default=512, help="Hidden size (default 512).")
    parser.add_argument("--attention-heads", type=int, default=8,
                        help="Attention heads (default 8).")
    parser.add_argument("--seq-length", type=int, default=256,
                        help="Sequence length (default 256).")
    parser.add_argument("--vocab-size", type=int, default=50257,
                        help="Vocabulary, padded to a multiple of 128 (default 50257, GPT-2's).")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="Seconds one run may take before it is killed (default 900).")
    parser.add_argument("--quick", action="store_true",
                        help="Smoke run: 1 round of 3 iterations (skip 1), 4 layers of hidden 64, "
                             "sequence 64, vocabulary 4096, split 3 | 1 against 2 | 2.")
    parser.add_argument("--json", type=str, default=None,
                        help="Write the settings, every run's iteration times and the summary here.")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.iters, args.skip, args.microbatches = 1, 3, 1, 4
        args.num_layers, args.hidden_size, args.attention_heads = 4, 64, 4
        args.seq_length, args.vocab_size, args.first_stage_layers = 64, 4096, [3]
    if args.rounds < 1 or not 0 <= args.skip < args.iters:
        parser.error("--rounds must be positive and --skip in [0, --iters)")
    bad = [n for n in args.first_stage_layers if not 0 < n < args.num_layers]
    if bad:
        parser.error(f"--first-stage-layers {bad[0]}: give 1 to {args.num_layers - 1} (the last "
                     f"stage needs a layer too)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    splits = [None, *args.first_stage_layers]
    names = [split_name(first) for first in splits]
    times: Dict[str, List[List[float]]] = {name: [] for name in names}
    losses: Dict[str, List[List[float]]] = {name: [] for name in names}
    parameters: Dict[str, List[int]] = {}
    started = time.time()
    print(f"GPT pp=2 ({args.schedule}), {args.num_layers} layers of hidden {args.hidden_size}, "
          f"vocabulary {args.vocab_size}, {args.microbatches} micro-batches of {args.seq_length} "
          f"tokens, one core per rank")
    for round_index in range(args.rounds):
        shift = round_index % len(splits)
        order = splits[shift:] + splits[:shift]
        for first in order:
            name = split_name(first)
            run_times, output = run_gpt_with_output(gpt_flags(args, first), args.iters,
                                                    args.timeout, name, entry=PINNED_ENTRY)
            times[name].append(run_times)
            losses[name].append([float(m.group(2)) for m in LOSS_RE.finditer(output)])
            parameters[name] = [count for _, count in sorted(
                (int(stage), int(count)) for stage, count in PARAMETERS_RE.findall(output))]
        print(f"round {round_index + 1}/{args.rounds}: median ms "
              + ", ".join(f"{name} {statistics.median(times[name][-1][args.skip:]):.1f}"
                          for name in names), flush=True)
    summary = {}
    for first, name in zip(splits, names):
        difference = max_relative_difference(losses[name], losses[EVEN])
        row = {"median_ms": statistics.median(t for run in times[name] for t in run[args.skip:]),
               "parameters_per_stage": parameters[name],
               "loss_max_relative_difference": difference,
               "same_losses_as_even": difference <= LOSS_REL_TOL}
        layers = f"{args.num_layers // 2} | {args.num_layers // 2}" if first is None else \
            f"{first} | {args.num_layers - first}"
        print(f"  {name:8s} layers {layers:7s} median {row['median_ms']:.1f} ms per iteration, "
              f"parameters per stage {', '.join(str(p) for p in row['parameters_per_stage'])}")
        if first is not None:
            row["ratio_to_even"] = paired_ratios(times[name], times[EVEN], args.skip)
            print(f"  {'':8s} / even: {describe(row['ratio_to_even'])}")
            print(f"  {'':8s} losses {'equal' if row['same_losses_as_even'] else 'DIFFER from'} "
                  f"the even split's (largest relative difference {difference:.1e})")
        summary[name] = row
    print(f"took {time.time() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"settings": vars(args), "times_ms": times, "losses": losses,
                       "summary": summary}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
