"""Simulated makespan of pipeline schedules: Megatron's orders vs the dynamic policies.

Scenarios (each over --seeds seeds, common random numbers across schedules):
  uniform    equal microbatches
  varlen     lognormal microbatch sizes with CV --cv (mean 1000), activation bytes = size
  jitter     equal microbatches, per-task lognormal duration noise with sigma --jitter
  straggler  equal microbatches, each task slower by --straggler-factor with prob --straggler-prob

Every schedule gets its default budget: what Megatron's order (1F1B, interleaved for V>1) holds at
most on the rank, counted at the largest microbatch of the batch. `--budgets auto provisioned`
adds dpp:adaptive rows (fused and +W) under the `provisioned` budget, which gives every rank what
Megatron's order holds on its fullest rank (rank 0); their schedule ends in "@provisioned" and a
table compares them with the default budget. Schedules marked "+W" run the
same batch with split backwards (B sends the input gradient, a local W task computes the weight
gradient; --weight-grad-fraction of the backward's time): Megatron's order with each W right after
its B, 1f1b-sorted likewise, and dpp:adaptive, which defers W into waits. Their rows carry
"split_backward": true. Prints a Markdown table of time / Megatron order (fused backward, as
Megatron runs) and time / lower bound (busiest rank's work), checks the targets, and with --json
writes {"results": [...]}.

  python benchmarks/schedule_sim.py                      # full grid, a few minutes
  python benchmarks/schedule_sim.py --quick              # P=4, M=16, 3 seeds, seconds
  python benchmarks/schedule_sim.py --P 4 --M 16 --scenarios uniform varlen --budgets auto provisioned
  python benchmarks/schedule_sim.py --scale              # time 64 ranks x 1024 microbatches
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np

from megatron_dpp.pipeline import (
    AUTO_BUDGET,
    BUDGET_MODES,
    DYNAMIC_SCHEDULES,
    TaskGraph,
    make_scheduler,
    megatron_inflight_forwards,
)
from megatron_dpp.sim import CommModel, DurationModel, simulate

SCENARIOS = ("uniform", "varlen", "jitter", "straggler")
POLICIES = DYNAMIC_SCHEDULES
MEAN_SIZE = 1000.0


def megatron_order(V: int) -> str:
    return "1f1b" if V == 1 else "interleaved-1f1b"


# The reference's naive rule as it ran there: admission by a count of in-flight forwards (what
# Megatron's order holds on the rank), blind to microbatch sizes.
GREEDY_COUNT_CAP = "dpp:greedy+count-cap"


def greedy_count_cap(graph: TaskGraph, rank: int):
    cap = max(megatron_inflight_forwards(graph, rank), graph.V)
    return make_scheduler("dpp:greedy", graph, rank, max_inflight=cap)


def schedules_for(V: int) -> list[str]:
    return [megatron_order(V), "1f1b-sorted", "gpipe", *POLICIES, GREEDY_COUNT_CAP]


# Run on the split-backward graph of the same batch; the row's schedule is the name + SPLIT_SUFFIX.
SPLIT_SUFFIX = "+W"


def split_schedules_for(V: int) -> list[str]:
    return [megatron_order(V), "1f1b-sorted", "dpp:adaptive"]


# Run again under each --budgets mode other than auto (fused and split); the row's schedule is the
# name (+W) + "@" + the mode. Static orders hold what they hold whatever the budget.
BUDGET_SCHEDULES = ["dpp:adaptive"]


def run_label(name: str, split: bool, budget: str = AUTO_BUDGET) -> str:
    return name + (SPLIT_SUFFIX if split else "") + ("" if budget == AUTO_BUDGET else f"@{budget}")


def batch_sizes(scenario: str, M: int, cv: float, rng: np.random.Generator) -> np.ndarray:
    if scenario != "varlen" or cv == 0:
        return np.full(M, MEAN_SIZE)
    sigma = math.sqrt(math.log(1 + cv * cv))
    return np.maximum(1.0, rng.lognormal(math.log(MEAN_SIZE) - sigma * sigma / 2, sigma, M))


def duration_model(scenario: str, args) -> DurationModel:
    # schedule_search.py shares this and searches fused backwards only: it has no such flag.
    split = {"weight_grad_fraction": getattr(args, "weight_grad_fraction", DurationModel.weight_grad_fraction)}
    if scenario == "jitter":
        return DurationModel(jitter_sigma=args.jitter, **split)
    if scenario == "straggler":
        return DurationModel(straggler_prob=args.straggler_prob, straggler_factor=args.straggler_factor, **split)
    return DurationModel(**split)


def run_case(scenario: str, P: int, V: int, M: int, args) -> list[dict]:
    runs = [(name, False, AUTO_BUDGET) for name in schedules_for(V)]
    runs += [(name, True, AUTO_BUDGET) for name in split_schedules_for(V)]
    runs += [(name, split, budget) for budget in getattr(args, "budgets", [AUTO_BUDGET])
             if budget != AUTO_BUDGET for split in (False, True) for name in BUDGET_SCHEDULES]
    label = {run: run_label(*run) for run in runs}
    acc = {run: {"time": [], "peak": [], "budget": [], "within": True} for run in runs}
    lower_bounds = {False: [], True: []}
    pipeline_bounds = {False: [], True: []}
    comm = CommModel(latency=args.comm_latency)
    model = duration_model(scenario, args)
    for seed in range(args.seeds):
        rng = np.random.default_rng(10_000 + seed)
        sizes = batch_sizes(scenario, M, args.cv, rng)
        graphs = {split: TaskGraph(P, V, M, sizes, split_backward=split) for split in (False, True)}
        for name, split, budget in runs:
            schedule = greedy_count_cap if name == GREEDY_COUNT_CAP else name
            result = simulate(graphs[split], schedule, model, comm, seed=seed,
                              budget_bytes=None if budget == AUTO_BUDGET else budget)
            a = acc[(name, split, budget)]
            a["time"].append(result.makespan)
            a["peak"].append(result.peak_activation)
            a["budget"].append(max(result.budget_bytes))
            a["within"] &= all(p <= b for p, b in zip(result.peak_bytes, result.budget_bytes))
            if name == megatron_order(V):  # the bounds depend on the batch and the graph only
                lower_bounds[split].append(result.lower_bound)
                pipeline_bounds[split].append(result.pipeline_bound)
    rows = []
    for run in runs:
        a = acc[run]
        rows.append(
            {
                "scenario": scenario,
                "P": P,
                "V": V,
                "M": M,
                "schedule": label[run],
                "split_backward": run[1],
                "budget_mode": run[2],
                "time": float(np.mean(a["time"])),
                "lower_bound": float(np.mean(lower_bounds[run[1]])),
                "pipeline_bound": float(np.mean(pipeline_bounds[run[1]])),
                "peak_activation": float(np.mean(a["peak"])),
                "budget": float(np.mean(a["budget"])),
                "within_budget": bool(a["within"]),
                "seeds": args.seeds,
            }
        )
    return rows


def print_table(results: list[dict]) -> None:
    print("| scenario | P | V | M | schedule | time / Megatron | time / lower bound | peak / budget |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        base = megatron_time(results, r)
        print(
            f"| {r['scenario']} | {r['P']} | {r['V']} | {r['M']} | {r['schedule']} | "
            f"{r['time'] / base:.3f} | {r['time'] / r['lower_bound']:.3f} | "
            f"{r['peak_activation'] / r['budget']:.2f} |"
        )


def print_summary(results: list[dict]) -> None:
    """Two rows per case: every fused-backward schedule's time / Megatron's and the bounds, then
    the split-backward (+W) ones, all over Megatron's fused order."""
    names = ["1f1b-sorted", "gpipe", *POLICIES, GREEDY_COUNT_CAP]
    short = {"1f1b-sorted": "sorted", "dpp:adaptive": "adaptive", "dpp:breadth-first": "breadth",
             "dpp:depth-first": "depth", "dpp:greedy": "greedy", GREEDY_COUNT_CAP: "greedy+cap"}
    print("| scenario | P | V | M | Megatron / LB | " + " | ".join(short.get(n, n) for n in names)
          + " | adaptive / LB | pipeline bound / Megatron | adaptive peak / budget |")
    print("|---" * (8 + len(names)) + "|")
    cases = sorted({(r["scenario"], r["P"], r["V"], r["M"]) for r in results},
                   key=lambda c: (SCENARIOS.index(c[0]), c[1], c[2], c[3]))
    split_rows = []
    for case in cases:
        rows = {r["schedule"]: r for r in results if (r["scenario"], r["P"], r["V"], r["M"]) == case}
        base = rows[megatron_order(case[2])]
        ours = rows["dpp:adaptive"]
        cells = [f"{rows[n]['time'] / base['time']:.3f}" for n in names]
        print(f"| {' | '.join(map(str, case))} | {base['time'] / base['lower_bound']:.3f} | " + " | ".join(cells)
              + f" | {ours['time'] / ours['lower_bound']:.3f} | {base['pipeline_bound'] / base['time']:.3f} | "
              f"{ours['peak_activation'] / ours['budget']:.2f} |")
        split = [rows.get(n + SPLIT_SUFFIX) for n in split_schedules_for(case[2])]
        if all(split):
            split_rows.append((case, base, split))
    if not split_rows:
        return
    print()
    print("Split backwards (+W), each ÷ Megatron's order with its fused backward:")
    print()
    print("| scenario | P | V | M | Megatron+W | sorted+W | adaptive+W | adaptive+W / LB "
          "| pipeline bound+W / Megatron | adaptive+W peak / budget |")
    print("|---" * 10 + "|")
    for case, base, (megatron, sorted_, ours) in split_rows:
        cells = [f"{r['time'] / base['time']:.3f}" for r in (megatron, sorted_, ours)]
        print(f"| {' | '.join(map(str, case))} | " + " | ".join(cells)
              + f" | {ours['time'] / ours['lower_bound']:.3f} | {ours['pipeline_bound'] / base['time']:.3f} | "
              f"{ours['peak_activation'] / ours['budget']:.2f} |")


def print_budget_summary(results: list[dict]) -> None:
    """With --budgets beyond auto: dpp:adaptive (fused, +W) under each budget, ÷ Megatron's fused
    order, with the peak and the budget of the rank that needs the most (rank 0's budget under
    both), in units of the batch's largest microbatch on one chunk."""
    modes = sorted({r.get("budget_mode", AUTO_BUDGET) for r in results}, key=BUDGET_MODES.index)
    if modes == [AUTO_BUDGET]:
        return
    print("dpp:adaptive under each budget, ÷ Megatron's order with its fused backward (peak and "
          "budget: the largest over ranks, mean over seeds):")
    print()
    print("| scenario | P | V | M | budget | Megatron+W | adaptive | adaptive+W | adaptive+W peak / budget |")
    print("|---" * 9 + "|")
    cases = sorted({(r["scenario"], r["P"], r["V"], r["M"]) for r in results},
                   key=lambda c: (SCENARIOS.index(c[0]), c[1], c[2], c[3]))
    for case in cases:
        rows = {r["schedule"]: r for r in results if (r["scenario"], r["P"], r["V"], r["M"]) == case}
        base = rows[megatron_order(case[2])]["time"]
        megatron_split = rows[megatron_order(case[2]) + SPLIT_SUFFIX]["time"] / base
        for mode in modes:
            fused, split = rows[run_label("dpp:adaptive", False, mode)], rows[run_label("dpp:adaptive", True, mode)]
            print(f"| {' | '.join(map(str, case))} | {mode} | {megatron_split:.3f} | {fused['time'] / base:.3f} | "
                  f"{split['time'] / base:.3f} | {split['peak_activation'] / split['budget']:.2f} |")


def megatron_time(results: list[dict], row: dict) -> float:
    for r in results:
        if (r["scenario"], r["P"], r["V"], r["M"]) == (row["scenario"], row["P"], row["V"], row["M"]) and r[
            "schedule"
        ] == megatron_order(row["V"]):
            return r["time"]
    raise KeyError("no Megatron row for this case")


def check_targets(results: list[dict]) -> list[str]:
    """The issue's targets for dpp:adaptive, one line each."""
    lines = []
    for r in results:
        if r["schedule"] not in ("dpp:adaptive", "dpp:adaptive" + SPLIT_SUFFIX):
            continue
        ratio = r["time"] / megatron_time(results, r)
        limit = 0.85 if r["scenario"] == "varlen" else 1.01
        ok = ratio <= limit and r["within_budget"]
        lines.append(
            f"{'PASS' if ok else 'FAIL'} {r['scenario']} P={r['P']} V={r['V']} M={r['M']}: "
            f"{r['schedule']} / {megatron_order(r['V'])} = {ratio:.3f} (target <= {limit}), "
            f"peak within budget: {r['within_budget']}"
        )
    return lines


def time_scale(P: int, M: int, repeats: int = 3) -> dict:
    rng = np.random.default_rng(0)
    sigma = math.sqrt(math.log(1.25))
    graph = TaskGraph(P, 1, M, rng.lognormal(math.log(MEAN_SIZE) - sigma * sigma / 2, sigma, M))
    out = {}
    for name in ("1f1b", "dpp:adaptive"):
        cpu, wall = [], []
        for _ in range(repeats):
            c0, w0 = time.process_time(), time.perf_counter()
            simulate(graph, name, DurationModel(jitter_sigma=0.2))
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
        out[name] = {"cpu_s_median": float(np.median(cpu)), "wall_s_median": float(np.median(wall))}
    return out


def pipeline_arg_problems(args) -> list:
    """The --P/--V/--M/--seeds/--cv values out of range (shared with schedule_search.py)."""
    bad = [f"--P {x}" for x in args.P if x < 1] + [f"--V {x}" for x in args.V if x < 1]
    bad += [f"--M {x}" for x in args.M if x < 1] + ([f"--seeds {args.seeds}"] if args.seeds < 1 else [])
    return bad + ([f"--cv {args.cv}"] if args.cv < 0 else [])


def check_interleavable(p, args, prog: str) -> None:
    """Exit 2 unless every V>1 configuration has M a multiple of P, as interleaved 1F1B needs."""
    for P in args.P:
        for V in args.V:
            for M in args.M:
                if V > 1 and (M < P or M % P):
                    p.exit(2, f"{prog}: V={V} needs M a multiple of P (Megatron's interleaved 1F1B); got P={P} M={M}\n")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--P", type=int, nargs="+", default=[4, 8], help="pipeline ranks")
    p.add_argument("--V", type=int, nargs="+", default=[1, 2], help="model chunks per rank")
    p.add_argument("--M", type=int, nargs="+", default=[16, 32], help="microbatches per global batch")
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    p.add_argument("--cv", type=float, default=0.5, help="varlen: coefficient of variation of sizes")
    p.add_argument("--jitter", type=float, default=0.2, help="jitter: per-task lognormal sigma")
    p.add_argument("--straggler-prob", type=float, default=0.1)
    p.add_argument("--straggler-factor", type=float, default=2.0)
    p.add_argument("--weight-grad-fraction", type=float, default=0.5,
                   help="+W rows: the share of a backward's time that is its weight gradient (W)")
    p.add_argument("--budgets", nargs="+", default=[AUTO_BUDGET], choices=BUDGET_MODES,
                   help="dpp:adaptive (fused and +W) runs under each: 'auto' gives each rank what "
                        "Megatron's order holds there, 'provisioned' gives every rank what it holds "
                        "on its fullest rank (rows '...@provisioned')")
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--comm-latency", type=float, default=0.0, help="per message, in units of a mean microbatch's forward on one rank / 1000")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--quick", action="store_true", help="P=4, M=16, V=1 and 2, 3 seeds")
    p.add_argument("--scale", action="store_true", help="only time a 64-rank x 1024-microbatch simulation")
    args = p.parse_args(argv)
    if args.quick:
        args.P, args.M, args.seeds = [4], [16], 3
    bad = pipeline_arg_problems(args)
    bad += [f"--straggler-prob {args.straggler_prob}"] if not 0 <= args.straggler_prob <= 1 else []
    bad += [f"--weight-grad-fraction {args.weight_grad_fraction}"] if not 0 < args.weight_grad_fraction < 1 else []
    if bad:
        p.exit(2, f"schedule_sim: {', '.join(bad)} out of range; use positive counts, cv >= 0, "
                  "probability in [0, 1], weight-grad fraction in (0, 1)\n")
    check_interleavable(p, args, "schedule_sim")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.scale:
        timing = time_scale(64, 1024)
        for name, t in timing.items():
            print(f"64 ranks x 1024 microbatches, {name}: {t['cpu_s_median']:.2f} s CPU, {t['wall_s_median']:.2f} s wall (median of 3)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"scale": timing}, f, indent=1)
        return 0
    results = []
    t0 = time.perf_counter()
    for scenario in args.scenarios:
        for P in args.P:
            for V in args.V:
                for M in args.M:
                    results.extend(run_case(scenario, P, V, M, args))
    print_table(results)
    print()
    print_summary(results)
    print()
    if len(set(args.budgets)) > 1 or args.budgets[0] != AUTO_BUDGET:
        print_budget_summary(results)
        print()
    for line in check_targets(results):
        print(line)
    print(f"\n{len(results)} rows in {time.perf_counter() - t0:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {k: v for k, v in vars(args).items() if k != "json"}, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
