"""The PNG plots (matplotlib with the Agg backend: no display needed).

  <run>-timeline.png                   one iteration, a row per rank: F, B, W coloured, idle grey
  <run>-bubble.png                     bubble fraction per rank (and in total) per iteration
  <run>-vs-<other>-timeline.png        the same iteration of both runs, one above the other
  <run>-vs-<other>-iterations.png      iteration time and bubble fraction of both runs
"""
from __future__ import annotations

from pathlib import Path
from typing import List

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
from matplotlib.patches import Patch  # noqa: E402

from trace_analysis.analysis import IterationTime, total  # noqa: E402
from trace_analysis.timeline import RunTimeline  # noqa: E402

PHASE_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
PHASE_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient"}
IDLE_COLOUR = "#d0d0d0"
US_PER_MS = 1000.0


def _gantt(axes, run: RunTimeline, iteration: IterationTime, title: str) -> None:
    """One row per rank over the iteration's window (ms from its start): idle grey underneath,
    each task on top in its phase's colour, labelled when there is room."""
    start, width = iteration.start, iteration.duration / US_PER_MS
    for row, rank in enumerate(run.ranks):
        axes.broken_barh([(0.0, width)], (row - 0.4, 0.8), color=IDLE_COLOUR)
        for task in rank.tasks_of(iteration.iteration):
            left, length = (task.start - start) / US_PER_MS, task.duration / US_PER_MS
            axes.broken_barh([(left, length)], (row - 0.4, 0.8), color=PHASE_COLOURS[task.phase],
                             edgecolor="white", linewidth=0.5)
            if length > width / 40:
                axes.text(left + length / 2, row, task.name, ha="center", va="center", fontsize=6,
                          color="white")
    axes.set_yticks(range(len(run.ranks)), [f"rank {r.rank} (pp {r.pipeline_rank})" for r in run.ranks])
    axes.set_ylim(len(run.ranks) - 0.5, -0.5)  # rank 0 on top
    axes.set_xlim(0.0, width)
    axes.set_title(title, fontsize=9)


def _title(run: RunTimeline, iteration: IterationTime) -> str:
    return (f"{run.name} ({run.policy}): iteration {iteration.iteration} "
            f"({iteration.duration / US_PER_MS:.1f} ms, bubble {100 * iteration.bubble:.1f}%)")


def _legend(figure, run_phases: set) -> None:
    handles = [Patch(color=PHASE_COLOURS[p], label=PHASE_NAMES[p]) for p in "FBW" if p in run_phases]
    handles.append(Patch(color=IDLE_COLOUR, label="idle"))
    figure.legend(handles=handles, loc="upper right", fontsize=7, ncol=len(handles))


def _phases(run: RunTimeline) -> set:
    return {task.phase for rank in run.ranks for task in rank.tasks}


def timeline_plot(run: RunTimeline, iteration: IterationTime, path: Path) -> Path:
    figure, axes = plt.subplots(figsize=(12, 1.0 + 0.6 * len(run.ranks)))
    _gantt(axes, run, iteration, _title(run, iteration))
    axes.set_xlabel("ms since the iteration's first task")
    _legend(figure, _phases(run))
    return _save(figure, path)


def bubble_plot(run: RunTimeline, iterations: List[IterationTime], path: Path) -> Path:
    figure, axes = plt.subplots(figsize=(8, 4))
    numbers = [it.iteration for it in iterations]
    for index, rank in enumerate(run.ranks):
        axes.plot(numbers, [it.ranks[index].bubble for it in iterations], marker="o",
                  label=f"rank {rank.rank}")
    axes.plot(numbers, [it.bubble for it in iterations], marker="s", linestyle="--", color="black",
              label="all ranks")
    _bubble_axes(axes, numbers)
    axes.set_title(f"{run.name}: bubble fraction per rank", fontsize=9)
    axes.legend(fontsize=7)
    return _save(figure, path)


def compare_timeline_plot(run_a: RunTimeline, a: IterationTime, run_b: RunTimeline, b: IterationTime,
                          path: Path) -> Path:
    """Both runs' iteration on one time axis, so their lengths compare at a glance."""
    figure, (top, bottom) = plt.subplots(2, 1, sharex=True,
                                         figsize=(12, 1.5 + 0.6 * (len(run_a.ranks) + len(run_b.ranks))))
    for axes, run, it in ((top, run_a, a), (bottom, run_b, b)):
        _gantt(axes, run, it, _title(run, it))
    top.set_xlim(0.0, max(a.duration, b.duration) / US_PER_MS)
    bottom.set_xlabel("ms since the iteration's first task")
    _legend(figure, _phases(run_a) | _phases(run_b))
    return _save(figure, path)


def compare_iterations_plot(run_a: RunTimeline, a: List[IterationTime], run_b: RunTimeline,
                            b: List[IterationTime], path: Path) -> Path:
    figure, (times, bubbles) = plt.subplots(1, 2, figsize=(12, 4))
    numbers = [it.iteration for it in a]
    for run, its, marker in ((run_a, a, "o"), (run_b, b, "s")):
        label = f"{run.name} ({run.policy})"
        times.plot(numbers, [it.duration / US_PER_MS for it in its], marker=marker, label=label)
        bubbles.plot(numbers, [total(it.ranks).bubble for it in its], marker=marker, label=label)
    times.set_xlabel("iteration")
    times.set_ylabel("ms (first task to last task)")
    times.set_xticks(numbers)
    times.set_ylim(bottom=0)
    times.set_title("iteration time", fontsize=9)
    _bubble_axes(bubbles, numbers)
    bubbles.set_title("bubble fraction, all ranks", fontsize=9)
    for axes in (times, bubbles):
        axes.legend(fontsize=7)
    return _save(figure, path)


def _bubble_axes(axes, numbers: List[int]) -> None:
    axes.set_xlabel("iteration")
    axes.set_ylabel("bubble fraction (idle / iteration time)")
    axes.set_xticks(numbers)
    axes.set_ylim(0.0, 1.0)


def _save(figure, path: Path) -> Path:
    figure.tight_layout(rect=(0.0, 0.0, 1.0, 0.94))  # the top strip keeps the legend off the titles
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
