"""The search: enumerate the layouts (space.py), prune what cannot win before simulating, price the
rest with the simulator (cost.py), keep the K fastest.

Pruning, in order, each safe for the cost model of cost.py:
1. Dominated layouts, dropped unpriced: with TP > 1, sequence parallelism off (without split
   backwards, which exclude it) is dominated by the same layout with it on: the same bus volume
   (all-gathers and reduce-scatters instead of all-reduces), fewer activation bytes and smaller
   point-to-point messages.
2. Memory: every remaining layout's fullest rank is priced without the simulator (exact, see
   cost.py); layouts over the budget are dropped, and of layouts that differ only in recompute the
   least recomputing one that fits is kept (more recompute only adds time).
3. Time bound: the rest are sorted by a lower bound on their iteration time (the simulator's
   pipeline bound in closed form: the last rank's fill, work and drain, plus the first rank's last
   gradient bucket, the distributed optimizer's all-gather and the tied embedding's all-reduce)
   and simulated in that order;
   the search stops at the first layout whose bound is no better than the K-th best time found.

The simulator runs large pipelines on fewer microbatches and extrapolates the steady state
(cost.Pricer.price); identical simulator inputs are simulated once.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from typing import Optional, TextIO

from megatron_dpp.search.cost import Estimate, LayoutCost, Pricer, Problem
from megatron_dpp.search.space import RECOMPUTE_CHOICES, Layout, SpaceInputs, enumerate_layouts

PROGRESS_INTERVAL_S = 0.2  # at most this often a progress line is redrawn


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """The K fastest layouts and what the search did to find them."""

    best: list[LayoutCost]  # fastest first (ties: less memory first)
    layouts: int  # valid layouts enumerated
    dominated: int  # dropped unpriced as dominated (sequence parallelism off)
    over_memory: int  # over the memory budget
    recompute_dominated: int  # fit, but a less recomputing variant fits too
    bound_pruned: int  # never simulated: their time bound could not beat the K-th best
    simulated: int  # layouts priced with the simulator
    simulations: int  # simulator runs (cache hits and extrapolation pairs counted as they ran)
    smallest_memory_bytes: int  # the least memory any layout needs (its fullest rank)
    seconds: float


class Progress:
    """A one-line progress bar on a stream (stderr), redrawn at most every PROGRESS_INTERVAL_S."""

    def __init__(self, stream: Optional[TextIO] = sys.stderr):
        self.stream = stream
        self._last = 0.0
        self._drawn = False

    def update(self, stage: str, done: int, total: int, force: bool = False) -> None:
        if self.stream is None:
            return
        now = time.monotonic()
        if not force and now - self._last < PROGRESS_INTERVAL_S:
            return
        self._last = now
        width = 30
        filled = width * done // max(total, 1)
        self.stream.write(f"\r{stage}: [{'#' * filled}{'.' * (width - filled)}] {done}/{total}   ")
        self.stream.flush()
        self._drawn = True

    def close(self, summary: str) -> None:
        """End the bar's line with `summary`."""
        if self.stream is None:
            return
        self.stream.write(("\r" if self._drawn else "") + summary + " " * 20 + "\n")
        self.stream.flush()
        self._drawn = False


def space_inputs(problem: Problem) -> SpaceInputs:
    shape, hardware = problem.shape, problem.hardware
    return SpaceInputs(num_layers=shape.num_layers, num_attention_heads=shape.num_attention_heads,
                       ffn_hidden_size=shape.ffn_hidden_size, global_batch_size=problem.global_batch_size,
                       num_nodes=hardware.num_nodes, gpus_per_node=hardware.gpus_per_node,
                       on_gpus=problem.on_gpus)


def is_dominated(layout: Layout, on_gpus: bool) -> bool:
    """Pruning rule 1 (module docstring)."""
    return on_gpus and layout.tp > 1 and not layout.sequence_parallel and not layout.split_backward


def _least_recompute(estimates: list[Estimate]) -> tuple[list[Estimate], int]:
    """Pruning rule 2's second half: per layout up to recompute, the least recomputing one."""
    kept: dict[Layout, Estimate] = {}
    rank = {name: index for index, name in enumerate(RECOMPUTE_CHOICES)}
    for estimate in estimates:
        key = dataclasses.replace(estimate.layout, recompute="")
        held = kept.get(key)
        if held is None or rank[estimate.layout.recompute] < rank[held.layout.recompute]:
            kept[key] = estimate
    return list(kept.values()), len(estimates) - len(kept)


def search(problem: Problem, top_k: int = 5, progress: Optional[Progress] = None,
           prune: bool = True, extrapolate: bool = True) -> SearchResult:
    """The K fastest layouts of `problem` that fit its memory budget (fewer if fewer fit; none:
    `best` is empty and `smallest_memory_bytes` says what the least hungry layout needs).
    prune=False simulates every layout that fits (the brute force the tests compare with);
    extrapolate=False simulates every microbatch (slower; see cost.Pricer.price)."""
    started = time.monotonic()
    progress = progress or Progress(None)
    pricer = Pricer(problem, extrapolate)
    layouts = list(enumerate_layouts(space_inputs(problem)))
    candidates = [layout for layout in layouts if not (prune and is_dominated(layout, problem.on_gpus))]
    estimates, smallest = [], None
    for index, layout in enumerate(candidates):
        progress.update("pricing memory and bounds", index, len(candidates))
        estimate = pricer.estimate(layout)
        smallest = estimate.memory_bytes if smallest is None else min(smallest, estimate.memory_bytes)
        if estimate.memory_bytes <= problem.memory_budget_bytes:
            estimates.append(estimate)
    progress.update("pricing memory and bounds", len(candidates), len(candidates), force=True)
    over_memory = len(candidates) - len(estimates)
    recompute_dominated = 0
    if prune:
        estimates, recompute_dominated = _least_recompute(estimates)
    estimates.sort(key=lambda e: (e.time_lower_ms, e.memory_bytes))
    best: list[LayoutCost] = []
    simulated = 0
    for index, estimate in enumerate(estimates):
        if prune and len(best) == top_k and estimate.time_lower_ms >= best[-1].time_ms:
            break
        progress.update("simulating", index, len(estimates))
        cost = pricer.price(estimate.layout, estimate)
        simulated += 1
        best.append(cost)
        best.sort(key=lambda c: (c.time_ms, c.memory_bytes))
        del best[top_k:]
    progress.close(f"simulated {simulated} of {len(estimates)} layouts that fit; the time bound "
                   f"pruned the other {len(estimates) - simulated}")
    return SearchResult(
        best=best, layouts=len(layouts), dominated=len(layouts) - len(candidates),
        over_memory=over_memory, recompute_dominated=recompute_dominated,
        bound_pruned=len(estimates) - simulated, simulated=simulated, simulations=pricer.simulations,
        smallest_memory_bytes=smallest or 0, seconds=time.monotonic() - started)
