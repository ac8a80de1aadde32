"""dpp:adaptive — Megatron's order over size-sorted microbatches as a spine, plus safe dynamic
deviations from it under a byte budget.

The spine is 1F1B (V=1) or interleaved 1F1B (V>1) over the microbatches in `microbatch_order`
(a few small ones first, then the rest largest first; see `adaptive_microbatch_order`). The rank
runs the spine's next task whenever it is ready. When it is not, the rank runs the earliest later
spine FORWARD that is ready and SAFE: after running it now, finishing the rest of the spine in
order would still never hold more than the budget. Backwards are never run early: that delays
the forward the spine waits for and measured slower under jitter. So the spine stays a witness that the rank can finish within budget, which makes the
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
_LOOKAHEAD_PER_STAGE = 4
# Below this many ready tasks, candidates come from the ready set, above it from walking the spine.
_SMALL_READY_SET = 32


def adaptive_microbatch_order(sizes: Sequence[float], P: int, V: int) -> list[int]:
    """Largest first, except k small microbatches go first: every other one of the 2k smallest,
    ascending. The pipeline fills behind short microbatches, the steady state pairs similar
    sizes, and the drain still runs the smallest tail.

    k = min(P, M // 4) for V=1, where the warmup bubble is a full pipeline traversal per rank;
    k = 1 for V>1, where the interleaved warmup already hides most of it (measured in
    docs/scheduling.md)."""
    by_size = sorted(range(len(sizes)), key=lambda m: (-sizes[m], m))
    k = min(P, len(sizes) // 4) if V == 1 else min(1, len(sizes) // 4)
    if k == 0 or min(sizes) == max(sizes):
        return by_size  # equal sizes: keep the batch order
    first = by_size[-2 * k:][1::2][::-1]
    chosen = set(first)
    return first + [m for m in by_size if m not in chosen]


def spine_group_size(P: int, M: int, requested: int | None) -> int:
    """An interleaved group size Megatron accepts for this M (the requested one if valid); for
    M < P, where Megatron accepts none, M (one group). Spines with these groups ran without
    deadlock for every P <= 8, V <= 4, M <= 64 (tests/test_sched_properties.py); other group
    sizes can deadlock (e.g. P=4, V=3, M=5, group 4)."""
    if requested is not None:
        try:
            return static_orders.interleaved_group_size(P, M, requested)
        except ValueError:
            pass
    for group in range(P, M + 1):
        if M % group == 0 or M % group >= P:
            return group
    return M  # M < P: one group; the order then runs every forward before the backwards


def spine_order(
    graph: TaskGraph, rank: int, order: Sequence[int], group: int | None, warmup_cap: int | None
) -> list[Task]:
    """1F1B (V=1, warmup capped at `warmup_cap`) or interleaved 1F1B with group size `group`,
    which must come from spine_group_size, over `order`."""
    P, V, M = graph.P, graph.V, graph.M
    if V == 1:
        warmup = static_orders.one_f_one_b_warmup(P, rank, M)
        if warmup_cap is not None:
            warmup = min(warmup, warmup_cap)
        return static_orders.one_f_one_b_order(P, rank, M, order, graph.task_table, warmup)
    return static_orders.grouped_interleaved_order(P, V, rank, M, order, group, graph.task_table)


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
        max_inflight: int | None = None,
    ):
        """Admission counts bytes against budget_bytes, or, with max_inflight, forwards (chunk
        activations) against that count cap."""
        super().__init__(graph, rank, budget_bytes, microbatch_order)
        self.max_inflight = max_inflight
        weight = [1] * graph.M if max_inflight is not None else self._act
        self._limit = max_inflight if max_inflight is not None else self.budget_bytes
        self.spine = list(spine)
        self._index = {task: i for i, task in enumerate(self.spine)}
        # Admission units (bytes or 1) each spine task adds (forward) or frees (backward).
        self._delta = [weight[t.microbatch] if t.phase == Phase.F else -weight[t.microbatch] for t in self.spine]
        held, profile = 0, []
        for d in self._delta:
            held += d
            profile.append(held)
        if profile and max(profile) > self._limit:
            unit = "forwards" if max_inflight is not None else "bytes"
            raise ValueError(
                f"dpp:adaptive rank {rank}: limit {self._limit} {unit} is below its spine's peak {max(profile)}"
            )
        self._profile = profile  # admission units held after spine[i] if the spine ran in order
        self._admitted = 0  # admission units held now
        self._done = bytearray(len(self.spine))
        self._next = 0  # first spine position not started
        self._early: dict[int, int] = {}  # started positions > _next -> their delta
        self._lookahead = _LOOKAHEAD_PER_STAGE * graph.num_stages + 2

    # --- safety -------------------------------------------------------------------------------
    def _forward_is_safe(self, position: int) -> bool:
        """Would starting spine[position] now keep the in-order finish of the spine in budget?"""
        extra = self._delta[position]
        budget = self._limit
        if self._admitted + extra > budget:
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
            if self._forward_is_safe(p):
                return self.spine[p]
        return None

    def on_start(self, task: Task) -> None:
        position = self._index[task]
        if self._done[position]:
            raise RuntimeError(f"dpp:adaptive rank {self.rank}: {task} started twice")
        # RankScheduler.on_start inlined: this runs once per task in 64-rank simulations.
        self.history.append(task)
        delta = self._delta[position]
        self._admitted += delta if delta > 0 else 0
        if task.phase == Phase.F:
            self.held_bytes += self._act[task.microbatch]
            if self.held_bytes > self.peak_bytes:
                self.peak_bytes = self.held_bytes
        self._done[position] = 1
        if position == self._next:
            done, early = self._done, self._early
            nxt = position + 1
            while nxt < len(done) and done[nxt]:
                if early:
                    early.pop(nxt, None)
                nxt += 1
            self._next = nxt
        else:
            self._early[position] = delta

    def on_finish(self, task: Task) -> None:
        super().on_finish(task)
        if task.phase == Phase.B:
            self._admitted += self._delta[self._index[task]]


def spine_warmup_cap(
    graph: TaskGraph, rank: int, order: Sequence[int], limit: int, weight: Sequence[int]
) -> int | None:
    """For V=1: the most warmup forwards whose 1F1B spine holds at most `limit` (in the units of
    `weight`: act bytes, or ones for a count cap); None: the full warmup fits.

    1F1B with w warmup forwards holds at most w+1 consecutive microbatches (in `order`) at once.
    The cap depends only on the budget and the sizes, so with one budget on every rank the
    warmups still shrink along the pipeline, as 1F1B needs to stay deadlock-free."""
    full = static_orders.one_f_one_b_warmup(graph.P, rank, graph.M)
    act = [weight[m] for m in order]
    for warmup in range(full, -1, -1):
        window = warmup + 1
        held = sum(act[:window])
        peak = held
        for i in range(window, len(act)):
            held += act[i] - act[i - window]
            peak = max(peak, held)
        if peak <= limit:
            return None if warmup == full else warmup
    return 0
