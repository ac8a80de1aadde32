"""Unit tests of the DPP runtime's single-process pieces: flags, budget parsing, global-batch
prefetch and reorder, activation-byte estimates, decision messages."""
from types import SimpleNamespace

import pytest
import torch

from megatron_dpp.models import memory_model as mm
from megatron_dpp.pipeline import Phase, RelativeBudget, Task, parse_memory_budget
from megatron_dpp.runtime.batch import GlobalBatch, agree_on_sizes
from megatron_dpp.runtime.config import DPPConfig
from megatron_dpp.runtime.tensor_parallel import DecisionChannel


@pytest.mark.parametrize("text,expected", [
    ("auto", None), ("AUTO", None), ("1024", 1024), ("2KiB", 2048), ("1.5GB", 1_500_000_000),
    ("3MiB", 3 * 2**20), ("provisioned", "provisioned"), (" Provisioned ", "provisioned"),
    ("1.25x", RelativeBudget(1.25)), ("1X", RelativeBudget(1.0)),
])
def test_memory_budget_parses_bytes_and_auto(text, expected):
    assert parse_memory_budget(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "-5", "0", "12XB", "GiB", "x", "0.9x", "infx", "nanx"])
def test_memory_budget_rejects_nonsense_with_a_hint(text):
    with pytest.raises(ValueError, match="--dpp-memory-budget"):
        parse_memory_budget(text, what="--dpp-memory-budget")


def test_config_takes_every_budget_value_and_refuses_others():
    for budget in (None, "auto", "provisioned", RelativeBudget(1.25), 2**30):
        assert DPPConfig(memory_budget_bytes=budget).memory_budget_bytes == budget
    for budget in (0, -1, "lots"):
        with pytest.raises(ValueError, match="DPP memory budget"):
            DPPConfig(memory_budget_bytes=budget)


def test_config_rejects_nonpositive_timeout():
    with pytest.raises(ValueError):
        DPPConfig(timeout_s=0)


def test_global_batch_is_fetched_once_and_served_in_any_order():
    pulled = []

    def source():
        for i in range(4):
            pulled.append(i)
            yield {"tokens": torch.zeros(1, 10 + i)}

    batch = GlobalBatch([source(), None], num_microbatches=4)
    assert batch.feed(1, 0) is None  # no iterator for this chunk: forward_step gets None, as before
    assert pulled == []  # nothing fetched until a forward reads data
    third = next(batch.feed(0, 2))
    assert pulled == [0, 1, 2, 3] and third["tokens"].shape[1] == 12
    assert next(batch.feed(0, 0))["tokens"].shape[1] == 10
    feed = batch.feed(0, 1)
    next(feed)
    with pytest.raises(RuntimeError, match="twice"):
        next(feed)


def test_global_batch_reports_a_short_iterator():
    batch = GlobalBatch([iter([1, 2])], num_microbatches=3)
    with pytest.raises(RuntimeError, match="ran out after 2 of 3"):
        batch.items(0)


def test_microbatch_tokens_counts_tokens():
    from megatron_dpp.models.gpt import gpt_microbatch_tokens as microbatch_tokens

    assert microbatch_tokens({"tokens": torch.zeros(2, 7)}) == 14
    assert microbatch_tokens({"labels": torch.zeros(3)}) == 1
    assert microbatch_tokens(torch.zeros(5, 3)) == 15


def test_sizes_without_any_collective_group_are_local():
    assert agree_on_sizes([3, 1, 2], 3, []) == [3, 1, 2]
    assert agree_on_sizes(None, 2, []) == [1, 1]


def _config(**changes):
    """The TransformerConfig fields the runtime's activation estimate reads."""
    fields = dict(num_layers=8, hidden_size=32, ffn_hidden_size=128, num_attention_heads=4,
                  hidden_dropout=0.1, attention_dropout=0.1, tensor_model_parallel_size=1,
                  sequence_parallel=False, recompute_granularity=None, recompute_method=None,
                  recompute_num_layers=None, pipeline_dtype=torch.float32)
    return SimpleNamespace(**{**fields, **changes})


def _layer(length, micro_batch, tp=1, sp=False, mode="none", dtype="fp32"):
    shape = mm.model_shape("gpt", 8, 32, 4, length, 1, ffn_hidden_size=128, dtype=dtype)
    return mm.layer_activation_bytes(shape, micro_batch, tp, sp, mode)


def test_activation_estimate_is_the_search_model_per_microbatch_length():
    """Each microbatch at its own length (tokens / micro-batch size), the chunk's layers (8 over
    P=2 x V=2), the config's dtype, tensor and sequence parallelism and recompute."""
    estimate = mm.chunk_activation_bytes
    short, long = estimate("gpt", _config(), [2 * 64, 2 * 128], 2, 2, 2)
    assert (short, long) == (2 * _layer(64, 2), 2 * _layer(128, 2))
    assert long > 2 * short  # the attention scores are quadratic in the length
    (half,) = estimate("gpt", _config(pipeline_dtype=torch.bfloat16), [128], 2, 2, 2)
    assert half == 2 * _layer(64, 2, dtype="bf16") and half < short
    (tp2,) = estimate("gpt", _config(tensor_model_parallel_size=2, sequence_parallel=True),
                      [128], 2, 2, 2)
    assert tp2 == 2 * _layer(64, 2, tp=2, sp=True) and tp2 < short
    (selective,) = estimate("gpt", _config(recompute_granularity="selective"), [128], 2, 2, 2)
    assert selective == 2 * _layer(64, 2, mode="selective")
    full = _config(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    assert estimate("gpt", full, [128], 2, 1, 1) == [8 * 64 * 2 * 32 * 4]  # each layer's input
    full.recompute_num_layers = 3  # one checkpoint per 3 layers: ceil(8 / 3) inputs kept
    assert estimate("gpt", full, [128], 2, 1, 1) == [3 * 64 * 2 * 32 * 4]
    full.recompute_method = "block"  # the first 3 layers checkpointed, 5 keep everything
    assert estimate("gpt", full, [128], 2, 1, 1) == [3 * 64 * 2 * 32 * 4 + 5 * _layer(64, 2)]
    # An uneven split sizes every rank's budget by the fullest chunk: 8 layers as 2 | 6.
    uneven = _config(num_layers_in_first_pipeline_stage=2)
    assert estimate("gpt", uneven, [128], 2, 1, 2) == [6 * _layer(64, 2)]


def test_decision_round_trip():
    class Recorder:
        def __init__(self):
            self.sent = []

        def isend(self, tensor, peer, tag):
            self.sent.append((tensor.clone(), peer, tag))
            return object()

    transport = Recorder()
    channel = DecisionChannel(transport, tp_ranks=[4, 5, 6], my_rank=4, tag_of=lambda k: 100 + k)
    assert channel.is_leader and channel.followers == [5, 6]
    channel.publish(Task(Phase.B, 7, 1))
    channel.publish(Task(Phase.F, 3, 0))
    assert [(peer, tag) for _, peer, tag in transport.sent] == [(5, 100), (6, 100), (5, 101), (6, 101)]
    assert DecisionChannel.decode(transport.sent[2][0]) == Task(Phase.F, 3, 0)
    follower = DecisionChannel(transport, tp_ranks=[4, 5, 6], my_rank=6, tag_of=lambda k: k)
    assert not follower.is_leader and follower.leader == 4


def _dpp_args(virtual_pipeline_model_parallel_size=None, **overrides):
    import argparse

    from megatron_dpp.parallel.layout import ParallelLayout

    values = dict(use_dpp=True, dpp_policy="dpp:adaptive", dpp_memory_budget="auto", dpp_timeout=30.0,
                  dpp_stage_placement="interleaved", dpp_schedule=None,
                  pipeline_model_parallel_size=2, context_parallel_size=1,
                  parallel=ParallelLayout(
                      virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size))
    values.update(overrides)
    return argparse.Namespace(**values)


def validate_dpp_args(args):
    """The DPP flags' checks alone: no model, so no budget minimum (megatron_dpp.arguments')."""
    from megatron_dpp.runtime.flags import validate_dpp_args

    validate_dpp_args(args, minimum_budget_bytes=None)


def test_dpp_flags_validate_and_convert_the_budget():
    args = _dpp_args(dpp_memory_budget="1GiB")
    validate_dpp_args(args)
    assert args.dpp_memory_budget_bytes == 2**30
    args = _dpp_args()
    validate_dpp_args(args)
    assert args.dpp_memory_budget_bytes is None
    args = _dpp_args(dpp_memory_budget="provisioned")
    validate_dpp_args(args)
    assert args.dpp_memory_budget_bytes == "provisioned"


@pytest.mark.parametrize("overrides,message", [
    ({"dpp_memory_budget": "huge"}, "--dpp-memory-budget"),
    ({"dpp_timeout": 0.0}, "--dpp-timeout"),
    ({"pipeline_model_parallel_size": 1}, "--pipeline-model-parallel-size 2"),
    ({"dpp_policy": "interleaved-1f1b"}, "virtual stages"),
    ({"dpp_policy": "1f1b", "virtual_pipeline_model_parallel_size": 2}, "interleaved-1f1b"),
])
def test_bad_dpp_flags_are_one_line_errors(overrides, message):
    from megatron_dpp.arguments import ArgsError

    with pytest.raises(ArgsError, match=message) as error:
        validate_dpp_args(_dpp_args(**overrides))
    assert "\n" not in str(error.value)


def test_use_dpp_on_the_command_line_exits_2_with_one_line(capsys):
    from megatron_dpp.arguments import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--use-dpp", "--dpp-policy", "nonsense"])
    assert exit_info.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


# ---- the stall watchdog around a training step ------------------------------------------------
def test_stall_watchdog_reports_an_armed_phase_that_stops_progressing(capsys):
    import threading

    from megatron_dpp.runtime.watchdog import ProgressClock, StallWatchdog

    exited = threading.Event()
    codes = []

    def fake_exit(code):
        codes.append(code)
        exited.set()

    clock = ProgressClock()
    watchdog = StallWatchdog(0.4, exit_code=3, clock=clock, exit_fn=fake_exit)
    try:
        watchdog.arm("the optimizer step")
        assert exited.wait(timeout=10), "the watchdog never fired on a stalled phase"
    finally:
        watchdog.close()
    assert codes[0] == 3
    err = capsys.readouterr().err
    assert "no progress for 0.4 s (watchdog)" in err and "stuck in: the optimizer step" in err


def test_stall_watchdog_is_quiet_when_disarmed_or_progressing():
    import time

    from megatron_dpp.runtime.watchdog import ProgressClock, StallWatchdog

    codes = []
    clock = ProgressClock()
    watchdog = StallWatchdog(0.4, exit_code=3, clock=clock, exit_fn=codes.append)
    try:
        watchdog.arm("the pipeline schedule")
        for _ in range(10):  # 1 s of steady progress, longer than the timeout
            time.sleep(0.1)
            clock.tick()
        watchdog.disarm()
        time.sleep(0.8)  # stalled, but not watched
    finally:
        watchdog.close()
    assert codes == []
