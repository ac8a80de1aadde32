"""The split backward as one feature object (runtime/split_backward.py's SplitBackward): when the
executor gets one, what it registers in the handler table, its memory accounting, the end of an
iteration, and that without --dpp-split-backward the executor runs F and B alone, as before.
The B/W runs themselves are covered by test_split_backward_runtime.py."""
import argparse
from pathlib import Path

import pytest
import torch

from _runtime_harness import run_pipeline
from megatron_dpp.pipeline import Phase, Task
from megatron_dpp.runtime.config import DPPConfig
from megatron_dpp.runtime.executor import DPPSession
from megatron_dpp.runtime.handlers import BackwardHandler, ForwardHandler
from megatron_dpp.runtime.split_backward import (
    DeferringForwardHandler,
    InputGradHandler,
    SplitBackward,
    WeightGradHandler,
)

SIZES = [3, 1, 4, 1]


class _FakeStash:
    """WeightGradStash's interface as the feature uses it: keys with work and their bytes."""

    def __init__(self):
        self.work = {}
        self.discarded = 0

    def bytes_held(self, key):
        return self.work.get(key, 0)

    def keys(self):
        return list(self.work)

    def check_drained(self):
        if self.work:
            raise RuntimeError(f"left behind: {sorted(self.work)}")

    def discard(self):
        self.work.clear()
        self.discarded += 1


def _session(split_backward: bool, stash=None, bytes_fn=None) -> DPPSession:
    return DPPSession(config=DPPConfig(split_backward=split_backward), transport=None,
                      microbatch_work=len, activation_bytes_fn=None,
                      weight_grad_bytes_fn=bytes_fn, stash=stash)


def _per_token(_models, sizes, _dtype):
    return [10 * tokens for tokens in sizes]


def _feature(stash=None) -> SplitBackward:
    config = argparse.Namespace(pipeline_dtype=torch.float32)
    return SplitBackward.for_iteration(_session(True, stash or _FakeStash(), _per_token), [],
                                       config, False, SIZES, 16)


def test_the_feature_exists_only_for_split_training_iterations():
    config = argparse.Namespace(pipeline_dtype=torch.float32)
    assert SplitBackward.for_iteration(_session(False), [], config, False, SIZES, 16) is None
    evaluation = _session(True, _FakeStash(), _per_token)
    assert SplitBackward.for_iteration(evaluation, [], config, True, SIZES, 16) is None
    with pytest.raises(ValueError, match="split_backward needs the session's stash"):
        SplitBackward.for_iteration(_session(True), [], config, False, SIZES, 16)


def test_the_estimate_per_microbatch_and_for_the_largest_one():
    feature = _feature()
    assert feature.held_bytes == [30, 10, 40, 10]
    assert feature.record.weight_grad_bytes_estimated == [30, 10, 40, 10]
    assert feature.largest_held_bytes == 160
    assert feature.graph_options == {"split_backward": True}


def test_measured_bytes_count_from_b_to_w():
    stash = _FakeStash()
    feature = _feature(stash)
    stash.work[(0, 0)] = 7
    feature.work_stored(Task(Phase.B, 0, 0))
    stash.work[(1, 0)] = 5
    feature.work_stored(Task(Phase.B, 1, 0))
    assert feature.memory_counters() == {"stash_bytes": 12}
    assert feature.state_lines() == ["weight-gradient stash: 12 bytes, keys 0.0 1.0"]
    feature.work_ran(Task(Phase.W, 0, 0))
    assert feature.memory_counters() == {"stash_bytes": 5}
    assert feature.record.weight_grad_bytes_measured == {(0, 0): 7, (1, 0): 5}
    assert feature.record.peak_stash_bytes == 12


def test_the_end_of_an_iteration_checks_the_stash_and_a_failure_empties_it():
    stash = _FakeStash()
    feature = _feature(stash)
    feature.end_iteration(failed=False)  # empty: nothing to do
    assert stash.discarded == 0
    stash.work[(2, 0)] = 3
    with pytest.raises(RuntimeError, match="left behind"):
        feature.end_iteration(failed=False)
    assert stash.keys() == [] and stash.discarded == 1  # the next iteration finds nothing stale
    stash.work[(3, 0)] = 3
    feature.end_iteration(failed=True)
    assert stash.keys() == [] and stash.discarded == 2


@pytest.mark.timeout(60)
def test_the_feature_fills_the_handler_table():
    tables = {}

    def keep_table(rank, runner):
        tables[rank] = {phase: type(handler) for phase, handler in runner.handlers.items()}
        runner.run()

    split = run_pipeline(2, 1, SIZES, "dpp:adaptive", split_backward=True, rank_fn=keep_table)
    assert not split.errors, split.errors
    assert tables[0] == {Phase.F: DeferringForwardHandler, Phase.B: InputGradHandler,
                         Phase.W: WeightGradHandler}

    fused = run_pipeline(2, 1, SIZES, "dpp:adaptive", rank_fn=keep_table)
    assert not fused.errors, fused.errors
    assert tables[0] == {Phase.F: ForwardHandler, Phase.B: BackwardHandler}
    assert all(record.split_backward is None for record in fused.records.values())


def test_the_executor_names_no_task_kind_of_the_split():
    """The W task and the stash's calls live in the feature; the loop reaches them only through
    the handler table and its generic hooks."""
    source = (Path(__file__).resolve().parents[1] / "megatron_dpp/runtime/executor.py").read_text()
    for name in ("Phase.W", ".defer(", "check_drained", "discard(", "bytes_held", "_stash_held"):
        assert name not in source, name
