"""The true cost of a pack (issue 60): a microbatch's work counts each document's causal attention
beside its tokens, its activation bytes its tokens only; the relative memory budget ('1.25x'); the
simulator's packed long-context workload; and that the dynamic policy sees unequal work."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_dpp.models import memory_model as mm
from megatron_dpp.models.gpt import (GPT_SPEC, gpt_microbatch_tokens, gpt_microbatch_work,
                                     segment_lengths)
from megatron_dpp.models.llama import LLAMA_SPEC
from megatron_dpp.pipeline import (RelativeBudget, TaskGraph, budget_bytes_for, make_scheduler,
                                   parse_memory_budget, provisioned_budget_bytes)
from megatron_dpp.pipeline.adaptive import adaptive_microbatch_order
from megatron_dpp.pipeline.placement import interleaved
from megatron_dpp.pipeline.work import segments_work
from megatron_dpp.runtime.executor import IterationRunner
from megatron_dpp.sim import CommModel, DurationModel, PackedLongContext, simulate

HIDDEN = 4096
# A TransformerConfig's fields the work reads (models/flags.py activation_config's stand-in).
CONFIG = SimpleNamespace(num_layers=2, hidden_size=HIDDEN, num_attention_heads=32,
                         ffn_hidden_size=4 * HIDDEN, hidden_dropout=0.0, attention_dropout=0.0,
                         pipeline_dtype="torch.bfloat16")


def _pack(lengths):
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    return {"tokens": torch.zeros(1, int(cu[-1])), "cu_seqlens": cu}


def test_gpt_attention_term_is_the_flop_models_causal_half():
    # GPT, f = 4h, one group per head: dense 24h^2 per token, attention 4h per token pair (over
    # the full s x s), causal half: c = 2h / 24h^2 = 1/(12h).
    per_token, per_token_pair = mm.layer_flop_terms(mm.config_layer_shape("gpt", CONFIG))
    assert per_token == 24 * HIDDEN ** 2 and per_token_pair == 4 * HIDDEN
    c = mm.causal_attention_work_per_token_pair(mm.config_layer_shape("gpt", CONFIG))
    assert c == pytest.approx(1 / (12 * HIDDEN))


def test_one_long_document_costs_more_than_many_short_of_equal_tokens_exactly():
    work = GPT_SPEC.microbatch_work(CONFIG)
    c = 1 / (12 * HIDDEN)
    long, short = _pack([8192]), _pack([1024] * 8)
    assert gpt_microbatch_tokens(long) == gpt_microbatch_tokens(short) == 8192
    assert work(long) == round(8192 + c * 8192 ** 2) == 9557
    assert work(short) == round(8192 + c * 8 * 1024 ** 2) == 8363
    assert work(long) > work(short)
    # Llama's shape (SwiGLU, its own ffn) gives its own c, still from the same FLOP model.
    llama = LLAMA_SPEC.microbatch_work(CONFIG)
    assert llama(long) > llama(short) > 8192


def test_segments_come_from_cu_seqlens_folded_or_per_sample_else_sample_rows():
    folded = _pack([3, 5, 2])
    assert segment_lengths(folded) == [3, 5, 2]
    per_sample = {"tokens": torch.zeros(2, 6),
                  "cu_seqlens": torch.tensor([[0, 2, 6], [0, 3, 6]], dtype=torch.int32)}
    assert segment_lengths(per_sample) == [2, 4, 3, 3]
    assert segment_lengths({"tokens": torch.zeros(3, 7)}) == [7, 7, 7]  # unpacked: one a row
    assert segment_lengths(torch.zeros(5)) == [5]
    assert gpt_microbatch_work(0.5, {"tokens": torch.zeros(2, 4)}) == segments_work([4, 4], 0.5) == 24
    assert gpt_microbatch_work(0.5, {"labels": torch.zeros(3)}) == 1


def test_the_runtime_agrees_on_work_and_tokens_apart():
    """_local_sizes hands the agreement each microbatch's work, then its tokens."""
    items = [_pack([8192]), _pack([1024] * 8)]
    runner = SimpleNamespace(
        session=SimpleNamespace(microbatch_work=GPT_SPEC.microbatch_work(CONFIG),
                                microbatch_tokens=gpt_microbatch_tokens),
        placement=interleaved(2, 1), rank=0,
        batch=SimpleNamespace(has_source=lambda chunk: True, items=lambda chunk: items))
    assert IterationRunner._local_sizes(runner) == [9557, 8363, 8192, 8192]
    runner.session.microbatch_tokens = None  # a caller whose work is its tokens
    assert IterationRunner._local_sizes(runner)[2:] == [9557, 8363]


@pytest.mark.parametrize("text", ["1.25x", "1x", "2.5X"])
def test_relative_budget_is_that_multiple_of_provisioned_on_every_rank(text):
    budget = parse_memory_budget(text)
    graph = TaskGraph(4, 1, 16, [100 + m for m in range(16)], max_act_bytes=1000)
    provisioned = provisioned_budget_bytes(graph)
    assert provisioned == 4 * 1000  # 1F1B's first rank holds P = 4 full microbatches
    for rank in range(4):
        assert budget_bytes_for(budget, graph, rank) == int(budget.multiplier * provisioned)
    assert str(budget) == text.lower()


def test_relative_budget_below_one_is_refused_in_one_line():
    with pytest.raises(ValueError) as refused:
        parse_memory_budget("0.9x", what="--dpp-memory-budget")
    assert "\n" not in str(refused.value) and "at least 1x" in str(refused.value)
    with pytest.raises(ValueError, match="at least 1x"):
        RelativeBudget(0.5)


def test_packed_workload_is_deterministic_whole_and_priced_per_window():
    workload = PackedLongContext(8192, per_token_pair=1 / (12 * HIDDEN))
    packs = workload.packs(16, np.random.default_rng(3))
    again = workload.packs(16, np.random.default_rng(3))
    assert packs == again and len(packs) == 16
    # Every window holds the same tokens; its documents, cut to the window, in the drawn order.
    pieces = workload.cut(workload.documents(np.random.default_rng(3), 64))
    stream = [length for pack in packs for length in pack.documents]
    assert stream == pieces[:len(stream)]
    for pack in packs:
        assert sum(pack.documents) + pack.padding == 8192 and all(d <= 8192 for d in pack.documents)
    assert workload.work(packs) == [segments_work(p.segments, 1 / (12 * HIDDEN)) for p in packs]
    graph = workload.graph(4, 1, 16, seed=3, bytes_per_token=2)
    assert graph.act_bytes == [8192 * 2] * 16 and graph.max_act_bytes == 8192 * 2
    assert len(set(graph.sizes)) > 1  # equal bytes, unequal work


def test_the_dynamic_policy_orders_unequal_work_differently_than_equal():
    """Packs of equal tokens: priced by tokens every microbatch is alike and dpp:adaptive keeps the
    batch order; priced with the attention term it puts the costly packs where its order wants
    them, and the simulator's time follows the work."""
    workload = PackedLongContext(32768, per_token_pair=1 / (12 * HIDDEN))
    unequal = workload.graph(4, 1, 16, seed=0)
    equal = TaskGraph(4, 1, 16, [32768] * 16, unequal.act_bytes, max_act_bytes=unequal.max_act_bytes)
    by_tokens = make_scheduler("dpp:adaptive", equal, 0).microbatch_order
    by_work = make_scheduler("dpp:adaptive", unequal, 0).microbatch_order
    assert by_tokens == list(range(16))
    assert by_work == adaptive_microbatch_order(unequal.sizes, 4, 1) != by_tokens
    result = simulate(unequal, "dpp:adaptive", DurationModel(), CommModel(), seed=0)
    assert result.lower_bound == pytest.approx(3 * sum(unequal.sizes))  # F + 2F per window
