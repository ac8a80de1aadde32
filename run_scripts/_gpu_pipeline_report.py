"""The table of `run_scripts/gpu_check.sh --pipeline`, from what its steps left in OUTPUT_DIR:
steps.tsv, each pipeline run's log (pipeline/NAME.log) and its aggregate.py report
(pipeline/NAME-aggregate.log). Prints the table, writes OUTPUT_DIR/pipeline.json, exits 1 when a
step failed (0 otherwise).

    python run_scripts/_gpu_pipeline_report.py OUTPUT_DIR --seq-length 1024

Per run (NAME = pp<P>-<packed|varlen>-<schedule>): the median ms per iteration and tokens/s
(global batch x --seq-length over it; unpacked documents train fewer tokens than that), after the
first SKIP_ITERATIONS; the ratio of its iteration times to 1F1B's of the same pp and data, batch by
batch (both runs train the same batches in the same order), as the median with its quartiles; the
bubble (aggregate.py's "total" row); each rank's peak allocated memory (Megatron-LM's memory
line); and the largest relative difference of its losses from 1F1B's, iteration by iteration.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gpu_check_report import ITERATION_RE, pytest_summary, read_steps  # noqa: E402

SKIP_ITERATIONS = 3  # start-up: allocation, the first traced iterations, cuDNN's plans
BASELINE = "1f1b"
RANK_PEAK_RE = re.compile(r"\[Rank (\d+)\] \(after \d+ iterations\) memory \(MB\) \| allocated: "
                          r"[0-9.]+ \| max allocated: ([0-9.]+)")
BUBBLE_RE = re.compile(r"^total\s.*\s([0-9.]+)%\s*$", re.MULTILINE)
NAME_RE = re.compile(r"^pp(\d+)-(packed|varlen)-(.+)$")


def run_figures(log_text: str, seq_length: int) -> dict:
    """A run's iterations (ms, global batch, lm loss each) and each rank's peak (MB)."""
    rows = [(float(ms), int(batch), float(loss)) for ms, batch, loss in ITERATION_RE.findall(log_text)]
    peaks = {int(rank): float(mb) for rank, mb in RANK_PEAK_RE.findall(log_text)}
    figures = {"ms": [ms for ms, _, _ in rows], "losses": [loss for _, _, loss in rows],
               "peak_mb_per_rank": [peaks[rank] for rank in sorted(peaks)]}
    steady = figures["ms"][SKIP_ITERATIONS:]
    if steady:
        figures["ms_per_iteration"] = statistics.median(steady)
        figures["tokens_per_s"] = rows[-1][1] * seq_length / (figures["ms_per_iteration"] / 1e3)
    return figures


def bubble(aggregate_text: str) -> Optional[float]:
    """The total bubble fraction of aggregate.py's per-rank table, None without one."""
    match = BUBBLE_RE.search(aggregate_text)
    return None if match is None else float(match.group(1)) / 100


def paired_ratio(mine: list[float], baseline: list[float]) -> Optional[dict]:
    """mine[i] / baseline[i] over the steady iterations both ran: median and quartiles."""
    ratios = [a / b for a, b in zip(mine[SKIP_ITERATIONS:], baseline[SKIP_ITERATIONS:])]
    if not ratios:
        return None
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {"median": statistics.median(ratios), "q1": quartiles[0], "q3": quartiles[2],
            "pairs": len(ratios)}


def loss_difference(mine: list[float], baseline: list[float]) -> Optional[float]:
    """The largest |mine - baseline| / |baseline| over the iterations both logged."""
    pairs = list(zip(mine, baseline))
    if not pairs or len(mine) != len(baseline):
        return None
    return max(abs(a - b) / abs(b) for a, b in pairs)


def summarize(output_dir: Path, seq_length: int) -> dict:
    steps = {step["name"]: step for step in read_steps(output_dir)}
    runs = []
    for name, step in steps.items():
        if not name.startswith("pipeline/"):
            continue
        run = name[len("pipeline/"):]
        log = output_dir / step["log"]
        figures = run_figures(log.read_text(errors="replace") if log.is_file() else "", seq_length)
        aggregate = steps.get(f"aggregate/{run}")
        aggregate_log = output_dir / aggregate["log"] if aggregate else None
        match = NAME_RE.match(run)
        runs.append({"name": run, "pp": int(match.group(1)) if match else None,
                     "data": match.group(2) if match else None,
                     "schedule": match.group(3) if match else None,
                     "passed": step["exit_status"] == 0,
                     "exit_status": step["exit_status"], "seconds": step["seconds"],
                     "aggregate_passed": aggregate is not None and aggregate["exit_status"] == 0,
                     "bubble": (bubble(aggregate_log.read_text(errors="replace"))
                                if aggregate_log is not None and aggregate_log.is_file() else None),
                     **figures})
    by_key = {(run["pp"], run["data"], run["schedule"]): run for run in runs}
    for run in runs:
        base = by_key.get((run["pp"], run["data"], BASELINE))
        usable = base is not None and base["passed"] and run["passed"]
        run["vs_1f1b"] = paired_ratio(run["ms"], base["ms"]) if usable else None
        run["loss_rel_diff"] = loss_difference(run["losses"], base["losses"]) if usable else None
    tests = steps.get("tests")
    tests_log = output_dir / tests["log"] if tests else None
    failed = [name for name, step in steps.items() if step["exit_status"] != 0]
    return {"runs": runs, "failed_steps": failed,
            "tests": None if tests is None else {
                "passed": tests["exit_status"] == 0, "seconds": tests["seconds"],
                "summary": pytest_summary(tests_log.read_text(errors="replace"))
                if tests_log is not None and tests_log.is_file() else ""}}


def _cell(value, form: str) -> str:
    return "-" if value is None else form.format(value)


def table_lines(summary: dict) -> list[str]:
    header = ["run", "status", "ms/iter", "tokens/s", "vs 1F1B (q1-q3)", "bubble",
              "peak MB per rank", "loss vs 1F1B"]
    rows = []
    for run in summary["runs"]:
        ratio = run["vs_1f1b"]
        status = "pass" if run["passed"] else f"FAIL ({run['exit_status']})"
        if run["passed"] and not run["aggregate_passed"]:
            status = "pass, aggregate FAIL"
        rows.append([
            run["name"], status, _cell(run.get("ms_per_iteration"), "{:.1f}"),
            _cell(run.get("tokens_per_s"), "{:.0f}"),
            "-" if ratio is None else f"{ratio['median']:.3f} ({ratio['q1']:.3f}-{ratio['q3']:.3f})",
            _cell(run["bubble"], "{:.1%}"),
            " ".join(f"{mb:.0f}" for mb in run["peak_mb_per_rank"]) or "-",
            _cell(run["loss_rel_diff"], "{:.1e}")])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return ["  ".join(cell.ljust(width) if i == 0 else cell.rjust(width)
                      for i, (cell, width) in enumerate(zip(row, widths))).rstrip()
            for row in [header, *rows]]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="_gpu_pipeline_report.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--seq-length", type=int, required=True,
                        help="the pipeline runs' --seq-length (tokens/s)")
    args = parser.parse_args(argv)
    if not (args.output_dir / "steps.tsv").is_file():
        parser.exit(2, f"{parser.prog}: no {args.output_dir / 'steps.tsv'}: not a gpu_check.sh "
                       f"output directory\n")
    summary = summarize(args.output_dir, args.seq_length)
    (args.output_dir / "pipeline.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"GPT pipeline on one GPU, ranks sharing it under MPS (ms/iter: median after the first "
          f"{SKIP_ITERATIONS} iterations; vs 1F1B: iteration times over 1F1B's of the same pp and "
          f"data, batch by batch; loss vs 1F1B: the largest relative difference):")
    for line in table_lines(summary):
        print(line)
    tests = summary["tests"]
    if tests is not None:
        print(f"tests: {'pass' if tests['passed'] else 'FAIL'} in {tests['seconds']} s: "
              f"{tests['summary'] or 'no pytest summary line'}")
    if summary["failed_steps"]:
        print("failed steps: " + ", ".join(summary["failed_steps"]))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
