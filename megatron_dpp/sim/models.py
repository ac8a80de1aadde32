"""Duration and communication models for the simulator.

Time is in abstract units (the trace maps 1 unit to 1 ms). A forward of microbatch m on one chunk
of one rank takes (linear*size + quadratic*size^2) / V, times the rank's speed factor, a per-task
jitter and a straggler slowdown; its backward takes backward_ratio times that, with its own draw.
Every forward and backward then pays a fixed forward_overhead / backward_overhead: the executor's own
cost per task (its loop, the framework's step wrappers, posting a message), unscaled by size or speed.
When the graph splits backwards, the backward's draw is divided between B and W by
weight_grad_fraction (so a seed's total work is the same split or not), and W pays backward_overhead
too: one more task to run.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from megatron_dpp.pipeline import Task, TaskGraph


@dataclasses.dataclass(frozen=True)
class DurationModel:
    linear: float = 1.0  # forward time per unit of size on a whole rank (all its chunks)
    quadratic: float = 0.0  # attention-like term per size^2
    backward_ratio: float = 2.0
    jitter_sigma: float = 0.0  # per-task lognormal sigma (mean-one multiplier)
    straggler_prob: float = 0.0
    straggler_factor: float = 1.0
    straggler_scope: str = "task"  # "task": each task independently; "rank": a whole rank
    rank_speed: Sequence[float] | None = None  # per-rank time multipliers (heterogeneous stages)
    forward_overhead: float = 0.0  # fixed executor cost added to every forward task
    backward_overhead: float = 0.0  # fixed executor cost added to every backward task
    weight_grad_fraction: float = 0.5  # share of a backward that is W, for graphs that split it

    def __post_init__(self):
        if self.straggler_scope not in ("task", "rank"):
            raise ValueError(f"straggler_scope must be 'task' or 'rank', got {self.straggler_scope!r}")
        if not 0.0 <= self.straggler_prob <= 1.0:
            raise ValueError(f"straggler_prob must lie in [0, 1], got {self.straggler_prob}")
        if self.linear < 0 or self.quadratic < 0 or self.backward_ratio <= 0 or self.jitter_sigma < 0:
            raise ValueError("DurationModel: linear, quadratic, jitter_sigma >= 0 and backward_ratio > 0")
        if self.forward_overhead < 0 or self.backward_overhead < 0:
            raise ValueError("DurationModel: forward_overhead and backward_overhead must be >= 0")
        if not 0.0 < self.weight_grad_fraction < 1.0:
            raise ValueError(f"weight_grad_fraction must lie in (0, 1), got {self.weight_grad_fraction}")

    def base_forward(self, graph: TaskGraph, m: int) -> float:
        size = graph.sizes[m]
        return (self.linear * size + self.quadratic * size * size) / graph.V

    def sample(self, graph: TaskGraph, rng: np.random.Generator) -> "TaskDurations":
        """Draw every task's duration once, so every schedule of one seed sees the same draws."""
        P, V, M = graph.P, graph.V, graph.M
        base = np.array([self.base_forward(graph, m) for m in range(M)])
        # shape (P, phase, V, M)
        times = np.empty((P, 2, V, M))
        times[:, 0] = base
        times[:, 1] = base * self.backward_ratio
        if self.rank_speed is not None:
            if len(self.rank_speed) != P:
                raise ValueError(f"rank_speed has {len(self.rank_speed)} entries for P={P} ranks")
            times *= np.asarray(self.rank_speed, dtype=float).reshape(P, 1, 1, 1)
        if self.jitter_sigma > 0:
            s = self.jitter_sigma
            times *= np.exp(rng.normal(-0.5 * s * s, s, size=times.shape))
        if self.straggler_prob > 0 and self.straggler_factor != 1.0:
            shape = times.shape if self.straggler_scope == "task" else (P, 1, 1, 1)
            slow = rng.random(shape) < self.straggler_prob
            times *= np.where(slow, self.straggler_factor, 1.0)
        if graph.split_backward:
            backward = times[:, 1]
            times = np.stack(
                [times[:, 0], backward * (1.0 - self.weight_grad_fraction), backward * self.weight_grad_fraction],
                axis=1,
            )
        # Added after the random draws, so a zero overhead leaves every draw (and seed) unchanged.
        times[:, 0] += self.forward_overhead
        times[:, 1:] += self.backward_overhead
        return TaskDurations(graph, times.reshape(-1).tolist())


class TaskDurations:
    """Sampled durations, looked up by (rank, task)."""

    def __init__(self, graph: TaskGraph, flat: list[float]):
        self._V, self._M = graph.V, graph.M
        self._P = graph.P
        self._placement = graph.placement
        self._phases = len(graph.phases)
        self.flat = flat

    def index(self, rank: int, task: Task) -> int:
        return ((rank * self._phases + task.phase) * self._V + task.chunk) * self._M + task.microbatch

    def __call__(self, rank: int, task: Task) -> float:
        return self.flat[self.index(rank, task)]

    def rank_work(self, rank: int) -> float:
        n = self._phases * self._V * self._M
        return math.fsum(self.flat[rank * n:(rank + 1) * n])

    def pipeline_bound(self, delays: Sequence[float]) -> float:
        """A makespan lower bound that counts fill and drain: rank r cannot start before some
        microbatch's forward crossed the stages before its first stage s (stages 0..s-1; on the
        interleaved and v placements chunk 0 of ranks 0..r-1), works at least its total, and
        after its last task some microbatch's backward must still cross stages s-1..0. A hop
        between two stages costs the message delay where they are on different ranks.

        With split backwards only B crosses ranks, and W tasks can run during that last crossing:
        rank r's F and B work must end before it, and all its work before the end. The crossing
        then ends with the first stage computing that microbatch's W."""
        times = np.asarray(self.flat).reshape(self._P, self._phases, self._V, self._M)
        hop = np.asarray(delays, dtype=float)  # per microbatch, one rank-to-rank message
        work = times.reshape(self._P, -1).sum(axis=1)
        crossing_work = times[:, :2].reshape(self._P, -1).sum(axis=1)  # F and B: equals work unsplit
        placement = self._placement
        first_stages = [placement.stage(r, 0) for r in range(self._P)]
        crossed = range(max(first_stages))  # the stages some rank waits to be crossed
        located = [placement.location(s) for s in crossed]
        hops = np.array([0.0 if placement.next_on_same_rank(s) else 1.0 for s in crossed]).reshape(-1, 1)
        forward_path = np.cumsum(np.array([times[r, 0, c, :] for r, c in located]).reshape(-1, self._M)
                                 + hops * hop, axis=0)  # [s] = through stages 0..s
        backward_path = np.cumsum(np.array([times[r, 1, c, :] for r, c in located]).reshape(-1, self._M)
                                  + hops * hop, axis=0)
        if self._phases == 3:
            first_rank, first_chunk = placement.location(placement.first_stage)
            backward_path = backward_path + times[first_rank, 2, first_chunk, :]
        best = 0.0
        for r, s in enumerate(first_stages):
            if s == placement.first_stage:
                best = max(best, work[r])
                continue
            fill, drain = forward_path[s - 1].min(), backward_path[s - 1].min()
            best = max(best, fill + max(crossing_work[r] + drain, work[r]))
        return float(best)


@dataclasses.dataclass(frozen=True)
class CommModel:
    """A message takes latency + bytes / bandwidth; its bytes are the microbatch's act_bytes.

    Messages do not contend; a message between two chunks of the same rank (P=1, or stages P-1
    and P of the v placement) is free."""

    latency: float = 0.0
    bandwidth: float = math.inf  # bytes per time unit

    def __post_init__(self):
        if self.latency < 0 or self.bandwidth <= 0:
            raise ValueError("CommModel: latency >= 0 and bandwidth > 0")

    def transfer_time(self, nbytes: int) -> float:
        if math.isinf(self.bandwidth):
            return self.latency
        return self.latency + nbytes / self.bandwidth
