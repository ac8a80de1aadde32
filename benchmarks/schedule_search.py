"""Offline search for the shortest makespan of forward/backward task orders (a reference, not a policy).

For each seed of schedule_sim.py's varlen scenario (same sizes, duration model and seeds), the search
knows every task's duration in advance and looks for per-rank static task orders that finish the
batch soonest, each rank holding at most its default byte budget (the one schedule_sim.py gives every
schedule: Megatron's in-flight forward count at the batch's largest microbatch).

Starting points: the orders interleaved-1f1b, 1f1b-sorted and dpp:adaptive realise in the simulator,
and Megatron's interleaved order over reordered microbatches (ascending, descending, small ones at
both ends) with every group size Megatron accepts that fits the budget. Simulated annealing runs
from dpp:adaptive's, 1f1b-sorted's and the best other one, --seconds of CPU time per seed in all.
Moves: swap or shift tasks that wait for their rank predecessor on a longest path, shift a random
task, or swap two microbatches' roles on every rank; a move that breaks a budget is repaired (a
forward that overflows runs after the next backward instead), one that deadlocks is rejected. The
best orders found are replayed through the simulator's static-order path (StaticOrderScheduler)
and must reproduce the search's makespan and stay within every budget.

It also computes a makespan lower bound per batch, never below the simulator's pipeline bound: per
rank, the preemptive one-machine bound with heads and tails (see `one_machine_bound`).

    python benchmarks/schedule_search.py --P 8 --M 16 --seeds 4 --seconds 60 --json runs/search.json
    python benchmarks/schedule_search.py --P 2 --M 4 --seeds 1 --seconds 1     # a few seconds

Time is the simulator's (no communication cost, as schedule_sim.py's default).
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import random
import sys
import time
from typing import Callable, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from schedule_sim import (  # noqa: E402
    batch_sizes, check_interleavable, duration_model, megatron_order, pipeline_arg_problems)

from megatron_dpp.pipeline import Phase, Task, TaskGraph, default_budget_bytes, static_orders  # noqa: E402
from megatron_dpp.pipeline.scheduler import StaticOrderScheduler  # noqa: E402
from megatron_dpp.sim import DurationModel, simulate  # noqa: E402

# Annealing starts from each of these and from the best other starting point, --seconds in all.
NAMED_STARTS = ("dpp:adaptive", "1f1b-sorted")
Orders = list[list[int]]  # per rank: task ids in the order the rank runs them


class Instance:
    """One batch with every duration known: tasks as integer ids, each with its duration, its one
    cross-task dependency and its memory change, plus an exact makespan evaluator for static orders.

    Task id = ((rank * 2 + phase) * V + chunk) * M + microbatch, the simulator's duration index."""

    def __init__(self, graph: TaskGraph, durations: Sequence[float], budgets: Sequence[int]):
        P, V, M = graph.P, graph.V, graph.M
        self.graph, self.P, self.V, self.M = graph, P, V, M
        self.per_rank = 2 * V * M
        self.duration = [float(d) for d in durations]
        self.budgets = [int(b) for b in budgets]
        n = P * self.per_rank
        # dependency[i]: the task whose end task i waits for besides its rank predecessor (-1: none).
        # A backward also needs its own forward on this rank; that is implied by this chain (the
        # gradient it waits for comes from a stage downstream of that forward).
        self.dependency = [-1] * n
        self.delta = [0] * n  # activation bytes held after the task minus before it
        self.rank_of = [i // self.per_rank for i in range(n)]
        for rank in range(P):
            for phase in (Phase.F, Phase.B):
                for chunk in range(V):
                    for m in range(M):
                        task = Task(phase, m, chunk)
                        i = self.task_id(rank, task)
                        act = graph.act_bytes[m]
                        self.delta[i] = act if phase == Phase.F else -act
                        source = graph.input_source(rank, task)
                        if source is not None:
                            self.dependency[i] = self.task_id(*source)
                        elif phase == Phase.B:  # the last virtual stage: the loss follows its forward
                            self.dependency[i] = self.task_id(rank, Task(Phase.F, m, chunk))

    def task_id(self, rank: int, task: Task) -> int:
        return ((rank * 2 + task.phase) * self.V + task.chunk) * self.M + task.microbatch

    def task(self, i: int) -> Task:
        local = i % self.per_rank
        phase, rest = divmod(local, self.V * self.M)
        chunk, m = divmod(rest, self.M)
        return self.graph.task_table[phase][chunk][m]

    def orders_from_timeline(self, timeline) -> Orders:
        """Per-rank task ids in the order a simulated run started them."""
        orders: Orders = [[] for _ in range(self.P)]
        for rank, task, start, _ in sorted(timeline, key=lambda e: (e[0], e[2])):
            orders[rank].append(self.task_id(rank, task))
        return orders

    def peak_bytes(self, order: Sequence[int]) -> int:
        """Most bytes a rank running `order` holds (a forward holds from its start to its
        backward's end, one task at a time, so the running sum over the order is exact)."""
        held = peak = 0
        delta = self.delta
        for i in order:
            held += delta[i]
            if held > peak:
                peak = held
        return peak

    def fits(self, rank: int, order: Sequence[int]) -> bool:
        return self.peak_bytes(order) <= self.budgets[rank]

    def repaired(self, rank: int, order: Sequence[int]) -> list[int] | None:
        """`order` made to fit the rank's budget by running each forward that overflows it after
        the next backward instead (None if that does not get there)."""
        budget, delta = self.budgets[rank], self.delta
        out = list(order)
        for _ in range(len(out)):
            held = 0
            for k, i in enumerate(out):
                held += delta[i]
                if held > budget:
                    break
            else:
                return out
            later = next((j for j in range(k + 1, len(out)) if delta[out[j]] < 0), None)
            if later is None:
                return None
            out.insert(later, out.pop(k))
        return None

    def makespan(self, orders: Orders) -> float:
        """What the simulator's static-order path gives these orders: each task starts when its rank
        finished the previous one and its dependency ended (no communication cost). inf if the
        orders deadlock."""
        ends = self.schedule(orders)
        return math.inf if ends is None else max(ends)

    def schedule(self, orders: Orders) -> list[float] | None:
        """Every task's end time, or None on a deadlock. Ranks advance until they reach a task whose
        dependency has not run; the rank that runs that dependency wakes them."""
        n = len(self.duration)
        end = [-1.0] * n
        waiter = [-1] * n  # rank blocked on this task
        dependency, duration = self.dependency, self.duration
        position = [0] * self.P
        free = [0.0] * self.P
        active = list(range(self.P))
        finished = 0
        while active:
            rank = active.pop()
            order = orders[rank]
            k, t = position[rank], free[rank]
            length = len(order)
            while k < length:
                i = order[k]
                d = dependency[i]
                if d >= 0:
                    e = end[d]
                    if e < 0.0:
                        waiter[d] = rank
                        break
                    if e > t:
                        t = e
                t += duration[i]
                end[i] = t
                k += 1
                w = waiter[i]
                if w >= 0:
                    active.append(w)
            finished += k - position[rank]
            position[rank], free[rank] = k, t
        return end if finished == n else None

    def critical_path(self, orders: Orders, end: list[float], rng: random.Random) -> list[int]:
        """Task ids of one longest chain ending at the makespan, last first. A task starts at the
        later of its rank predecessor's end and its dependency's end; that one is its critical
        predecessor (a random one of the two when both end then)."""
        previous = [-1] * len(end)
        for order in orders:
            for a, b in zip(order, order[1:]):
                previous[b] = a
        i = max(range(len(end)), key=end.__getitem__)
        path = [i]
        while True:
            d, p = self.dependency[i], previous[i]
            start = max(end[d] if d >= 0 else 0.0, end[p] if p >= 0 else 0.0)
            if start == 0.0:
                return path
            by_dependency = d >= 0 and end[d] == start
            by_rank = p >= 0 and end[p] == start
            if by_dependency and by_rank:
                i = d if rng.random() < 0.5 else p
            else:
                i = d if by_dependency else p
            path.append(i)


def one_machine_bound(instance: Instance) -> float:
    """A makespan lower bound: for each rank, the optimum of its tasks as one preemptive machine with
    heads and tails, everything else relaxed.

    Each microbatch is one chain of 2*P*V tasks (forwards through every virtual stage, then
    backwards back). A task cannot start before its chain's earlier tasks ran (head: their durations
    summed) and the batch cannot end before its chain's later tasks ran after it (tail). Any schedule
    runs rank r's tasks one at a time, each between its head and its tail, so its makespan is at
    least the best preemptive schedule of those tasks on one machine with release times (heads) and
    delivery times (tails), which Jackson's rule finds exactly: at every moment run the released
    task with the longest tail. The pipeline bound is one term of this bound (all of a rank's tasks,
    the smallest head and tail), and so is each chain's length (one task)."""
    P, V, M = instance.P, instance.V, instance.M
    dur = instance.duration
    head = [0.0] * len(dur)
    tail = [0.0] * len(dur)
    for m in range(M):
        chain = [(s % P, Task(Phase.F, m, s // P)) for s in range(P * V)]
        chain += [(s % P, Task(Phase.B, m, s // P)) for s in reversed(range(P * V))]
        ids = [instance.task_id(r, t) for r, t in chain]
        total = math.fsum(dur[i] for i in ids)
        before = 0.0
        for i in ids:
            head[i] = before
            tail[i] = total - before - dur[i]
            before += dur[i]
    best = 0.0
    for rank in range(P):
        tasks = sorted(range(rank * instance.per_rank, (rank + 1) * instance.per_rank), key=head.__getitem__)
        best = max(best, _jackson_preemptive(tasks, head, dur, tail))
    return best


def _jackson_preemptive(tasks: list[int], head, dur, tail) -> float:
    """Max over tasks of (completion + tail) in Jackson's preemptive schedule (tasks sorted by head)."""
    available: list[tuple[float, int]] = []  # (-tail, task)
    remaining = {i: dur[i] for i in tasks}
    now, k, worst = 0.0, 0, 0.0
    while k < len(tasks) or available:
        if not available:
            now = max(now, head[tasks[k]])
        while k < len(tasks) and head[tasks[k]] <= now:
            heapq.heappush(available, (-tail[tasks[k]], tasks[k]))
            k += 1
        _, i = available[0]
        next_release = head[tasks[k]] if k < len(tasks) else math.inf
        run = min(remaining[i], next_release - now)
        now += run
        remaining[i] -= run
        if remaining[i] <= 1e-12:
            heapq.heappop(available)
            worst = max(worst, now + tail[i])
    return worst


# --- search ---------------------------------------------------------------------------------------
MOVES = ("critical swap", "critical shift", "random shift", "microbatch swap")
MOVE_WEIGHTS = (0.35, 0.25, 0.3, 0.1)
SHIFT_REACH = 8  # the farthest a shift moves a task along its rank's order


def _moved(order: list[int], source: int, target: int) -> list[int]:
    out = list(order)
    out.insert(target, out.pop(source))
    return out


def _propose(instance: Instance, orders: Orders, end: list[float], rng: random.Random) -> tuple[str, Orders] | None:
    """One random neighbour of `orders` (sharing the ranks' lists it does not change), or None."""
    move = rng.choices(MOVES, MOVE_WEIGHTS)[0]
    if move == "microbatch swap":
        if instance.M < 2:
            return None
        a, b = rng.sample(range(instance.M), 2)
        relabel = {}
        for rank in range(instance.P):
            for phase in (Phase.F, Phase.B):
                for chunk in range(instance.V):
                    ia = instance.task_id(rank, Task(phase, a, chunk))
                    ib = instance.task_id(rank, Task(phase, b, chunk))
                    relabel[ia], relabel[ib] = ib, ia
        return move, [[relabel.get(i, i) for i in order] for order in orders]
    if move == "random shift":
        rank = rng.randrange(instance.P)
        order = orders[rank]
        source = rng.randrange(len(order))
        target = min(len(order) - 1, max(0, source + rng.choice((-1, 1)) * rng.randint(1, SHIFT_REACH)))
        if target == source:
            return None
        candidate = list(orders)
        candidate[rank] = _moved(order, source, target)
        return move, candidate
    # Critical moves: rank arcs of a longest chain (a task that waited for its rank predecessor).
    path = instance.critical_path(orders, end, rng)
    arcs = []
    for later, earlier in zip(path, path[1:]):
        rank = instance.rank_of[later]
        if instance.rank_of[earlier] == rank and instance.dependency[later] != earlier:
            arcs.append((rank, earlier))
    if not arcs:
        return None
    rank, earlier = rng.choice(arcs)
    order = orders[rank]
    j = order.index(earlier)
    candidate = list(orders)
    if move == "critical swap":
        candidate[rank] = _moved(order, j, j + 1)
    elif rng.random() < 0.5:  # the waiting task jumps ahead of its predecessor, and maybe more
        candidate[rank] = _moved(order, j + 1, max(0, j - rng.randint(0, SHIFT_REACH - 1)))
    else:  # the predecessor moves behind the waiting task, and maybe more
        candidate[rank] = _moved(order, j, min(len(order) - 1, j + rng.randint(1, SHIFT_REACH)))
    return move, candidate


def anneal(
    instance: Instance,
    orders: Orders,
    seconds: float,
    rng: random.Random,
    progress: Callable[[float, float], None] | None = None,
    hot: float = 0.1,
) -> tuple[Orders, float, dict]:
    """Simulated annealing over per-rank orders for `seconds` of CPU time (so other processes on
    the machine do not shorten it); returns the best orders found (never worse than `orders`), their
    makespan and counters. A move that breaks a rank's budget is repaired (Instance.repaired) or
    dropped; one that deadlocks is dropped."""
    current = [list(o) for o in orders]
    end = instance.schedule(current)
    if end is None:
        raise ValueError("anneal: the starting orders deadlock")
    if not all(instance.fits(r, current[r]) for r in range(instance.P)):
        raise ValueError("anneal: the starting orders exceed a rank's budget")
    now = max(end)
    best, best_orders = now, current
    # Temperatures in units of the mean task: at the start a move that delays the end by a tenth
    # of a task is accepted with probability 1/e; at the end almost none is.
    task = sum(instance.duration) / len(instance.duration)
    hot, cold = hot * task, 1e-3 * task
    stats = {"proposed": 0, "evaluated": 0, "accepted": 0, "improved": 0}
    improved_by = dict.fromkeys(MOVES, 0)
    t0 = time.process_time()
    next_report = t0 + 10.0
    while True:
        clock = time.process_time()
        elapsed = clock - t0
        if elapsed >= seconds:
            break
        if progress is not None and clock >= next_report:
            progress(elapsed, best)
            next_report = clock + 10.0
        temperature = hot * (cold / hot) ** (elapsed / seconds)
        stats["proposed"] += 1
        proposal = _propose(instance, current, end, rng)
        if proposal is None:
            continue
        move, candidate = proposal
        for r in range(instance.P):
            if candidate[r] is not current[r] and not instance.fits(r, candidate[r]):
                candidate[r] = instance.repaired(r, candidate[r])
                if candidate[r] is None:
                    break
        else:
            candidate = None if candidate == current else candidate
        if candidate is None:
            continue
        stats["evaluated"] += 1
        candidate_end = instance.schedule(candidate)
        if candidate_end is None:
            continue
        span = max(candidate_end)
        if span <= now or rng.random() < math.exp((now - span) / temperature):
            current, end, now = candidate, candidate_end, span
            stats["accepted"] += 1
            if span < best:
                best, best_orders = span, candidate
                stats["improved"] += 1
                improved_by[move] += 1
    stats["cpu_s"] = time.process_time() - t0
    stats["improved_by"] = improved_by
    return [list(o) for o in best_orders], best, stats


# --- starting points, one seed, the command line ---------------------------------------------------
def reordered_microbatch_orders(sizes: Sequence[float]) -> dict[str, list[int]]:
    """Microbatch orders for Megatron's interleaved order besides the named schedules' own:
    ascending, descending, and "tent k": k small microbatches first, the rest largest first, k small
    ones last (fill behind short microbatches, drain behind short ones too)."""
    ascending = sorted(range(len(sizes)), key=lambda m: (sizes[m], m))
    orders = {"ascending": ascending, "descending": ascending[::-1]}
    for k in range(1, len(sizes) // 4 + 1):
        small, rest = ascending[: 2 * k], ascending[2 * k:][::-1]
        orders[f"tent {k}"] = small[0::2] + rest + small[1::2][::-1]
    return orders


def starting_points(instance: Instance, model, seed: int) -> dict[str, tuple[Orders, float]]:
    """Name -> (orders, makespan): the named schedules as the simulator runs them, and Megatron's
    interleaved order over reordered microbatches with every group size Megatron accepts, where
    that fits the budget."""
    graph, P, V, M = instance.graph, instance.P, instance.V, instance.M
    points = {}
    for name in (*NAMED_STARTS, megatron_order(V)):
        orders = instance.orders_from_timeline(simulate(graph, name, model, seed=seed).timeline)
        points[name] = (orders, instance.makespan(orders))
    if V > 1:
        for label, microbatches in reordered_microbatch_orders(graph.sizes).items():
            for group in range(P, M + 1):
                try:
                    static_orders.interleaved_group_size(P, M, group)
                except ValueError:
                    continue
                orders = [
                    [instance.task_id(r, t) for t in static_orders.interleaved_order(
                        P, V, r, M, microbatches, group, graph.task_table)]
                    for r in range(P)
                ]
                if all(instance.fits(r, orders[r]) for r in range(P)):
                    points[f"interleaved-1f1b over {label}, group {group}"] = (orders, instance.makespan(orders))
    return points


def replay(instance: Instance, orders: Orders, model, seed: int):
    """The orders run by the simulator's static-order path, each rank at its budget."""
    graph = instance.graph
    tasks = [[instance.task(i) for i in order] for order in orders]

    def factory(g: TaskGraph, rank: int) -> StaticOrderScheduler:
        return StaticOrderScheduler("search", g, rank, instance.budgets[rank], list(range(g.M)), tasks[rank])

    return simulate(graph, factory, model, seed=seed)


def varlen_instance(P: int, V: int, M: int, seed: int, args) -> tuple[Instance, DurationModel]:
    """schedule_sim.py's varlen batch of this seed (sizes, durations), every rank at its default budget."""
    graph = TaskGraph(P, V, M, batch_sizes("varlen", M, args.cv, np.random.default_rng(10_000 + seed)))
    model = duration_model("varlen", args)
    durations = model.sample(graph, np.random.default_rng(seed))
    return Instance(graph, durations.flat, [default_budget_bytes(graph, r) for r in range(P)]), model


def search_seed(P: int, V: int, M: int, seed: int, args, log=print) -> dict:
    """One batch of schedule_sim.py's varlen scenario: starting points, annealing from three of
    them (args.seconds of CPU in all), the simulator's check of the result."""
    instance, model = varlen_instance(P, V, M, seed, args)
    points = starting_points(instance, model, seed)
    base = points[megatron_order(V)][1]
    # Annealing runs from different shapes: the best starting point can be a deep local optimum
    # (e.g. an interleaved order with one group of M, whose neighbours all finish later).
    others = [n for n in points if n not in NAMED_STARTS]
    chosen = [*NAMED_STARTS, min(others, key=lambda n: points[n][1])]
    start_name = min(points, key=lambda n: points[n][1])
    best_name, best_orders, best = start_name, points[start_name][0], points[start_name][1]
    rng = random.Random(seed)
    evaluated, improved_by = 0, dict.fromkeys(MOVES, 0)
    for name in chosen:
        def progress(elapsed, value, name=name):
            log(f"  seed {seed}, from {name}: {elapsed:.0f} CPU s, best {value / base:.4f} x {megatron_order(V)}")

        orders, found, stats = anneal(instance, points[name][0], args.seconds / len(chosen), rng, progress)
        evaluated += stats["evaluated"]
        for move, count in stats["improved_by"].items():
            improved_by[move] += count
        log(f"  seed {seed}: from {name} ({points[name][1] / base:.4f}) annealing found {found / base:.4f}")
        if found < best:
            best_name, best_orders, best = name, orders, found
    check = replay(instance, best_orders, model, seed)
    if not math.isclose(check.makespan, best, rel_tol=1e-9):
        raise RuntimeError(f"seed {seed}: the simulator replays the found orders in {check.makespan}, the search said {best}")
    if any(p > b for p, b in zip(check.peak_bytes, check.budget_bytes)):
        raise RuntimeError(f"seed {seed}: the found orders exceed a budget: peaks {check.peak_bytes}, budgets {check.budget_bytes}")
    bound = one_machine_bound(instance)
    if bound > best * (1 + 1e-9):
        raise RuntimeError(f"seed {seed}: the one-machine bound {bound} exceeds a found schedule {best}")
    return {
        "seed": seed,
        "megatron": base,
        "sorted": points["1f1b-sorted"][1],
        "adaptive": points["dpp:adaptive"][1],
        "start": points[start_name][1],
        "start_name": start_name,
        "best_found": best,
        "best_found_from": best_name,
        "lower_bound": check.lower_bound,
        "pipeline_bound": check.pipeline_bound,
        "one_machine_bound": bound,
        "peak_activation": check.peak_activation,
        "peak_over_budget": max(p / b for p, b in zip(check.peak_bytes, check.budget_bytes)),
        "budget": max(check.budget_bytes),
        "evaluated": evaluated,
        "improved_by": improved_by,
        "cpu_s": args.seconds,
        "orders": [[str(instance.task(i)) for i in order] for order in best_orders],
    }


def summarise(P: int, V: int, M: int, per_seed: list[dict], args) -> dict:
    """One row like schedule_sim.py's (means over seeds), plus the search's result and ratios."""
    mean = {k: float(np.mean([s[k] for s in per_seed])) for k in (
        "megatron", "sorted", "adaptive", "start", "best_found", "lower_bound", "pipeline_bound",
        "one_machine_bound", "peak_activation", "budget")}
    base = mean["megatron"]
    return {
        "scenario": "varlen",
        "P": P,
        "V": V,
        "M": M,
        "schedule": "offline search",
        "time": mean["best_found"],
        "lower_bound": mean["lower_bound"],
        "pipeline_bound": mean["pipeline_bound"],
        "peak_activation": mean["peak_activation"],
        "budget": mean["budget"],
        "within_budget": all(s["peak_over_budget"] <= 1.0 for s in per_seed),
        "seeds": len(per_seed),
        "megatron_order": megatron_order(V),  # the ratios below are to its mean time
        "megatron_time": base,
        "best_found": mean["best_found"],
        "best_found_over_megatron": mean["best_found"] / base,
        "adaptive_over_megatron": mean["adaptive"] / base,
        "sorted_over_megatron": mean["sorted"] / base,
        "start_over_megatron": mean["start"] / base,
        "one_machine_bound_over_megatron": mean["one_machine_bound"] / base,
        "pipeline_bound_over_megatron": mean["pipeline_bound"] / base,
        "cpu_s_per_seed": args.seconds,
        "per_seed": per_seed,
    }


def print_table(rows: list[dict]) -> None:
    print("Mean time / mean time of Megatron's order (interleaved-1f1b for V>1, 1f1b for V=1):")
    print("| P | V | M | seeds | CPU s / seed | sorted | adaptive | best start | best found | "
          "one-machine bound | pipeline bound |")
    print("|---" * 11 + "|")
    for r in rows:
        print(f"| {r['P']} | {r['V']} | {r['M']} | {r['seeds']} | {r['cpu_s_per_seed']:g} | "
              f"{r['sorted_over_megatron']:.3f} | {r['adaptive_over_megatron']:.3f} | "
              f"{r['start_over_megatron']:.3f} | **{r['best_found_over_megatron']:.3f}** | "
              f"{r['one_machine_bound_over_megatron']:.3f} | {r['pipeline_bound_over_megatron']:.3f} |")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--P", type=int, nargs="+", default=[4, 8], help="pipeline ranks")
    p.add_argument("--V", type=int, nargs="+", default=[2], help="model chunks per rank")
    p.add_argument("--M", type=int, nargs="+", default=[16], help="microbatches per global batch")
    p.add_argument("--seeds", type=int, default=4, help="seeds 0..N-1, as schedule_sim.py's")
    p.add_argument("--cv", type=float, default=0.5, help="coefficient of variation of microbatch sizes")
    p.add_argument("--seconds", type=float, default=60.0, help="CPU seconds of annealing per seed")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    bad = pipeline_arg_problems(args) + ([f"--seconds {args.seconds}"] if args.seconds <= 0 else [])
    if bad:
        p.exit(2, f"schedule_search: {', '.join(bad)} out of range\n")
    check_interleavable(p, args, "schedule_search")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = []
    for P in args.P:
        for V in args.V:
            for M in args.M:
                per_seed = []
                for seed in range(args.seeds):
                    s = search_seed(P, V, M, seed, args, log=lambda line: print(line, flush=True))
                    per_seed.append(s)
                    base = s["megatron"]
                    print(f"P={P} V={V} M={M} seed {seed}: x {megatron_order(V)}: adaptive {s['adaptive'] / base:.4f}, "
                          f"best start {s['start'] / base:.4f} ({s['start_name']}), best found "
                          f"{s['best_found'] / base:.4f}, one-machine bound {s['one_machine_bound'] / base:.4f}, "
                          f"peak / budget {s['peak_over_budget']:.2f}", flush=True)
                rows.append(summarise(P, V, M, per_seed, args))
    print()
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {k: v for k, v in vars(args).items() if k != "json"}, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
