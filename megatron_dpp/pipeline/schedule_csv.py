"""Per-rank orders in torch's schedule CSV (torch.distributed.pipelining's `_dump_csv` and
`_load_csv`, compute-only form): one row per rank, one cell per action, in the order the rank runs
them; a cell is GLOBAL stage, action, microbatch: `0F0` is stage 0's forward of microbatch 0,
`5B2` stage 5's full backward of microbatch 2, `3I1` / `3W1` stage 3's input and weight gradient.
Empty cells (torch's idle steps) are skipped.

Our tasks name a LOCAL chunk, so the file also carries the placement: the rank of each stage is
the row its actions are in (`from_stage_ranks`), as torch infers it from a schedule. A fused
backward (our B on a graph that does not split backwards) is torch's B; a split one is our B then
W, torch's I then W.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import re
from typing import Sequence

from megatron_dpp.pipeline.graph import TaskGraph
from megatron_dpp.pipeline.placement import Placement, from_stage_ranks
from megatron_dpp.pipeline.scheduler import StaticOrderScheduler
from megatron_dpp.pipeline.task import Phase, Task

_CELL = re.compile(r"(\d+)([FIWB])(\d+)")
FULL_BACKWARD, INPUT_GRAD, WEIGHT_GRAD, FORWARD = "B", "I", "W", "F"


@dataclasses.dataclass(frozen=True)
class ScheduleFile:
    """What a schedule CSV says: where the stages are, and what each rank runs in which order."""

    placement: Placement
    """The rank of each stage: the row its actions are in."""

    split_backward: bool
    """True when the backwards are I and W cells, False when they are full backwards (B)."""

    num_microbatches: int
    """M: every stage runs microbatches 0..M-1."""

    orders: tuple[tuple[Task, ...], ...]
    """orders[rank]: the rank's tasks in order, with local chunks."""

    def task_graph(self, **options) -> TaskGraph:
        """The TaskGraph these orders run on (options: sizes, act_bytes, max_act_bytes)."""
        return TaskGraph(self.placement.P, self.placement.V, self.num_microbatches,
                         split_backward=self.split_backward, placement=self.placement, **options)

    def mismatch(self, P: int, V: int, M: int, split_backward: bool,
                 placement: Placement) -> str | None:
        """What of a run's pipeline the file does not fit, in words; None where it fits."""
        if (self.placement.P, self.placement.V) != (P, V):
            return (f"its stages are {self.placement.P} ranks x {self.placement.V} chunks, the run "
                    f"has {P} x {V}")
        if self.placement != placement:
            return f"its placement is {self.placement}, the run's {placement}"
        if self.num_microbatches != M:
            return f"it runs {self.num_microbatches} microbatches, the run {M} per iteration"
        if self.split_backward != split_backward:
            return ("its backwards are split (I and W cells)" if self.split_backward else
                    "its backwards are full (B cells)") + (
                ", the run's are not (add --dpp-split-backward)" if self.split_backward
                else ", the run's are split (drop --dpp-split-backward)")
        return None

    def scheduler(self, graph: TaskGraph, rank: int, budget_bytes: int,
                  name: str = "schedule file") -> StaticOrderScheduler:
        """Rank `rank`'s scheduler: its row, as listed (ValueError where the graph does not fit)."""
        problem = self.mismatch(graph.P, graph.V, graph.M, graph.split_backward, graph.placement)
        if problem is not None:
            raise ValueError(f"{name}: {problem}")
        return StaticOrderScheduler(name, graph, rank, budget_bytes, list(range(graph.M)),
                                    self.orders[rank])


def format_schedule_csv(graph: TaskGraph, orders: Sequence[Sequence[Task]]) -> str:
    """orders[rank] (every rank's task list on `graph`) as torch's schedule CSV."""
    if len(orders) != graph.P:
        raise ValueError(f"schedule csv: {len(orders)} orders for P={graph.P} ranks")
    backward = INPUT_GRAD if graph.split_backward else FULL_BACKWARD
    letters = {Phase.F: FORWARD, Phase.B: backward, Phase.W: WEIGHT_GRAD}
    text = io.StringIO()
    writer = csv.writer(text)  # torch's _dump_csv: the csv module's default dialect
    for rank, tasks in enumerate(orders):
        writer.writerow([f"{graph.virtual_stage(rank, task.chunk)}{letters[task.phase]}{task.microbatch}"
                         for task in tasks])
    return text.getvalue()


def parse_schedule_csv(text: str) -> ScheduleFile:
    """The ScheduleFile a schedule CSV describes; ValueError (one line) where a cell is not a
    compute action, a stage's actions are on two ranks, backwards mix B with I/W, or a stage's
    actions do not cover every microbatch once."""
    rows = [[cell.strip() for cell in row] for row in csv.reader(io.StringIO(text))]
    actions = []  # (rank, stage, letter, microbatch)
    for rank, row in enumerate(rows):
        for cell in row:
            if not cell:
                continue  # an idle step
            match = _CELL.fullmatch(cell)
            if match is None:
                raise ValueError(f"schedule csv: rank {rank} cell {cell!r} is not a compute action "
                                 "(stage, F/I/W/B, microbatch, e.g. '0F0'); write the compute-only form")
            stage, letter, microbatch = match.groups()
            actions.append((rank, int(stage), letter, int(microbatch)))
    if not actions:
        raise ValueError("schedule csv: no actions")
    stage_rank: dict[int, int] = {}
    for rank, stage, _, _ in actions:
        if stage_rank.setdefault(stage, rank) != rank:
            raise ValueError(f"schedule csv: stage {stage} has actions on ranks {stage_rank[stage]} and {rank}")
    num_stages = max(stage_rank) + 1
    missing = sorted(set(range(num_stages)) - set(stage_rank))
    if missing:
        raise ValueError(f"schedule csv: stages {missing} have no actions")
    if len(rows) != max(stage_rank.values()) + 1:
        raise ValueError(f"schedule csv: {len(rows)} rows but stages on ranks 0..{max(stage_rank.values())}")
    placement = from_stage_ranks(stage_rank[s] for s in range(num_stages))
    letters = {letter for _, _, letter, _ in actions}
    if FULL_BACKWARD in letters and letters & {INPUT_GRAD, WEIGHT_GRAD}:
        raise ValueError("schedule csv: backwards mix full backwards (B) with split ones (I, W)")
    split = bool(letters & {INPUT_GRAD, WEIGHT_GRAD})
    phases = {FORWARD: Phase.F, FULL_BACKWARD: Phase.B, INPUT_GRAD: Phase.B, WEIGHT_GRAD: Phase.W}
    num_microbatches = max(m for _, _, _, m in actions) + 1
    expected = (3 if split else 2) * num_stages * num_microbatches
    seen = {(stage, phases[letter], m) for _, stage, letter, m in actions}
    if len(seen) != len(actions) or len(actions) != expected:
        raise ValueError(f"schedule csv: {len(actions)} actions ({len(seen)} distinct), expected each "
                         f"of {num_stages} stages x {num_microbatches} microbatches x "
                         f"{'F, I, W' if split else 'F, B'} once")
    orders = [[] for _ in range(placement.P)]
    for rank, stage, letter, m in actions:
        orders[rank].append(Task(phases[letter], m, placement.location(stage)[1]))
    return ScheduleFile(placement, split, num_microbatches, tuple(tuple(order) for order in orders))


def write_schedule_csv(path: str, graph: TaskGraph, orders: Sequence[Sequence[Task]]) -> None:
    with open(path, "w", newline="") as file:
        file.write(format_schedule_csv(graph, orders))


def read_schedule_csv(path: str) -> ScheduleFile:
    with open(path, newline="") as file:
        return parse_schedule_csv(file.read())
