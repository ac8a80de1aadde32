"""The simulator's DurationModel per-task overhead: zero changes nothing, a positive one adds exactly its cost to
every task and, on a pipeline, to the simulated makespan."""
import pytest

from megatron_dpp.pipeline import Phase, TaskGraph
from megatron_dpp.sim import DurationModel, simulate


def _graph():
    sizes = [64, 10, 120, 64, 30, 64, 90, 64]
    return TaskGraph(4, 1, 8, sizes, [s * 4096 for s in sizes])


def test_zero_overhead_leaves_the_draws_unchanged():
    """With no overhead every duration is the model's own draw: without jitter exactly the
    formula (forward = linear*size/V, backward = ratio x that); with jitter and stragglers the
    draws a positive overhead shifts are the very same ones (the seed's stream is unchanged)."""
    import numpy as np

    graph = _graph()
    exact = DurationModel(linear=0.3, backward_ratio=2.0).sample(graph, np.random.default_rng(3))
    for rank in range(graph.P):
        for task in graph.tasks(rank):
            forward = 0.3 * graph.sizes[task.microbatch] / graph.V
            expected = forward if task.phase is Phase.F else 2.0 * forward
            assert exact(rank, task) == pytest.approx(expected, rel=1e-12)
    noisy = dict(linear=0.3, jitter_sigma=0.2, straggler_prob=0.2, straggler_factor=3.0)
    plain = DurationModel(**noisy).sample(graph, np.random.default_rng(3))
    shifted = DurationModel(**noisy, forward_overhead=1.0, backward_overhead=1.0).sample(
        graph, np.random.default_rng(3))
    assert [d + 1.0 for d in plain.flat] == pytest.approx(shifted.flat, rel=1e-12)


def test_overhead_is_added_once_per_task_and_phase():
    import numpy as np

    graph = _graph()
    base = DurationModel(linear=0.3, straggler_prob=0.3, straggler_factor=3.0)
    loaded = DurationModel(linear=0.3, straggler_prob=0.3, straggler_factor=3.0,
                           forward_overhead=0.5, backward_overhead=0.25)
    a = base.sample(graph, np.random.default_rng(1))
    b = loaded.sample(graph, np.random.default_rng(1))
    for rank in range(graph.P):
        for task in graph.tasks(rank):
            extra = 0.5 if task.phase is Phase.F else 0.25
            assert b(rank, task) == pytest.approx(a(rank, task) + extra)
    # 1F1B on 4 ranks: the critical path holds at least every task of one rank.
    grown = simulate(graph, "1f1b", loaded).makespan - simulate(graph, "1f1b", base).makespan
    assert grown >= graph.M * (0.5 + 0.25)


def test_negative_overhead_is_refused():
    with pytest.raises(ValueError, match="overhead"):
        DurationModel(forward_overhead=-1.0)
