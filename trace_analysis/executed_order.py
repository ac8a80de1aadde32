"""The order each pipeline rank ran an iteration's tasks in, as torch's schedule CSV
(pipeline/schedule_csv.py): what `--dpp-schedule FILE` runs again, and what torch's
`_PipelineScheduleRuntime` loads. Taken from one rank per pipeline stage (tensor and data rank 0):
the others of its tensor-parallel group ran the same order, its data-parallel replicas their own."""
from __future__ import annotations

from pathlib import Path

from megatron_dpp.pipeline import Phase, Task, TaskGraph
from megatron_dpp.pipeline.schedule_csv import format_schedule_csv
from trace_analysis.load import TraceInputError
from trace_analysis.replay import replayed_pipeline
from trace_analysis.timeline import RunTimeline


def executed_order_csv(run: RunTimeline, iteration: int) -> str:
    """Iteration `iteration`'s executed order, one row per pipeline rank, in its run's placement."""
    pipeline = replayed_pipeline(run)
    per_rank = [sorted(rank.tasks_of(iteration), key=lambda task: task.start) for rank in pipeline]
    everything = [task for tasks in per_rank for task in tasks]
    if not everything:
        raise TraceInputError(f"iteration {iteration} has no tasks")
    graph = TaskGraph(len(pipeline), 1 + max(task.chunk for task in everything),
                      1 + max(task.microbatch for task in everything),
                      split_backward=any(task.phase == "W" for task in everything),
                      placement=run.placement())
    orders = [[Task(Phase[task.phase], task.microbatch, task.chunk) for task in tasks]
              for tasks in per_rank]
    return format_schedule_csv(graph, orders)


def write_executed_orders(run: RunTimeline, iterations: list[int], directory: Path) -> list[Path]:
    """RUN-order-iteration<I>.csv in `directory` for each iteration; the paths written."""
    written = []
    for iteration in iterations:
        path = directory / f"{run.name}-order-iteration{iteration}.csv"
        path.write_text(executed_order_csv(run, iteration))
        written.append(path)
    return written
