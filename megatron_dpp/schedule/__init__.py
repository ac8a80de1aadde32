"""Scheduler core: the schedule IR, static orders and dynamic policies, shared by the simulator
(megatron_dpp.sim) and the real runtime (forward_backward_dpp).

Interface (stable names):

- `Phase` (IntEnum: F, B, W) and `Task(phase, microbatch, chunk)`, a hashable tuple.
  `chunk` is the LOCAL model chunk on the rank (0..V-1); its virtual stage is chunk*P + rank.
  `microbatch` is always the index into the global batch as the data iterator yields it.
- `TaskGraph(P, V, M, sizes, act_bytes, max_act_bytes=None, split_backward=False)`: sizes[m] =
  relative work of microbatch m; act_bytes[m] = bytes one forward of m holds on ONE chunk until
  its backward ends; max_act_bytes = the largest a batch can contain (default: this batch's
  largest). split_backward: each backward is B (input gradient, sent on) plus a local W (weight
  gradient), and activations are held until W ends; only the simulator runs such graphs.
  `tasks(rank)`, `input_source(rank, task)` and `output_target(rank, task)` -> (rank, Task) | None.
- Ready set (what an executor passes to next_task): F(m,c) is ready when its input has arrived (or
  it is virtual stage 0) and it has not run; B(m,c) is ready when F(m,c) ran on this rank and its
  output gradient has arrived (or it is the last virtual stage), and it has not run; W(m,c) is
  ready when B(m,c) ran on this rank, and it has not run.
- `make_scheduler(name, graph, rank, budget_bytes=None, **opts) -> RankScheduler`, names in
  `SCHEDULE_NAMES`: gpipe, 1f1b (V=1), interleaved-1f1b (V>1), 1f1b-sorted (Megatron's order over
  dpp:adaptive's size-sorted microbatch order), dpp:adaptive (the default policy),
  dpp:breadth-first, dpp:depth-first, dpp:greedy. Options: microbatch_group_size_per_vp_stage
  (interleaved group size, default P; also sets dpp:adaptive's spine and the V>1 default budget),
  max_inflight (dpp:*: admit by a count of held chunk activations instead of bytes),
  sort_microbatches (dpp:breadth-first/depth-first/greedy: largest first).
  budget_bytes=None: `default_budget_bytes(graph, rank)` = what 1F1B (interleaved for V>1) holds at
  most on that rank, counted at max_act_bytes per forward.
- `RankScheduler`: `microbatch_order` (same list on every rank: a pure function of sizes, P, V, M
  and the policy), `next_task(ready) -> Task | None` (None: wait for an arrival; a static order
  returns its next listed task iff it is ready), `on_start(task)`, `on_finish(task)`, `done`,
  `held_bytes`, `budget_bytes`, `peak_bytes`, `history`.
  One task runs at a time per rank: call next_task when idle, on_start before running the
  returned task, on_finish when it completes. Activations count as held from on_start(F) to
  on_finish(B), or on_finish(W) with split backwards.
"""
from megatron_dpp.schedule.graph import Phase, Task, TaskGraph
from megatron_dpp.schedule.registry import (
    DYNAMIC_SCHEDULES,
    SCHEDULE_NAMES,
    STATIC_SCHEDULES,
    default_budget_bytes,
    make_scheduler,
    megatron_inflight_forwards,
    size_sorted_order,
)
from megatron_dpp.schedule.scheduler import RankScheduler, StaticOrderScheduler

DEFAULT_POLICY = "dpp:adaptive"

__all__ = [
    "DEFAULT_POLICY",
    "DYNAMIC_SCHEDULES",
    "Phase",
    "RankScheduler",
    "SCHEDULE_NAMES",
    "STATIC_SCHEDULES",
    "StaticOrderScheduler",
    "Task",
    "TaskGraph",
    "default_budget_bytes",
    "make_scheduler",
    "megatron_inflight_forwards",
    "size_sorted_order",
]
