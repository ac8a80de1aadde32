"""The schedule IR: tasks of a pipeline-parallel step and the dependencies between them.

P pipeline ranks hold V model chunks each; a Placement (pipeline/placement.py) says which virtual
stage each chunk is. A microbatch's forward visits the stages 0, 1, ..., S-1 and its backward runs
the same path in reverse. The default is Megatron's interleaved placement (chunk c on rank r is
stage c*P + r): the forward visits ranks 0..P-1 with chunk 0, then 0..P-1 with chunk 1, ...
"""
from __future__ import annotations

from typing import Sequence

from megatron_dpp.pipeline.placement import INTERLEAVED, Placement, interleaved
from megatron_dpp.pipeline.task import Phase, Task


class TaskGraph:
    """Tasks and dependencies of one global batch on P ranks x V chunks x M microbatches.

    sizes[m]: relative work of microbatch m (e.g. its token count).
    act_bytes[m]: activation bytes one forward of m holds on ONE chunk until its backward finishes
        (default: sizes rounded to int).
    max_act_bytes: activation bytes of the largest microbatch a batch can contain; budgets are
        provisioned for it (default: the largest of this batch).
    split_backward: each backward is two tasks, B (input gradient, sent to the previous stage)
        and W (weight gradient, local, after B). Activations are then held until W ends, since
        W still needs the layer inputs. The simulator and the runtime (--dpp-split-backward,
        megatron_dpp.runtime) execute such graphs.
    placement: which virtual stage each (rank, chunk) is (default: interleaved(P, V)); it must
        have P ranks and V chunks per rank.
    """

    def __init__(
        self,
        P: int,
        V: int,
        M: int,
        sizes: Sequence[float] | None = None,
        act_bytes: Sequence[int] | None = None,
        max_act_bytes: int | None = None,
        split_backward: bool = False,
        placement: Placement | None = None,
    ):
        if P < 1 or V < 1 or M < 1:
            raise ValueError(f"TaskGraph needs P, V, M >= 1, got P={P} V={V} M={M}")
        sizes = [1.0] * M if sizes is None else [float(s) for s in sizes]
        if len(sizes) != M:
            raise ValueError(f"TaskGraph: len(sizes)={len(sizes)} but M={M}")
        if any(s <= 0 for s in sizes):
            raise ValueError("TaskGraph: every microbatch size must be > 0")
        if act_bytes is None:
            act_bytes = [max(1, int(round(s))) for s in sizes]
        act_bytes = [int(a) for a in act_bytes]
        if len(act_bytes) != M:
            raise ValueError(f"TaskGraph: len(act_bytes)={len(act_bytes)} but M={M}")
        if any(a < 0 for a in act_bytes):
            raise ValueError("TaskGraph: act_bytes must be >= 0")
        largest = max(act_bytes)
        if max_act_bytes is None:
            max_act_bytes = largest
        if max_act_bytes < largest:
            raise ValueError(
                f"TaskGraph: max_act_bytes={max_act_bytes} is below this batch's largest "
                f"act_bytes={largest}"
            )
        if placement is None:
            placement = interleaved(P, V)
        if (placement.P, placement.V) != (P, V):
            raise ValueError(f"TaskGraph: placement {placement} has P={placement.P}, V={placement.V}, "
                             f"the graph P={P}, V={V}")
        self.placement = placement
        self.P, self.V, self.M = P, V, M
        self.sizes = sizes
        self.act_bytes = act_bytes
        self.max_act_bytes = int(max_act_bytes)
        self.num_stages = P * V
        self.split_backward = bool(split_backward)
        self.phases = (Phase.F, Phase.B, Phase.W) if self.split_backward else (Phase.F, Phase.B)
        # The task whose end frees a forward's activations.
        self.release_phase = Phase.W if self.split_backward else Phase.B

    # --- layout -------------------------------------------------------------------------------
    def virtual_stage(self, rank: int, chunk: int) -> int:
        return self.placement.stage(rank, chunk)

    def stage_location(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) that holds virtual stage `stage`."""
        return self.placement.location(stage)

    # --- tasks and edges ----------------------------------------------------------------------
    @property
    def task_table(self) -> list[list[list[Task]]]:
        """task_table[phase][chunk][m] is Task(phase, m, chunk): one shared object per task, so
        schedulers of many ranks (and the simulator's hot loop) do not rebuild them."""
        table = self.__dict__.get("_task_table")
        if table is None:
            table = [
                [[Task(phase, m, c) for m in range(self.M)] for c in range(self.V)]
                for phase in self.phases
            ]
            self.__dict__["_task_table"] = table
        return table

    def tasks(self, rank: int) -> list[Task]:
        """Every task rank `rank` runs in one global batch (unordered)."""
        return [
            Task(phase, m, c)
            for phase in self.phases
            for c in range(self.V)
            for m in range(self.M)
        ]

    def input_source(self, rank: int, task: Task) -> tuple[int, Task] | None:
        """Where `task`'s input comes from: F reads the previous virtual stage's F output, B the
        next virtual stage's B output (its input gradient). None at the ends of the pipeline, and
        for W, whose only dependency is its own B on this rank."""
        if task.phase == Phase.W:
            return None
        stage = self.placement.stage(rank, task.chunk)
        placement = self.placement
        other = placement.previous_stage(stage) if task.phase == Phase.F else placement.next_stage(stage)
        if other is None:
            return None
        src_rank, src_chunk = self.stage_location(other)
        return src_rank, Task(task.phase, task.microbatch, src_chunk)

    def output_target(self, rank: int, task: Task) -> tuple[int, Task] | None:
        """Where `task`'s output goes: F to the next virtual stage's F, B to the previous virtual
        stage's B. None at the ends of the pipeline, and for W (it only updates weight grads)."""
        if task.phase == Phase.W:
            return None
        stage = self.placement.stage(rank, task.chunk)
        placement = self.placement
        other = placement.next_stage(stage) if task.phase == Phase.F else placement.previous_stage(stage)
        if other is None:
            return None
        dst_rank, dst_chunk = self.stage_location(other)
        return dst_rank, Task(task.phase, task.microbatch, dst_chunk)

    def __repr__(self) -> str:
        split = ", split_backward=True" if self.split_backward else ""
        placement = "" if self.placement.name == INTERLEAVED else f", placement={self.placement}"
        return f"TaskGraph(P={self.P}, V={self.V}, M={self.M}{split}{placement})"
