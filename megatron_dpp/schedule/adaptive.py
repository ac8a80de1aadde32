"""dpp:adaptive — Megatron's order over size-sorted microbatches as a spine, plus safe dynamic
deviations from it under a byte budget.

The spine is 1F1B (V=1) or interleaved 1F1B (V>1) over the microbatches in `microbatch_order`
(smallest two first, then the rest largest first; see `adaptive_microbatch_order`). The rank runs
the spine's next task whenever it is ready. When it is not, the rank runs a later spine task that
is ready, if that is SAFE: a backward always is (it only frees memory); a forward is if, after
running it now, finishing the rest of the spine in order would still never hold more than the
budget. So the spine stays a witness that the rank can finish within budget, which makes the
policy deadlock-free for every budget the spine fits in (the spine itself is deadlock-free; the
earliest unfinished spine task of the whole pipeline is always ready and fits).

Why it wins with variable sizes: the budget is provisioned for the largest microbatch, so while
smaller microbatches are in flight there is room for extra forwards; a rank fills stalls (a
backward that has not arrived yet) with forwards that would otherwise run later, and the work
reaches downstream ranks early. With equal sizes the spine already fills the budget, so it runs
exactly the Megatron order.

When the budget is below what the spine needs, the spine is 1F1B with fewer warmup forwards
(V=1); for V>1 the policy falls back to the reservation admission of the rule-based policies.
"""
from __future__ import annotations

from typing import Collection, Sequence

from megatron_dpp.schedule import static_orders
from megatron_dpp.schedule.graph import Phase, Task, TaskGraph
from megatron_dpp.schedule.scheduler import RankScheduler

# How far past the spine's next task a deviation may reach, in spine positions per virtual stage.
_LOOKAHEAD_PER_STAGE = 2
# Below this many ready tasks, candidates come from the ready set, above it from walking the spine.
_SMALL_READY_SET = 32


def adaptive_microbatch_order(sizes: Sequence[float]) -> list[int]:
    """Largest first, except the two smallest go first: the pipeline fills behind short
    microbatches, the steady state pairs similar sizes, and the drain runs the small tail."""
    by_size = sorted(range(len(sizes)), key=lambda m: (-sizes[m], m))
    if len(by_size) < 4:
        return by_size
    return [by_size[-1], by_size[-2]] + by_size[:-2]


def spine_group_size(P: int, M: int, requested: int | None) -> int:
    """An interleaved group size Megatron accepts for this M (the requested one if valid)."""
    if requested is not None:
        try:
            return static_orders.interleaved_group_size(P, M, requested)
        except ValueError:
            pass
    for group in range(P, M + 1):
        if M % group == 0 or M % group >= P:
            return group
    return M  # M < P: one group; the order then runs every forward before the backwards


def spine_order(graph: TaskGraph, rank: int, order: Sequence[int], group: int | None, warmup_cap: int | None) -> list[Task]:
    P, V, M = graph.P, graph.V, graph.M
    if V == 1:
        warmup = static_orders.one_f_one_b_warmup(P, rank, M)
        if warmup_cap is not None:
            warmup = min(warmup, warmup_cap)
        forwards = [Task(Phase.F, m, 0) for m in order]
        backwards = [Task(Phase.B, m, 0) for m in order]
        return static_orders._warmup_steady_cooldown(forwards, backwards, warmup)
    table = static_orders.interleaved_table(M, V, group)
    forwards = [Task(Phase.F, order[m], c) for m, c in table]
    backwards = [Task(Phase.B, order[m], V - 1 - c) for m, c in table]
    warmup = static_orders.interleaved_warmup(P, V, rank, M, group)
    return static_orders._warmup_steady_cooldown(forwards, backwards, warmup)


def profile_peak(tasks: Sequence[Task], act: Sequence[int]) -> int:
    held = peak = 0
    for task in tasks:
        held += act[task.microbatch] if task.phase == Phase.F else -act[task.microbatch]
        peak = max(peak, held)
    return peak


class AdaptiveScheduler(RankScheduler):
    name = "dpp:adaptive"

    def __init__(
        self,
        graph: TaskGraph,
        rank: int,
        budget_bytes: int,
        microbatch_order: Sequence[int],
        spine: Sequence[Task],
    ):
        super().__init__(graph, rank, budget_bytes, microbatch_order)
        act = self._act
        self.spine = list(spine)
        self._index = {task: i for i, task in enumerate(self.spine)}
        self._delta = [act[t.microbatch] if t.phase == Phase.F else -act[t.microbatch] for t in self.spine]
        held, profile = 0, []
        for d in self._delta:
            held += d
            profile.append(held)
        if profile and max(profile) > self.budget_bytes:
            raise ValueError(
                f"dpp:adaptive rank {rank}: budget {self.budget_bytes} bytes is below its spine's "
                f"peak {max(profile)}"
            )
        self._profile = profile  # held bytes after spine[i] if the spine ran in order
        self._done = bytearray(len(self.spine))
        self._next = 0  # first spine position not started
        self._early: dict[int, int] = {}  # started positions > _next -> their delta
        self._lookahead = _LOOKAHEAD_PER_STAGE * graph.num_stages + 2

    # --- safety -------------------------------------------------------------------------------
    def _forward_is_safe(self, position: int) -> bool:
        """Would starting spine[position] now keep the in-order finish of the spine in budget?"""
        extra = self._delta[position]
        budget = self.budget_bytes
        if self.held_bytes + extra > budget:
            return False
        # Held bytes after spine[i], i in [_next, position), if the spine then runs in order:
        # profile[i] plus the deltas of tasks already run early from beyond i.
        early_beyond = sum(self._early.values())
        early = self._early
        profile = self._profile
        for i in range(self._next, position):
            if i in early:
                early_beyond -= early[i]
                continue
            if profile[i] + early_beyond + extra > budget:
                return False
        return True

    # --- decisions ----------------------------------------------------------------------------
    def next_task(self, ready: Collection[Task]) -> Task | None:
        if self._next >= len(self.spine) or not ready:
            return None
        head = self.spine[self._next]
        if head in ready:
            return head
        limit = min(len(self.spine), self._next + self._lookahead)
        if len(ready) <= _SMALL_READY_SET:
            index = self._index
            positions = sorted(
                p for p in (index.get(t, -1) for t in ready if t.phase == Phase.F) if self._next < p < limit
            )
        else:
            done, spine = self._done, self.spine
            positions = [
                p for p in range(self._next + 1, limit)
                if not done[p] and spine[p].phase == Phase.F and spine[p] in ready
            ]
        for p in positions:
            if self._delta[p] > 0 and self._forward_is_safe(p):
                return self.spine[p]
        return None

    def on_start(self, task: Task) -> None:
        position = self._index[task]
        if self._done[position]:
            raise RuntimeError(f"dpp:adaptive rank {self.rank}: {task} started twice")
        super().on_start(task)
        self._done[position] = 1
        if position == self._next:
            done = self._done
            nxt = position + 1
            while nxt < len(done) and done[nxt]:
                self._early.pop(nxt, None)
                nxt += 1
            self._next = nxt
        else:
            self._early[position] = self._delta[position]


def spine_warmup_cap(graph: TaskGraph, rank: int, order: Sequence[int], budget: int) -> int | None:
    """For V=1: the most warmup forwards whose 1F1B spine fits `budget` (None: the full warmup).
    The cap depends only on the budget and the sizes, so with one budget on every rank the
    warmups still shrink along the pipeline, as 1F1B needs."""
    full = static_orders.one_f_one_b_warmup(graph.P, rank, graph.M)
    for warmup in range(full, -1, -1):
        tasks = spine_order(graph, rank, order, None, warmup)
        if profile_peak(tasks, graph.act_bytes) <= budget:
            return None if warmup == full else warmup
    return 0
