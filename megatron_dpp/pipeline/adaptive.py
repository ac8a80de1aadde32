"""dpp:adaptive — Megatron's order over size-sorted microbatches as a spine, plus safe dynamic
deviations from it under a byte budget.

The spine is 1F1B (V=1) or interleaved 1F1B (V>1), ZB-V's order on the v placement, over the
microbatches in `microbatch_order` (largest first, with a few small ones first for V=1; see
`adaptive_microbatch_order`). A rank
runs the spine's next task whenever it is ready. When it is not, it runs the earliest later spine
FORWARD that is ready and SAFE: after running it now, finishing the rest of the spine in order
would never hold more than the envelope, which is the budget or less (see __init__). Backwards
never run early: that delays the forward the spine waits for, and measured slower under jitter.

Deadlock-freedom: the spines of all ranks together are deadlock-free (Megatron's orders, ZB-V's),
and the safety check keeps "finish the spine in order" feasible on every rank, so the earliest unfinished
spine task of the whole pipeline is always ready and fits; a rank never idles while its spine's
next task is ready.

Why it wins with variable sizes: budgets are provisioned for the largest microbatch, so while
smaller ones are in flight there is room for extra forwards; a rank fills a stall (a backward
that has not arrived) with a forward it would run later anyway, and the work reaches downstream
ranks early. With equal sizes at the default budget there is no such room, so the policy runs
exactly the Megatron order and cannot be slower than it.

When the budget is below what the spine needs, the spine is 1F1B with fewer warmup forwards
(V=1); for V>1 the policy falls back to the reservation admission of the rule-based policies.

Split backwards (TaskGraph(split_backward=True)): the spine holds F and B; each W joins a queue
when its B ends. W runs when the rank would otherwise wait (no spine task and no safe deviation
ready), or first when the spine's next forward does not fit because queued W tasks still hold
memory. W needs nothing from other ranks, so the queue can always be emptied: the spine's
in-order finish stays feasible and the argument above still holds.
"""
from __future__ import annotations

import collections
from typing import Collection, Sequence

from megatron_dpp.pipeline import static_orders
from megatron_dpp.pipeline.graph import TaskGraph
from megatron_dpp.pipeline.placement import V_SHAPE
from megatron_dpp.pipeline.scheduler import RankScheduler
from megatron_dpp.pipeline.task import Phase, Task

# How far past the spine's next task a deviation may reach: spine positions per virtual stage, and
# at most in all (each decision walks that far in the worst case).
_LOOKAHEAD_PER_STAGE = 4
_LOOKAHEAD_MAX = 64
# Below this many ready tasks, candidates come from the ready set, above it from walking the spine.
_SMALL_READY_SET = 32
# The hot paths compare phases against module constants: an enum attribute costs ~3x a global.
_F, _B, _W = Phase.F, Phase.B, Phase.W


def adaptive_microbatch_order(
    sizes: Sequence[float], P: int, V: int, split_backward: bool = False
) -> list[int]:
    """The order dpp:adaptive (and 1f1b-sorted) process microbatches in; equal sizes keep the
    batch order.

    Fused backwards, V=1: largest first, except k = min(P, M // 4) small ones go first (every
    other one of the 2k smallest, ascending): the pipeline fills behind short microbatches, the
    steady state pairs similar sizes, and the drain still runs a small tail.
    Fused backwards, V>1: largest first. Interleaving already hides most of the fill, and the
    small-first variants measured 0.5-1% slower there.
    Split backwards: the smallest 3M/8 ascending, then the rest largest first. W tasks fill the
    waits of the drain, so a long cheap fill pays; chosen on other seeds than the benchmark's
    (docs/scheduling.md)."""
    by_size = sorted(range(len(sizes)), key=lambda m: (-sizes[m], m))
    if min(sizes) == max(sizes):
        return by_size
    if split_backward:
        k = 3 * len(sizes) // 8
        first = by_size[len(by_size) - k:][::-1]
    else:
        k = min(P, len(sizes) // 4) if V == 1 else 0
        if k == 0:
            return by_size
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
    which must come from spine_group_size, over `order`; on the v placement ZB-V's order without
    its W tasks (which the scheduler queues, as for every spine)."""
    P, V, M = graph.P, graph.V, graph.M
    if graph.placement.name == V_SHAPE:
        return static_orders.zbv_order(P, rank, M, order, graph.task_table, weight_grads=False)
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
                f"{type(self).__name__} rank {rank}: limit {self._limit} {unit} is below its spine's peak {max(profile)}"
            )
        self._profile = profile  # admission units held after spine[i] if the spine ran in order
        # The envelope deviations must stay under after spine[i]: the spine's own in-flight count
        # there at the largest size, plus whatever the limit grants beyond the spine's peak count
        # at the largest size (nothing, at the default budget). So deviations use the room that
        # smaller-than-largest microbatches leave; with equal sizes there is none and the policy
        # runs the Megatron order exactly.
        largest = 1 if max_inflight is not None else graph.max_act_bytes
        counts, count = [], 0
        for task in self.spine:
            count += 1 if task.phase == Phase.F else -1
            counts.append(count)
        surplus = max(0, self._limit - max(counts, default=0) * largest)
        self._envelope = [min(self._limit, c * largest + surplus) for c in counts]
        self._admitted = 0  # admission units held now
        self._done = bytearray(len(self.spine))
        self._next = 0  # first spine position not started
        self._early: dict[int, int] = {}  # started positions > _next -> their delta
        self._early_total = 0  # sum of self._early's deltas
        self._lookahead = min(_LOOKAHEAD_PER_STAGE * graph.num_stages + 2, _LOOKAHEAD_MAX)
        # smallest_after[i]: the smallest forward at spine positions >= i; once the slack is
        # below it, no later forward can fit and the walk stops.
        smallest, smallest_after = float("inf"), [0.0] * (len(self._delta) + 1)
        smallest_after[-1] = smallest
        for i in range(len(self._delta) - 1, -1, -1):
            if 0 < self._delta[i] < smallest:
                smallest = self._delta[i]
            smallest_after[i] = smallest
        self._smallest_after = smallest_after
        # Split backwards: W tasks whose B has ended, oldest first (they hold memory until run).
        self._weight_grads: collections.deque[Task] = collections.deque()
        self._split = graph.split_backward

    # --- decisions ----------------------------------------------------------------------------
    def next_task(self, ready: Collection[Task]) -> Task | None:
        if not ready:
            return None
        weight_grads = self._weight_grads
        if self._next >= len(self.spine):
            return weight_grads[0] if weight_grads else None
        head = self.spine[self._next]
        if head in ready:
            if weight_grads and self._admitted + self._delta[self._next] > self._limit:
                return weight_grads[0]  # queued W tasks hold the memory this forward needs
            return head
        task = self._safe_deviation(ready)
        if task is None and weight_grads:
            return weight_grads[0]  # fill the wait with work that needs no other rank
        return task

    def _safe_deviation(self, ready: Collection[Task]) -> Task | None:
        """The earliest ready later spine forward whose early start keeps the in-order finish of
        the spine under the envelope at every step until the spine reaches it.

        One pass over the spine from its next task: `slack` is the least room left at the steps
        so far (envelope minus what the spine would hold there, counting tasks already run early
        from beyond that step); a forward at position q fits iff its size <= the slack over the
        steps before q, and now."""
        nxt, spine, delta = self._next, self.spine, self._delta
        limit = min(len(spine), nxt + self._lookahead)
        wanted = None
        if len(ready) <= _SMALL_READY_SET:
            index = self._index
            wanted = {p for p in (index[t] for t in ready if t.phase == _F) if nxt < p < limit}
            if not wanted:
                return None
            limit = max(wanted) + 1
        early, profile, envelope, done = self._early, self._profile, self._envelope, self._done
        early_beyond = self._early_total
        slack = (envelope[nxt - 1] if nxt > 0 else self._limit) - self._admitted
        smallest_after = self._smallest_after
        for i in range(nxt, limit):
            if slack < smallest_after[i]:
                return None
            if i > nxt and not done[i] and 0 < delta[i] <= slack:
                if (i in wanted) if wanted is not None else (spine[i] in ready):
                    return spine[i]
            if i in early:
                early_beyond -= early[i]  # same held value as the step before: no new bound
                continue
            room = envelope[i] - profile[i] - early_beyond
            if room < slack:
                slack = room
        return None

    def on_start(self, task: Task) -> None:
        if task.phase == _W:
            self._weight_grads.remove(task)
            self.log.start(task)
            return
        position = self._index[task]
        if self._done[position]:
            raise RuntimeError(f"{self.name} rank {self.rank}: {task} started twice")
        # RankScheduler.on_start inlined: this runs once per task in 64-rank simulations.
        self.log.start(task)
        delta = self._delta[position]
        self._admitted += delta if delta > 0 else 0
        if task.phase == _F:
            self.held_bytes += self._act[task.microbatch]
            if self.held_bytes > self.peak_bytes:
                self.peak_bytes = self.held_bytes
        self._done[position] = 1
        if position == self._next:
            done, early = self._done, self._early
            nxt = position + 1
            while nxt < len(done) and done[nxt]:
                if early:
                    self._early_total -= early.pop(nxt, 0)
                nxt += 1
            self._next = nxt
        else:
            self._early[position] = delta
            self._early_total += delta

    def on_finish(self, task: Task) -> None:
        # RankScheduler.on_finish inlined, as on_start.
        self.log.finish(task)
        if task.phase == _F:
            return
        backward = task
        if self._split:
            if task.phase == _B:
                self._weight_grads.append(self.graph.task_table[_W][task.chunk][task.microbatch])
                return
            backward = self.graph.task_table[_B][task.chunk][task.microbatch]
        self.held_bytes -= self._act[task.microbatch]
        self._admitted += self._delta[self._index[backward]]


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
