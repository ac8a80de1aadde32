"""Aggregate a --trace run: merge its per-rank traces into one, print where the time went, plot it.

  python profiling/aggregate.py --benchmark_dir benchmark/20261124-153000-pp2-dpp
  python profiling/aggregate.py --benchmark_dir benchmark/RUN_A --compare benchmark/RUN_B
  python profiling/aggregate.py --benchmark_dir benchmark/RUN --iterations 2:6 --replay
  python profiling/aggregate.py --benchmark_dir benchmark/RUN --order-csv

Writes, next to the rank files: RUN-aggregated.json (all ranks, one process each, flow arrows from
every send to its receive: open it in Perfetto), RUN-timeline.png and RUN-bubble.png; with
--compare, RUN-vs-OTHER-timeline.png and RUN-vs-OTHER-iterations.png too (OTHER gets its own
aggregated file and plots in its directory); with --order-csv, RUN-order-iteration<I>.csv per chosen
iteration: the order each pipeline rank ran its tasks in, in torch's schedule CSV, which
`--dpp-schedule FILE` runs again. Prints, over the chosen iterations, per rank and in
total: busy time, idle time by reason (input wait: no task was ready; held back: the policy or the
memory budget kept ready tasks back; tp decision: a tensor-parallel follower waited for its
leader; send posting: the transport's isend of a task's output; collective: a blocking collective
of the training step inside the pipeline's window; other: anything else, including the runtime's
loop between tasks) and the bubble fraction; per iteration: its time, its critical path and the
bubble fraction; per rank, the whole training step: tasks, gradient sync, optimizer step, the
loop's other collectives and the rest. Bad input: one line, exit 2.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

# Run as a script: make the repository root importable for `profiling` (megatron_dpp is installed).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trace_analysis import plots, report  # noqa: E402
from trace_analysis.analysis import IterationTime, has_step_parts, iteration_time, mean_step_times  # noqa: E402
from trace_analysis.critical_path import CriticalPath, critical_path  # noqa: E402
from trace_analysis.executed_order import write_executed_orders  # noqa: E402
from trace_analysis.iterations import IterationRange, parse_iteration_range, select_iterations  # noqa: E402
from trace_analysis.load import RunTraces, TraceInputError, clock_note, find_run_directory, load_run  # noqa: E402
from trace_analysis.merge import write_aggregated  # noqa: E402
from trace_analysis.messages import match_messages  # noqa: E402
from trace_analysis.replay import policy_that_ran, replay  # noqa: E402
from trace_analysis.timeline import RunTimeline, run_timeline  # noqa: E402

PROG = "aggregate.py"


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = OneLineParser(prog=PROG, description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--benchmark_dir", "--benchmark-dir", required=True, metavar="DIR",
                        help="a run directory (TRACE_DIR/<run>, holding benchmark-rank<R>.json), or a "
                             "directory holding exactly one such run")
    parser.add_argument("--compare", metavar="OTHER_DIR",
                        help="a second run (same forms as DIR): its tables too, the ratios OTHER / DIR per "
                             "iteration, and the comparison plots (written into DIR's run directory)")
    parser.add_argument("--iterations", metavar="A:B",
                        help="iteration numbers A to B-1 (as the trace numbers them, from 0; either end "
                             "may be left out, e.g. 2: or :5); default: all but the first, which pays "
                             "one-time warm-up costs. Applies to both runs with --compare")
    parser.add_argument("--replay", action="store_true",
                        help="run each iteration's measured task durations through the simulator under "
                             "every policy and print what each would have taken, next to the measured "
                             "time: the policy's choices versus the machine's noise")
    parser.add_argument("--order-csv", action="store_true",
                        help="write each chosen iteration's executed order (one row per pipeline "
                             "rank, cells such as 0F0, 3I1, 3W1, 5B2: torch's schedule CSV with "
                             "global stages) to RUN-order-iteration<I>.csv beside the rank files; "
                             "--dpp-schedule FILE runs it again")
    return parser.parse_args(argv)


@dataclass
class Analysis:
    traces: RunTraces
    run: RunTimeline
    iterations: List[IterationTime]
    paths: List[CriticalPath]


def analyse(directory: str, chosen: Optional[IterationRange]) -> Analysis:
    """Load, check, merge and measure one run, printing what it did."""
    run_directory, note = find_run_directory(Path(directory))
    if note:
        print(f"{PROG}: {note}")
    traces = load_run(run_directory)
    run = run_timeline(traces)
    selected, which = select_iterations(run.training_iterations, chosen)
    match = match_messages(run)
    merged = write_aggregated(traces, run, match)
    times = [iteration_time(run, i) for i in selected]
    paths = [critical_path(run, i) for i in selected]

    print(f"run {run.name}: policy {run.policy}, {len(run.ranks)} ranks; {which}")
    print(clock_note(traces))
    unmatched = len(match.unmatched_recvs) + len(match.unmatched_sends)
    matched = "every send matched to its receive" if not unmatched else (
        f"{len(match.unmatched_recvs)} receives and {len(match.unmatched_sends)} sends unmatched")
    print(f"merged trace: {merged} ({len(match.pairs)} flow arrows; {matched})")
    print()
    print("time per rank, summed over the iterations (ms); bubble = idle / iteration time:")
    print(report.rank_table(run, times))
    print()
    print("per iteration (ms; time = first task start to last task end on any rank; critical path = "
          "the longest chain of dependent tasks in the order each rank ran them):")
    print(report.iteration_table(times, paths))
    print(report.critical_path_line(times[0].iteration, paths[0]))
    if has_step_parts(run):
        print()
        print("training step per rank, mean ms per iteration (step = from an iteration's start on the "
              "rank to the next's; other collectives: the loss all-reduce and the stop-signal "
              "agreement; rest: input waits, send posting, the loop, logging):")
        print(report.step_table(run, mean_step_times(run, selected)))
    return Analysis(traces, run, times, paths)


def plot(analysis: Analysis) -> List[Path]:
    directory, name = analysis.traces.directory, analysis.run.name
    return [plots.timeline_plot(analysis.run, analysis.iterations[0], directory / f"{name}-timeline.png"),
            plots.bubble_plot(analysis.run, analysis.iterations, directory / f"{name}-bubble.png")]


def print_replay(analysis: Analysis) -> None:
    result = replay(analysis.run, [it.iteration for it in analysis.iterations])
    print()
    print(f"replay of {analysis.run.name} on its measured durations (mean over the iterations; messages "
          "free, decisions instant):")
    print(report.replay_table(result, policy_that_ran(analysis.run)))


def compare(a: Analysis, b: Analysis) -> List[Path]:
    common = sorted({it.iteration for it in a.iterations} & {it.iteration for it in b.iterations})
    if not common:
        raise TraceInputError(f"the runs share no chosen iteration ({a.run.name}: "
                              f"{[it.iteration for it in a.iterations]}, {b.run.name}: "
                              f"{[it.iteration for it in b.iterations]})")
    its_a = [it for it in a.iterations if it.iteration in common]
    its_b = [it for it in b.iterations if it.iteration in common]
    print()
    print("comparison per iteration (ms; B / A below 1: B is faster, or has less bubble):")
    print(report.compare_table(a.run.name, its_a, b.run.name, its_b))
    stem = a.traces.directory / f"{a.run.name}-vs-{b.run.name}"
    return [plots.compare_timeline_plot(a.run, its_a[0], b.run, its_b[0], Path(f"{stem}-timeline.png")),
            plots.compare_iterations_plot(a.run, its_a, b.run, its_b, Path(f"{stem}-iterations.png"))]


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        chosen = parse_iteration_range(args.iterations) if args.iterations else None
        analyses = [analyse(args.benchmark_dir, chosen)]
        if args.compare:
            print()
            analyses.append(analyse(args.compare, chosen))
        written = [path for analysis in analyses for path in plot(analysis)]
        if args.replay:
            for analysis in analyses:
                print_replay(analysis)
        if args.compare:
            written += compare(*analyses)
        orders = []
        if args.order_csv:
            for analysis in analyses:
                orders += write_executed_orders(
                    analysis.run, [it.iteration for it in analysis.iterations],
                    analysis.traces.directory)
    except TraceInputError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"{PROG}: cannot write the outputs: {error}", file=sys.stderr)
        return 1
    print()
    print("plots: " + ", ".join(str(path) for path in written))
    if orders:
        print("executed orders (torch's schedule CSV): " + ", ".join(str(path) for path in orders))
    return 0


if __name__ == "__main__":
    sys.exit(main())
