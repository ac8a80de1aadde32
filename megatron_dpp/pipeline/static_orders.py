"""Static schedules as plain per-rank task lists: GPipe, 1F1B, Megatron's interleaved 1F1B, ZB-V.

Each function takes `order`, the microbatch processing order (a permutation of range(M)), so the
same Megatron order can run over reordered microbatches (`1f1b-sorted`). The lists reproduce
megatron/core/pipeline_parallel/schedules.py: warmup forwards, then (forward, backward) pairs,
then cooldown backwards.
"""
from __future__ import annotations

from typing import Sequence

from megatron_dpp.pipeline.task import Phase, Task

TaskTable = Sequence[Sequence[Sequence[Task]]]  # [phase][chunk][m], see TaskGraph.task_table


def _table(table: TaskTable | None, M: int, V: int) -> TaskTable:
    if table is not None:
        return table
    return [[[Task(phase, m, c) for m in range(M)] for c in range(V)] for phase in (Phase.F, Phase.B)]


def one_f_one_b_warmup(P: int, rank: int, M: int) -> int:
    """Forwards 1F1B runs on `rank` before its first backward."""
    return min(P - rank - 1, M)


def interleaved_group_size(P: int, M: int, group_size: int | None) -> int:
    """Megatron's microbatch_group_size_per_vp_stage (default P), validated as Megatron does."""
    group = P if group_size is None else int(group_size)
    if group < P or group > M:
        raise ValueError(
            f"interleaved 1F1B: microbatch_group_size_per_vp_stage={group} must lie in "
            f"[P={P}, M={M}]; choose M >= P and a group size in that range"
        )
    remainder = M % group
    if 0 < remainder < P:
        raise ValueError(
            f"interleaved 1F1B: M={M} % microbatch_group_size_per_vp_stage={group} = {remainder} "
            f"must be 0 or >= P={P}; use M a multiple of the group size"
        )
    return group


def interleaved_warmup(P: int, V: int, rank: int, M: int, group_size: int) -> int:
    """Forwards (over all chunks) interleaved 1F1B runs on `rank` before its first backward."""
    return min(2 * (P - rank - 1) + (V - 1) * group_size, M * V)


def interleaved_table(M: int, V: int, group_size: int) -> list[tuple[int, int]]:
    """Megatron's get_schedule_table: (microbatch position, chunk) of the k-th forward."""
    table = []
    for first in range(0, M, group_size):
        last = M if first + group_size >= M else first + group_size
        table.extend((m, c) for c in range(V) for m in range(first, last))
    return table


def gpipe_order(M: int, V: int, order: Sequence[int], table: TaskTable | None = None) -> list[Task]:
    """All forwards (chunk by chunk), then all backwards (deepest chunk first)."""
    F, B = _table(table, M, V)[:2]
    forwards = [F[c][m] for c in range(V) for m in order]
    backwards = [B[c][m] for c in reversed(range(V)) for m in order]
    return forwards + backwards


def _warmup_steady_cooldown(forwards: list[Task], backwards: list[Task], warmup: int) -> list[Task]:
    tasks = list(forwards[:warmup])
    for k in range(len(forwards) - warmup):
        tasks.append(forwards[warmup + k])
        tasks.append(backwards[k])
    tasks.extend(backwards[len(forwards) - warmup:])
    return tasks


def one_f_one_b_order(
    P: int, rank: int, M: int, order: Sequence[int], table: TaskTable | None = None, warmup: int | None = None
) -> list[Task]:
    """Megatron's non-interleaved 1F1B on `rank` (V=1); `warmup` overrides its warmup count
    (fewer in-flight forwards; deadlock-free while warmups do not grow along the pipeline)."""
    F, B = _table(table, M, 1)[:2]
    forwards = [F[0][m] for m in order]
    backwards = [B[0][m] for m in order]
    if warmup is None:
        warmup = one_f_one_b_warmup(P, rank, M)
    return _warmup_steady_cooldown(forwards, backwards, warmup)


def interleaved_order(
    P: int,
    V: int,
    rank: int,
    M: int,
    order: Sequence[int],
    group_size: int | None = None,
    table: TaskTable | None = None,
) -> list[Task]:
    """Megatron's interleaved 1F1B on `rank` (V>1), with microbatch_group_size_per_vp_stage."""
    group = interleaved_group_size(P, M, group_size)
    return grouped_interleaved_order(P, V, rank, M, order, group, table)


def grouped_interleaved_order(
    P: int, V: int, rank: int, M: int, order: Sequence[int], group: int, table: TaskTable | None = None
) -> list[Task]:
    """Interleaved 1F1B for any group size, including ones Megatron refuses (M < P): callers that
    need that (the adaptive spine) check deadlock-freedom themselves."""
    F, B = _table(table, M, V)[:2]
    schedule = interleaved_table(M, V, group)
    forwards = [F[c][order[m]] for m, c in schedule]
    backwards = [B[V - 1 - c][order[m]] for m, c in schedule]
    return _warmup_steady_cooldown(forwards, backwards, interleaved_warmup(P, V, rank, M, group))


def with_weight_grads(tasks: Sequence[Task], table: TaskTable) -> list[Task]:
    """A static order on a graph with split backwards: each W right after its B. Megatron's
    orders then keep their shape and memory, and the input gradient leaves before the weight
    gradient is computed."""
    W = table[Phase.W]
    result = []
    for task in tasks:
        result.append(task)
        if task.phase == Phase.B:
            result.append(W[task.chunk][task.microbatch])
    return result


def peak_inflight_forwards(tasks: Sequence[Task]) -> int:
    """Most forward activations a task list holds at once (a forward holds until its backward,
    or until its W when the list has W tasks)."""
    release = Phase.W if any(task.phase == Phase.W for task in tasks) else Phase.B
    held = peak = 0
    for task in tasks:
        if task.phase == Phase.F:
            held += 1
            peak = max(peak, held)
        elif task.phase == release:
            held -= 1
    return peak


def zbv_order(P: int, rank: int, M: int, order: Sequence[int], table: TaskTable,
              weight_grads: bool) -> list[Task]:
    """ZB-V's order on `rank` of the V placement (placement.v_shape(P): chunk 0 is stage `rank`,
    chunk 1 is stage 2P-1-rank), the order of torch's ScheduleZBVZeroBubble (arXiv 2401.10241,
    section 6), over the microbatches in `order`.

    Warmup: 2(P-rank)-1 chunk-0 forwards; `rank` pairs (chunk-1 F, chunk-0 F); P-rank triples of
    chunk 1 (F, B, W). Steady state: (F, B, W) on chunk 0 then on chunk 1 until every forward ran.
    Cooldown: `rank` pairs of B (chunk 0, chunk 1), P-rank pairs (chunk-0 B, chunk-0 W), then the
    remaining W tasks, chunk 1's first. The shape is built for at least 2P-1 microbatches and the
    tasks of the ones beyond M dropped, as torch does. With weight_grads=False (fused backwards)
    the W tasks are left out and each B is the whole backward: W tasks gate no other rank, so the
    order keeps its shape and stays deadlock-free."""
    F, B = table[Phase.F], table[Phase.B]
    W = table[Phase.W] if weight_grads else None
    span = max(2 * P - 1, M)
    tasks: list[Task] = []
    done = {(phase, chunk): 0 for phase in (Phase.F, Phase.B, Phase.W) for chunk in (0, 1)}

    def run(phase: Phase, chunk: int) -> None:
        """Append the next `phase` task of `chunk` (the k-th one runs order[k]), if k < M."""
        k = done[(phase, chunk)]
        done[(phase, chunk)] = k + 1
        if k >= M or (phase == Phase.W and W is None):
            return
        tasks.append((F if phase == Phase.F else B if phase == Phase.B else W)[chunk][order[k]])

    for _ in range(2 * (P - rank) - 1):
        run(Phase.F, 0)
    for _ in range(rank):
        run(Phase.F, 1)
        run(Phase.F, 0)
    for _ in range(P - rank):
        run(Phase.F, 1)
        run(Phase.B, 1)
        run(Phase.W, 1)
    while done[(Phase.F, 1)] < done[(Phase.F, 0)] or done[(Phase.F, 0)] < span:
        if done[(Phase.F, 0)] < span:
            run(Phase.F, 0)
        run(Phase.B, 0)
        run(Phase.W, 0)
        run(Phase.F, 1)
        run(Phase.B, 1)
        run(Phase.W, 1)
    for _ in range(rank):
        run(Phase.B, 0)
        run(Phase.B, 1)
    for _ in range(P - rank):
        run(Phase.B, 0)
        run(Phase.W, 0)
    for chunk in (1, 0):
        while done[(Phase.W, chunk)] < done[(Phase.B, chunk)]:
            run(Phase.W, chunk)
    return tasks
