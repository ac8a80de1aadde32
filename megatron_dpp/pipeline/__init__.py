"""The pure pipeline core (standard library only): tasks, the task graph, the ready rule, budgets,
policies and their one registry, static orders. The simulator (megatron_dpp.sim) and the runtime
(megatron_dpp.runtime) both drive these objects, so one policy decides the same way in both.

Interface (stable names):

- `Phase` (IntEnum: F, B, W) and `Task(phase, microbatch, chunk)`, a hashable tuple that prints
  and parses back: `str(Task(Phase.F, 3, 1)) == "F3.1"`, `Task.parse("F3.1")`.
  `chunk` is the LOCAL model chunk on the rank (0..V-1); the graph's Placement says which
  virtual stage it is (interleaved: chunk*P + rank).
  `microbatch` is always the index into the global batch as the data iterator yields it.
- `Placement` (placement.py): which rank holds each virtual stage, as data; `interleaved(P, V)`
  (Megatron's, the default), `v_shape(P)` (ZB-V's), `from_stage_ranks(ranks)`; `stage(rank,
  chunk)`, `location(stage)`, `first_stage`, `last_stage`, neighbours. Nothing else computes
  stage positions.
- `TaskGraph(P, V, M, sizes, act_bytes, max_act_bytes=None, split_backward=False, placement=None)`: sizes[m] =
  relative work of microbatch m; act_bytes[m] = bytes one forward of m holds on ONE chunk until
  its backward ends; max_act_bytes = the largest a batch can contain (default: this batch's
  largest). split_backward: each backward is B (input gradient, sent on) plus a local W (weight
  gradient), and activations are held until W ends (the simulator, and the runtime with
  --dpp-split-backward).
  `tasks(rank)`, `input_source(rank, task)` and `output_target(rank, task)` -> (rank, Task) | None.
- `ReadyTracker(graph, rank, forward_only=False)`: the one ready rule (see ready.py); executors
  report `input_arrived`, `start`, `finish` and pass its `ready` set to `next_task`.
- `make_scheduler(name, graph, rank, budget_bytes=None, **opts) -> RankScheduler`, names in
  `SCHEDULE_NAMES` (registry.py, the only place they are spelled): gpipe, 1f1b (V=1),
  interleaved-1f1b (V>1), 1f1b-sorted (Megatron's order over dpp:adaptive's size-sorted microbatch
  order), dpp:adaptive (`DEFAULT_POLICY`), dpp:breadth-first, dpp:depth-first, dpp:greedy; on
  the v placement also zb-v (`V_PLACEMENT_SCHEDULES`, ZB-V's order; the runtime runs both named
  placements, `PLACEMENT_NAMES`, --dpp-stage-placement). `check_policy_placement(name, placement)` refuses, in one line, a
  policy whose order assumes another placement.
  Options: microbatch_group_size_per_vp_stage (interleaved group size, default P; also sets
  dpp:adaptive's spine and the V>1 default budget), max_inflight (dpp:*: admit by a count of held
  chunk activations instead of bytes), sort_microbatches (dpp:breadth-first/depth-first/greedy:
  largest first). budget_bytes=None (or 'auto'): `default_budget_bytes(graph, rank)` = what 1F1B
  (interleaved for V>1; ZB-V on the v placement) holds at most on that rank, counted at
  max_act_bytes per forward;
  'provisioned' (`PROVISIONED_BUDGET`): `provisioned_budget_bytes(graph)` = what it holds at most
  on its fullest rank (rank 0), the same count on every rank; an int: that many bytes.
  `RelativeBudget(k)` ('1.25x'): k times the provisioned budget on every rank, k >= 1.
  `parse_memory_budget(text)` reads a budget as users write it ('auto', 'provisioned', '1.25x',
  '2GiB', '1073741824').
- `RankScheduler`: `name` (the policy chosen), `strategy` (None, or how it runs when that is not
  the policy's usual way), `microbatch_order` (same list on every rank: a pure function of sizes,
  P, V, M and the policy), `next_task(ready) -> Task | None` (None: wait for an arrival; a static
  order returns its next listed task iff it is ready), `on_start(task)`, `on_finish(task)`, `done`,
  `held_bytes`, `budget_bytes`, `peak_bytes`, `log` (its RunLog), `history` (the tasks started,
  in order, read from `log`).
  One task runs at a time per rank: call next_task when idle, on_start before running the
  returned task, on_finish when it completes. Activations count as held from on_start(F) to
  on_finish(B), or on_finish(W) with split backwards.
- `RunLog` (run_log.py): the one record of what a rank ran, in order (`RanTask(task, started,
  ended, turn_seconds)` entries, and the count finished). Each scheduler keeps one (`log`, written
  by on_start/on_finish); `history` and `done` read it, and the runtime writes its task times into
  the same entries, which its iteration record and trace read.
"""
from megatron_dpp.pipeline.budget import (
    AUTO_BUDGET,
    BUDGET_MODES,
    PROVISIONED_BUDGET,
    MemoryBudget,
    RelativeBudget,
    budget_bytes_for,
    check_memory_budget,
    default_budget_bytes,
    megatron_inflight_forwards,
    parse_memory_budget,
    provisioned_budget_bytes,
    provisioned_inflight_forwards,
)
from megatron_dpp.pipeline.graph import TaskGraph
from megatron_dpp.pipeline.placement import Placement, from_stage_ranks, interleaved, parse_placement, v_shape
from megatron_dpp.pipeline.ready import ReadyTracker
from megatron_dpp.pipeline.run_log import RanTask, RunLog
from megatron_dpp.pipeline.registry import (
    DEFAULT_POLICY,
    DYNAMIC_SCHEDULES,
    SCHEDULE_NAMES,
    STATIC_SCHEDULES,
    V_PLACEMENT_SCHEDULES,
    check_policy_layout,
    check_policy_placement,
    make_scheduler,
    size_sorted_order,
)
from megatron_dpp.pipeline.scheduler import PairedReceiveScheduler, RankScheduler, StaticOrderScheduler
from megatron_dpp.pipeline.task import Phase, Task, format_tasks, parse_tasks

__all__ = [
    "AUTO_BUDGET",
    "BUDGET_MODES",
    "DEFAULT_POLICY",
    "DYNAMIC_SCHEDULES",
    "MemoryBudget",
    "PROVISIONED_BUDGET",
    "RelativeBudget",
    "PairedReceiveScheduler",
    "Placement",
    "Phase",
    "RanTask",
    "RankScheduler",
    "ReadyTracker",
    "RunLog",
    "SCHEDULE_NAMES",
    "STATIC_SCHEDULES",
    "StaticOrderScheduler",
    "Task",
    "TaskGraph",
    "budget_bytes_for",
    "check_memory_budget",
    "V_PLACEMENT_SCHEDULES",
    "check_policy_layout",
    "check_policy_placement",
    "default_budget_bytes",
    "format_tasks",
    "from_stage_ranks",
    "interleaved",
    "make_scheduler",
    "megatron_inflight_forwards",
    "parse_memory_budget",
    "parse_placement",
    "parse_tasks",
    "provisioned_budget_bytes",
    "provisioned_inflight_forwards",
    "size_sorted_order",
    "v_shape",
]
