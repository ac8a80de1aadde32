"""The strategy search's predicted time per iteration against measured training runs, on this
machine, for the tiny GPT (examples/gpt3/gpt3_tiny.sh: 4 layers, hidden 128, 4 heads, FFN 512,
seq 128, global batch 16, fp32) on 2 processes.

1. Profiles: the hardware (run_scripts/profile_hardware.sh, 2 ranks, fp32) and the model's layer
   (run_scripts/profile_model.sh at seq 128 and the micro-batch sizes the layouts use), or the
   directories given with --hardware / --model-profile.
2. Prediction: the Problem exactly as `start-search.sh --cpu --num-nodes 1 --num-gpus-per-node 2`
   builds it (megatron_dpp.search.cli.problem_from_args), each layout below priced by the search's
   own Pricer (estimate, then the simulator); the layout must be one the search enumerates. Also
   the search's own top 5, to say where the layouts measured here stand in it.
3. Measurement: every layout trains with the search's own flags for it (strategy.megatron_flags)
   under torchrun, 2 ranks each pinned to a core of its own (benchmarks/pinned_rank.py,
   OMP_NUM_THREADS=1), the recipe's optimizer settings, the sample data, the same seed; one run of
   every layout per round, the order rotating round by round, --rounds rounds; the first --skip
   iterations of every run are left out. Per layout: the median over all kept iterations with the
   sign test's 95% interval, each round's median and the interval over round medians; and, as the
   house rules ask, each layout's time / the reference layout's (the first) for the same round and
   iteration (same samples), compared with the predicted ratio.
4. The table, and the issue's targets as `# target` lines: the measured ranking of the top 3
   matches the predicted one (strictly, and where the measurement can order two layouts: a pair
   whose paired ratio's 95% interval contains 1 is a tie), every prediction within 20% of the
   measured median.

    python benchmarks/search_vs_measured.py --json runs/search_vs_measured.json   # about 5 minutes here
    python benchmarks/search_vs_measured.py --hardware runs/hw --model-profile runs/model
    python benchmarks/search_vs_measured.py --quick     # 2 layouts, 1 round, quick profiles (tests)
    python benchmarks/search_vs_measured.py --layouts pp2-1f1b --rounds 1 --trace-dir runs/svm-trace
    python profiling/aggregate.py --benchmark_dir runs/svm-trace   # measured task time per rank

Bad flags: one line on stderr, exit code 2, before any work. This script reports and checks the
targets; its exit code is 0 whether they are met or not.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from paired import (PINNED_ENTRY, REPO, SAMPLE, ensure_sample_data, median_interval, paired_ratios, run_gpt,
                    sample_data_args)

from megatron_dpp.data.tokenizer import GPT2_BPE, tokenizer_from_files
from megatron_dpp.pipeline.registry import ADAPTIVE, INTERLEAVED_1F1B, ONE_F_ONE_B
from megatron_dpp.search import cli
from megatron_dpp.search.cost import LayoutCost, Pricer, Problem
from megatron_dpp.search.engine import search, space_inputs
from megatron_dpp.search.errors import SearchInputError
from megatron_dpp.search.hardware import PRESETS
from megatron_dpp.search.space import Layout, enumerate_layouts
from megatron_dpp.one_line_errors import OneLineErrorParser
from megatron_dpp.search.strategy import megatron_flags

# The tiny GPT (examples/gpt3/gpt3_tiny.sh), fp32, without dropout.
LAYERS, HIDDEN, HEADS, FFN, SEQ, GLOBAL_BATCH = 4, 128, 4, 512, 128, 16
SHAPE_FLAGS = ["--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS), "--ffn-hidden-size",
               str(FFN), "--seq-length", str(SEQ), "--hidden-dropout", "0", "--attention-dropout", "0"]
# As start-search.sh's flags, on one node of 2 processes.
MODEL_FLAGS = ["--num-layers", str(LAYERS), *SHAPE_FLAGS, "--global-batch-size", str(GLOBAL_BATCH)]
SEARCH_FLAGS = ["--cpu", "--num-nodes", "1", "--num-gpus-per-node", "2", "--memory-budget-gb", "4"]
NPROC = 2
# The recipe's optimizer and schedule (gpt3_tiny.sh TRAINING_ARGS without the batch, the length and
# the warm-up: training_flags).
TRAINING_FLAGS = ["--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine",
                  "--weight-decay", "0.01", "--clip-grad", "1.0",
                  "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--seed", "1234",
                  "--log-interval", "1", "--eval-iters", "0"]


def _layout(tp=1, pp=1, vpp=1, dp=1, mbs=2, recompute="none", schedule=ONE_F_ONE_B,
            last_stage_layers=0) -> Layout:
    return Layout(tp=tp, pp=pp, vpp=vpp, dp=dp, micro_batch_size=mbs,
                  num_microbatches=GLOBAL_BATCH // (mbs * dp), recompute=recompute,
                  distributed_optimizer=False, sequence_parallel=False, schedule=schedule, split_backward=False,
                  last_stage_layers=last_stage_layers)


# name -> layout; the first is the reference of the paired ratios.
LAYOUTS: Dict[str, Layout] = {
    "pp2-1f1b": _layout(pp=2),
    "pp2-dpp": _layout(pp=2, schedule=ADAPTIVE),
    "pp2-vpp2": _layout(pp=2, vpp=2, schedule=INTERLEAVED_1F1B),
    "pp2-recompute-full": _layout(pp=2, recompute="full"),
    "pp2-mbs1": _layout(pp=2, mbs=1),
    "pp2-last1": _layout(pp=2, last_stage_layers=1),  # 3 | 1: --decoder-last-pipeline-num-layers 1
    "pp2-last3": _layout(pp=2, last_stage_layers=3),  # 1 | 3
    "tp2": _layout(tp=2),
    "tp2-recompute-selective": _layout(tp=2, recompute="selective"),
    "dp2": _layout(dp=2),
    "dp2-mbs4": _layout(dp=2, mbs=4),
    "dp2-mbs8": _layout(dp=2, mbs=8),
    "tp2-mbs16": _layout(tp=2, mbs=16),
}
QUICK_LAYOUTS = ["pp2-1f1b", "tp2"]
TOP = 3  # the ranking target's length
TOLERANCE = 0.20  # the accuracy target: |predicted / measured - 1| at most this


def training_flags(iters: int) -> List[str]:
    """The recipe's 5 warm-up iterations, fewer in short runs (the trainer wants the decay
    longer than the warm-up; the learning rate does not change the time per iteration)."""
    return [*TRAINING_FLAGS, "--train-iters", str(iters), "--lr-warmup-iters", str(min(5, iters - 1))]


def parse_args(argv=None):
    parser = OneLineErrorParser(prog="search_vs_measured.py", allow_abbrev=False,
                                description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=None,
                        help=f"Layouts to compare (default all: {', '.join(LAYOUTS)}; --quick: "
                             f"{', '.join(QUICK_LAYOUTS)}); the first is the reference of the ratios.")
    parser.add_argument("--hardware", type=str, default=None, metavar="PRESET|DIR",
                        help="Hardware figures (start-search.sh's --hardware); default: measure them "
                             "with profile_hardware.sh into WORK_DIR/hardware.")
    parser.add_argument("--model-profile", type=str, default=None, metavar="DIR",
                        help="Model profile directory; default: measure it with profile_model.sh "
                             "into WORK_DIR/model.")
    parser.add_argument("--work-dir", type=str, default=os.path.join(REPO, "runs", "search_vs_measured"),
                        help="Where measured profiles go (default runs/search_vs_measured).")
    parser.add_argument("--rounds", type=int, default=3,
                        help="Training runs per layout, one of each per round, order rotating "
                             "(default 3; --quick 1).")
    parser.add_argument("--iters", type=int, default=30,
                        help="Iterations per training run (default 30; --quick 4).")
    parser.add_argument("--skip", type=int, default=5,
                        help="First iterations of every run left out (default 5; --quick 1).")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="Seconds one training run or one profiling run may take (default 600).")
    parser.add_argument("--trace-dir", type=str, default=None, metavar="DIR",
                        help="Also trace every run of a pipeline layout (--trace; it costs under 1%%, "
                             "docs/tracing.md) into DIR, one sub-directory per run, for "
                             "profiling/aggregate.py: each rank's measured task time per iteration, "
                             "to compare with the predicted durations (default: no traces).")
    parser.add_argument("--quick", action="store_true",
                        help="For tests: the quick layouts, 1 round of 4 iterations, quick profiles.")
    parser.add_argument("--json", type=str, default=None, metavar="FILE",
                        help="Also write everything (every iteration time) to this JSON file.")
    args = parser.parse_args(argv)
    if args.quick:
        args.layouts = args.layouts or QUICK_LAYOUTS
        args.rounds, args.iters, args.skip = 1, 4, 1
    args.layouts = args.layouts or list(LAYOUTS)
    if len(set(args.layouts)) != len(args.layouts):
        parser.error("--layouts names a layout twice")
    for flag in ("rounds", "iters"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1")
    if not 0 <= args.skip < args.iters:
        parser.error("--skip must be at least 0 and below --iters")
    if not args.timeout > 0:
        parser.error("--timeout must be positive")
    if args.model_profile is not None and not os.path.isdir(args.model_profile):
        parser.error(f"--model-profile {args.model_profile} is not a directory")
    if args.hardware is not None and not (os.path.isdir(args.hardware) or args.hardware in PRESETS):
        parser.error(f"--hardware {args.hardware} is neither a directory nor a preset "
                     f"({', '.join(PRESETS)})")
    return args


def log(message: str) -> None:
    print(f"[search_vs_measured {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_profiler(command: List[str], what: str, timeout: float, env: Optional[dict] = None) -> None:
    log(f"profiling the {what}: {' '.join(command)}")
    try:
        done = subprocess.run(command, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"profiling the {what} took more than {timeout:g} s") from None
    if done.returncode != 0:
        raise RuntimeError(f"profiling the {what} failed (exit {done.returncode}):\n{done.stdout[-3000:]}")


def profiles(args, micro_batch_sizes: List[int], vocab_size: int) -> tuple:
    """(hardware, model profile directory): the given ones, or measured here into --work-dir."""
    quick = ["--quick"] if args.quick else []
    hardware = args.hardware
    if hardware is None:
        hardware = os.path.join(args.work_dir, "hardware")
        run_profiler(["bash", os.path.join(REPO, "run_scripts", "profile_hardware.sh"), "--output-dir",
                      hardware, "--dtypes", "fp32", *quick], "hardware", args.timeout, {"NPROC": str(NPROC)})
    model = args.model_profile
    if model is None:
        model = os.path.join(args.work_dir, "model")
        run_profiler(["bash", os.path.join(REPO, "run_scripts", "profile_model.sh"), "--model", "gpt",
                      *SHAPE_FLAGS, "--micro-batch-sizes", *map(str, micro_batch_sizes),
                      "--vocab-size", str(vocab_size), "--output-dir", model, *quick],
                     "model", args.timeout)
    return hardware, model


def sample_vocab_size() -> int:
    """The vocabulary of the sample data's tokenizer (a BPE trained on it: 4096 tokens, not GPT-2's
    50257, the search's default): the output layer's size."""
    tokenizer = tokenizer_from_files(GPT2_BPE, os.path.join(SAMPLE, "vocab.json"),
                                     os.path.join(SAMPLE, "merges.txt"))
    return tokenizer.vocab_size


def build_problem(hardware: str, model: str, vocab_size: int) -> tuple:
    """The Problem and the model figures' source, exactly as start-search.sh builds them."""
    argv = [*MODEL_FLAGS, *SEARCH_FLAGS, "--vocab-size", str(vocab_size), "--hardware", hardware,
            "--model-profile", model]
    return cli.problem_from_args(cli.build_parser().parse_args(argv))


def predict(problem: Problem, names: List[str]) -> Dict[str, LayoutCost]:
    valid = set(enumerate_layouts(space_inputs(problem)))
    pricer = Pricer(problem)
    costs = {}
    for name in names:
        layout = LAYOUTS[name]
        if layout not in valid:
            raise RuntimeError(f"layout {name} ({layout.describe()}) is not one the search enumerates")
        costs[name] = pricer.price(layout, pricer.estimate(layout))
    return costs


def breakdown(problem: Problem, cost: LayoutCost) -> dict:
    """What the prediction is made of (per task and per iteration), for finding why it is off."""
    pricer = Pricer(problem)
    layout, shape = cost.layout, problem.shape
    figures = pricer.layer(layout.micro_batch_size, shape.seq_length, layout.tp, False, layout.recompute)
    rank_layers = layout.rank_layers(shape.num_layers)
    per_rank = rank_layers[0]  # the first rank's (an uneven split's last differs: rank_layers)
    first, last = pricer.stage_extras_ms(layout.micro_batch_size, shape.seq_length, layout.tp)
    overhead = pricer.durations(layout)[0]
    return {"layer_forward_ms": figures.forward_ms, "layer_backward_ms": figures.backward_ms,
            "rank_layers": rank_layers,
            "first_stage_extra_ms_per_iteration": first * layout.num_microbatches,
            "last_stage_extra_ms_per_iteration": last * layout.num_microbatches,
            "task_overhead_ms": [overhead.forward_overhead, overhead.backward_overhead],
            "layers_forward_backward_ms_per_iteration_per_rank":
                per_rank * (figures.forward_ms + figures.backward_ms) * layout.num_microbatches,
            "tasks_per_rank": 2 * layout.num_microbatches * layout.vpp,
            "pipeline_ms": cost.pipeline_ms, "grad_sync_exposed_ms": cost.grad_sync_exposed_ms,
            "optimizer_ms": cost.optimizer_ms,
            "bubble_fraction": cost.bubble_fraction}


def measure(args, problem: Problem, costs: Dict[str, LayoutCost]) -> Dict[str, List[List[float]]]:
    """name -> one list of iteration times (ms) per round, the first --skip left out."""
    names = list(costs)
    times: Dict[str, List[List[float]]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            flags = [*megatron_flags(problem, costs[name]), *sample_data_args(),
                     *training_flags(args.iters)]
            if args.trace_dir is not None and costs[name].layout.pp > 1:  # --trace needs a pipeline
                flags += ["--trace", "--trace-dir", args.trace_dir]
            started = time.monotonic()
            values = run_gpt(flags, args.iters, args.timeout, name, entry=PINNED_ENTRY, nproc=NPROC)
            kept = values[args.skip:]
            times[name].append(kept)
            log(f"round {round_index + 1}/{args.rounds} {name}: median {statistics.median(kept):.1f} ms "
                f"over {len(kept)} iterations ({time.monotonic() - started:.0f} s)")
    return times


def rank(values: Dict[str, float]) -> Dict[str, int]:
    return {name: index for index, name in enumerate(sorted(values, key=values.get), 1)}


def summarize(costs: Dict[str, LayoutCost], times: Dict[str, List[List[float]]]) -> dict:
    names = list(costs)
    reference = names[0]
    rows = {}
    for name in names:
        pooled = [value for run in times[name] for value in run]
        round_medians = [statistics.median(run) for run in times[name]]
        measured = statistics.median(pooled)
        predicted = costs[name].time_ms
        ratios = paired_ratios(times[name], times[reference], 0)
        rows[name] = {
            "layout": costs[name].layout.describe(), "predicted_ms": predicted, "measured_ms": measured,
            "interval_95": list(median_interval(pooled)), "round_medians": round_medians,
            "rounds_interval_95": list(median_interval(round_medians)),
            "predicted_over_measured": predicted / measured,
            "measured_ratio_to_reference": ratios["median"],
            "measured_ratio_to_reference_interval_95": ratios["interval_95"],
            "measured_ratio_to_reference_rounds": ratios["round_medians"],
            "predicted_ratio_to_reference": predicted / costs[reference].time_ms,
            "iteration_ms": times[name]}
    by_prediction = rank({name: row["predicted_ms"] for name, row in rows.items()})
    by_measurement = rank({name: row["measured_ms"] for name, row in rows.items()})
    for name in names:
        rows[name]["rank_predicted"] = by_prediction[name]
        rows[name]["rank_measured"] = by_measurement[name]
    top = min(TOP, len(names))
    predicted_order = sorted(names, key=by_prediction.get)
    predicted_top = predicted_order[:top]
    measured_top = sorted(names, key=by_measurement.get)[:top]
    conflicts = order_conflicts(predicted_order, top, times)
    worst = max(names, key=lambda n: abs(rows[n]["predicted_over_measured"] - 1.0))
    return {
        "reference": reference, "layouts": rows,
        "targets": {
            "top_ranking": {"predicted_top": predicted_top, "measured_top": measured_top,
                            "met": predicted_top == measured_top},
            "top_ranking_up_to_ties": {"predicted_top": predicted_top, "conflicts": conflicts,
                                       "met": not conflicts},
            "within_tolerance": {"tolerance": TOLERANCE, "worst_layout": worst,
                                 "worst_predicted_over_measured": rows[worst]["predicted_over_measured"],
                                 "met": all(abs(rows[n]["predicted_over_measured"] - 1.0) <= TOLERANCE
                                            for n in names)}}}


def order_conflicts(predicted_order: List[str], top: int,
                    times: Dict[str, List[List[float]]]) -> List[dict]:
    """Pairs the measurement orders against the prediction: a layout of the predicted top `top`
    and one predicted slower, whose paired ratio (same round, same iteration) has a 95% interval
    wholly above 1. Pairs whose interval contains 1 are ties: the measurement cannot order them,
    so either order agrees with it."""
    conflicts = []
    for index, faster in enumerate(predicted_order[:top]):
        for slower in predicted_order[index + 1:]:
            ratios = paired_ratios(times[faster], times[slower], 0)
            low, high = ratios["interval_95"]
            if low > 1.0:
                conflicts.append({"predicted_faster": faster, "predicted_slower": slower,
                                  "measured_ratio": ratios["median"], "interval_95": [low, high]})
    return conflicts


def format_table(summary: dict) -> str:
    lines = ["| layout | predicted ms | measured ms (median, 95% interval) | round medians | "
             "predicted / measured | measured / ref (95% interval) | predicted / ref | "
             "rank predicted | rank measured |",
             "|" + "---|" * 9]
    for name, row in summary["layouts"].items():
        low, high = row["interval_95"]
        rlow, rhigh = row["measured_ratio_to_reference_interval_95"]
        lines.append(
            f"| {name} | {row['predicted_ms']:.1f} | {row['measured_ms']:.1f} ({low:.1f}-{high:.1f}) | "
            + " ".join(f"{m:.1f}" for m in row["round_medians"])
            + f" | {row['predicted_over_measured']:.2f} | {row['measured_ratio_to_reference']:.3f} "
              f"({rlow:.3f}-{rhigh:.3f}) | {row['predicted_ratio_to_reference']:.3f} | "
              f"{row['rank_predicted']} | {row['rank_measured']} |")
    return "\n".join(lines)


def target_lines(summary: dict) -> List[str]:
    top = summary["targets"]["top_ranking"]
    ties = summary["targets"]["top_ranking_up_to_ties"]
    accuracy = summary["targets"]["within_tolerance"]
    conflicts = "; ".join(
        f"{c['predicted_faster']} / {c['predicted_slower']} measured {c['measured_ratio']:.3f} "
        f"({c['interval_95'][0]:.3f}-{c['interval_95'][1]:.3f})" for c in ties["conflicts"])
    return [
        f"# target measured ranking of the top {len(top['predicted_top'])} = predicted: predicted "
        f"{', '.join(top['predicted_top'])}; measured {', '.join(top['measured_top'])}: "
        f"{'met' if top['met'] else 'not met'}",
        f"# target measured ranking of the top {len(ties['predicted_top'])} = predicted, where the "
        f"measurement orders a pair (paired ratio's 95% interval without 1): "
        + (f"not met: {conflicts}" if conflicts else "met: no pair measured in the other order"),
        f"# target every prediction within {accuracy['tolerance']:.0%} of the measured median: worst "
        f"{accuracy['worst_layout']} predicted / measured {accuracy['worst_predicted_over_measured']:.2f}: "
        f"{'met' if accuracy['met'] else 'not met'}"]


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    micro_batch_sizes = sorted({LAYOUTS[name].micro_batch_size for name in args.layouts})
    ensure_sample_data(args.timeout)
    vocab_size = sample_vocab_size()
    hardware, model = profiles(args, micro_batch_sizes, vocab_size)
    try:
        problem, model_source = build_problem(hardware, model, vocab_size)
    except SearchInputError as error:  # a profile directory without the files, a bad preset
        print(f"search_vs_measured.py: error: {error}", file=sys.stderr, flush=True)
        return 2
    costs = predict(problem, args.layouts)
    search_top = search(problem, 5).best
    times = measure(args, problem, costs)
    summary = summarize(costs, times)
    print(f"hardware figures: {problem.hardware.source}")
    print(f"model figures: {model_source}")
    print(f"{args.rounds} round(s) x {len(args.layouts)} layouts, {args.iters} iterations per run, "
          f"first {args.skip} left out; reference of the ratios: {summary['reference']}; "
          f"load average {os.getloadavg()[0]:.2f} at the end (2 cores)")
    print()
    print(format_table(summary))
    print()
    print("the search's own top 5 (ms/iteration): " + "; ".join(
        f"{cost.layout.describe()} {cost.time_ms:.1f}" for cost in search_top))
    print()
    for line in target_lines(summary):
        print(line)
    if args.json:
        result = {"date_utc": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
                  "command": " ".join(sys.argv), "hardware": hardware, "model_profile": model,
                  "hardware_source": problem.hardware.source, "model_source": model_source,
                  "rounds": args.rounds, "iters": args.iters, "skip": args.skip,
                  "load_average": os.getloadavg(), "seconds": time.monotonic() - started,
                  "breakdown": {name: breakdown(problem, cost) for name, cost in costs.items()},
                  "search_top": [{"layout": c.layout.describe(), "time_ms": c.time_ms} for c in search_top],
                  **summary}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
