"""The printed tables (times in ms): where each rank's time went, each iteration against its
critical path, the comparison of two runs, and the replay."""
from __future__ import annotations

from statistics import mean
from typing import List, Sequence

from trace_analysis.analysis import IDLE_GROUPS, IterationTime, StepTime, per_rank_totals, total
from trace_analysis.critical_path import CriticalPath
from trace_analysis.replay import Replay
from trace_analysis.timeline import RunTimeline

US_PER_MS = 1000.0


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell: the first left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _ms(microseconds: float) -> str:
    return f"{microseconds / US_PER_MS:.1f}"


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.1f}%"


def rank_table(run: RunTimeline, iterations: List[IterationTime]) -> str:
    """Per rank and in total, summed over the iterations: busy, idle by reason, bubble fraction."""
    totals = per_rank_totals(iterations)
    header = ["rank", "busy", *IDLE_GROUPS, "bubble"]
    rows = [[rank.label, _ms(time.busy), *(_ms(time.idle[g]) for g in IDLE_GROUPS), _percent(time.bubble)]
            for rank, time in zip(run.ranks, totals)]
    summed = total(totals)
    rows.append(["total", _ms(summed.busy), *(_ms(summed.idle[g]) for g in IDLE_GROUPS),
                 _percent(summed.bubble)])
    return table(header, rows)


def step_table(run: RunTimeline, steps: List[StepTime]) -> str:
    """Per rank, mean ms per iteration: the whole training step and its parts."""
    header = ["rank", "step", "tasks", "gradient sync", "optimizer step", "other collectives", "rest"]
    rows = [[rank.label, _ms(s.step), _ms(s.tasks), _ms(s.gradient_sync), _ms(s.optimizer),
             _ms(s.collectives), _ms(s.rest)] for rank, s in zip(run.ranks, steps)]
    return table(header, rows)


def iteration_table(iterations: List[IterationTime], paths: List[CriticalPath]) -> str:
    header = ["iteration", "time", "critical path", "time / critical path", "bubble"]
    rows = [[str(it.iteration), _ms(it.duration), _ms(path.length), f"{it.duration / path.length:.2f}",
             _percent(it.bubble)] for it, path in zip(iterations, paths)]
    if len(iterations) > 1:
        time, length = mean(it.duration for it in iterations), mean(p.length for p in paths)
        rows.append(["mean", _ms(time), _ms(length), f"{time / length:.2f}",
                     _percent(total([r for it in iterations for r in it.ranks]).bubble)])
    return table(header, rows)


def critical_path_line(iteration: int, path: CriticalPath) -> str:
    """The chain as runs of tasks per rank: rank 0: F1.0 | rank 1: F1.0 B1.0 | rank 0: B1.0."""
    runs: List[List[str]] = []
    last_rank = None
    for task in path.tasks:
        if task.rank != last_rank:
            runs.append([f"rank {task.rank}:"])
            last_rank = task.rank
        runs[-1].append(task.name)
    chain = " | ".join(" ".join(run) for run in runs)
    return f"critical path of iteration {iteration} ({_ms(path.length)} ms, {len(path.tasks)} tasks): {chain}"


def compare_table(name_a: str, a: List[IterationTime], name_b: str, b: List[IterationTime]) -> str:
    header = ["iteration", "time A", "time B", "B / A", "bubble A", "bubble B", "B / A"]
    rows = []
    for x, y in zip(a, b):
        rows.append([str(x.iteration), _ms(x.duration), _ms(y.duration), f"{y.duration / x.duration:.2f}",
                     _percent(x.bubble), _percent(y.bubble), _ratio(y.bubble, x.bubble)])
    time_a, time_b = mean(x.duration for x in a), mean(y.duration for y in b)
    bubble_a = total([r for x in a for r in x.ranks]).bubble
    bubble_b = total([r for y in b for r in y.ranks]).bubble
    rows.append(["mean", _ms(time_a), _ms(time_b), f"{time_b / time_a:.2f}", _percent(bubble_a),
                 _percent(bubble_b), _ratio(bubble_b, bubble_a)])
    return f"A = {name_a}\nB = {name_b}\n" + table(header, rows)


def _ratio(numerator: float, denominator: float) -> str:
    return f"{numerator / denominator:.2f}" if denominator > 0 else "-"


def replay_table(replay: Replay, policy_that_ran: str) -> str:
    measured = mean(replay.measured)
    ran = next((p for p in replay.policies if p.policy == policy_that_ran and not p.problem), None)

    def over_ran(time: float) -> str:
        return f"{time / mean(ran.makespans):.2f}" if ran else "-"

    header = ["policy", "ms per iteration", "/ measured", f"/ {policy_that_ran} replayed"]
    rows = [["measured (what ran)", f"{measured:.1f}", "1.00", over_ran(measured)]]
    for policy in replay.policies:
        marker = " *" if policy.policy == policy_that_ran else ""
        if policy.problem:
            rows.append([policy.policy + marker, "-", "-", "-"])
            continue
        time = mean(policy.makespans)
        rows.append([policy.policy + marker, f"{time:.1f}", f"{time / measured:.2f}", over_ran(time)])
    notes = [f"* the policy that ran; {note}" if i == 0 else f"  {note}" for i, note in enumerate(replay.notes)]
    notes += [f"  {p.policy}: not replayed ({p.problem})" for p in replay.policies if p.problem]
    return table(header, rows) + "\n" + "\n".join(notes)
