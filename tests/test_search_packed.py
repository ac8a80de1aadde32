"""The strategy search on packed data with per-document attention (--packed-document-distribution,
issue 60): equal-token windows of long documents are dearer than windows of short ones, uniform
packs price as full windows, the windows are cut from one seeded document stream, and bad flag
combinations are one line."""
from __future__ import annotations

import pytest

from megatron_dpp.pipeline import DYNAMIC_SCHEDULES
from megatron_dpp.search import cli, cost, space, strategy
from megatron_dpp.search.errors import SearchInputError
from megatron_dpp.search.hardware import HardwareProfile
from megatron_dpp.search.lengths import PACKED_FLAG, microbatch_documents, parse_distribution
from megatron_dpp.search.memory_model import ModelShape

WINDOW = 1024
LONG, SHORT = "lognormal:4096:0.5", "lognormal:64:0.5"


def shape(**changes) -> ModelShape:
    fields = dict(model="gpt", num_layers=8, hidden_size=256, num_attention_heads=16, ffn_hidden_size=1024,
                  seq_length=WINDOW, padded_vocab_size=1024, max_position_embeddings=WINDOW, dtype="fp32")
    fields.update(changes)
    return ModelShape(**fields)


def hardware() -> HardwareProfile:
    sizes = (2, 4)
    return HardwareProfile(
        num_nodes=1, gpus_per_node=4,
        allreduce_busbw_gbps={(size, flag): 100.0 for size in sizes for flag in (True, False)},
        p2p_gbps={size: 100.0 for size in sizes}, overlap_coefficient=1.1, sp_time_ms={},
        matmul_tflops={"fp32": 1.0, "bf16": 4.0}, source="test figures")


def problem(packed: str | None = None, **changes) -> cost.Problem:
    return cost.Problem(shape=shape(), global_batch_size=16, hardware=hardware(), memory_budget_bytes=10**15,
                        packed=None if packed is None else parse_distribution(packed, PACKED_FLAG),
                        **changes)


def layout(**changes) -> space.Layout:
    fields = dict(tp=1, pp=4, vpp=1, dp=1, micro_batch_size=1, num_microbatches=16, recompute="none",
                  distributed_optimizer=False, sequence_parallel=False, schedule=space.megatron_schedule(1),
                  split_backward=False)
    fields.update(changes)
    return space.Layout(**fields)


LAYOUTS = [layout(), layout(micro_batch_size=2, num_microbatches=8),
           layout(vpp=2, schedule=space.megatron_schedule(2), recompute="selective"),
           layout(schedule=DYNAMIC_SCHEDULES[0], split_backward=True)]


def test_windows_are_full_cut_from_one_seeded_document_stream():
    long = parse_distribution(LONG, PACKED_FLAG)
    documents = microbatch_documents(long, 12, 2, WINDOW)
    assert len(documents) == 12 and all(sum(pieces) == 2 * WINDOW for pieces in documents)
    assert documents == microbatch_documents(long, 12, 2, WINDOW)  # seeded: reproducible
    assert any(pieces[0] == WINDOW for pieces in documents)  # a long document runs over a window
    short = microbatch_documents(parse_distribution(SHORT, PACKED_FLAG), 4, 1, WINDOW)
    assert all(len(pieces) > 4 for pieces in short)
    assert microbatch_documents(parse_distribution(f"uniform:{WINDOW}:{WINDOW}"), 3, 2, WINDOW) == \
        [(WINDOW, WINDOW)] * 3


@pytest.mark.parametrize("priced", LAYOUTS, ids=lambda item: item.describe())
def test_long_documents_make_larger_microbatches_at_equal_act_bytes(priced):
    long, short = cost.Pricer(problem(LONG)), cost.Pricer(problem(SHORT))
    (long_graph, _), (short_graph, _) = long.graph(priced, 8), short.graph(priced, 8)
    window_bytes = long.chunk_activation_bytes(priced, WINDOW)
    assert list(long_graph.act_bytes) == list(short_graph.act_bytes) == [window_bytes] * 8
    assert long_graph.max_act_bytes == short_graph.max_act_bytes == window_bytes
    assert long_graph.sizes != short_graph.sizes
    assert min(long_graph.sizes) > max(short_graph.sizes)
    assert max(long_graph.sizes) <= 1.0 + 1e-12 and min(short_graph.sizes) > 0.5
    # A size is the linear part at the window plus the attention from sum of s_i^2.
    full = long.layer(priced.micro_batch_size, WINDOW, 1, False, priced.recompute)
    pieces = short.documents(priced)[0]
    pairs = sum(s * s for s in pieces) / (priced.micro_batch_size * WINDOW ** 2)
    assert short_graph.sizes[0] == pytest.approx(1.0 - full.attention_ms / full.forward_ms * (1.0 - pairs))


@pytest.mark.parametrize("priced", LAYOUTS, ids=lambda item: item.describe())
def test_longer_documents_cost_more_at_the_same_tokens(priced):
    times = {}
    for spec in (LONG, SHORT, None):
        pricer = cost.Pricer(problem(spec))
        times[spec] = pricer.price(priced, pricer.estimate(priced))
    assert times[LONG].time_ms > times[SHORT].time_ms * 1.05
    assert times[LONG].time_ms <= times[None].time_ms * (1 + 1e-9)
    assert times[LONG].memory_bytes == times[SHORT].memory_bytes == times[None].memory_bytes


@pytest.mark.parametrize("priced", LAYOUTS, ids=lambda item: item.describe())
def test_uniform_packs_price_as_full_windows(priced):
    packed = cost.Pricer(problem(f"uniform:{WINDOW}:{WINDOW}"))
    full = cost.Pricer(problem())
    assert packed.durations(priced)[1] == pytest.approx([1.0] * priced.num_microbatches)
    a, b = (pricer.price(priced, pricer.estimate(priced)) for pricer in (packed, full))
    assert a.time_ms == pytest.approx(b.time_ms) and a.memory_bytes == b.memory_bytes
    assert a.activation_peak_bytes == b.activation_peak_bytes


def test_a_problem_is_not_both_padded_and_packed():
    with pytest.raises(SearchInputError, match="exclude each other"):
        problem(LONG, lengths=parse_distribution("uniform:1:9"))


SMALL_ARGS = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "16",
              "--seq-length", "512", "--global-batch-size", "16", "--num-nodes", "1",
              "--num-gpus-per-node", "4", "--hardware", "8xH100-nvlink-ib400", "--memory-budget-gb", "80",
              "--bf16", "--top", "3"]


@pytest.mark.parametrize("change,message", [
    ([PACKED_FLAG, LONG, "--variable-seq-lengths", "--seq-length-distribution", "uniform:1:9"],
     "--packed-document-distribution and --variable-seq-lengths exclude each other"),
    ([PACKED_FLAG, LONG, "--seq-length-distribution", "uniform:1:9"],
     "--packed-document-distribution and --seq-length-distribution exclude each other"),
    ([PACKED_FLAG, "normal:1:2"], "--packed-document-distribution 'normal:1:2': expected uniform"),
    ([PACKED_FLAG, "lognormal:0:1"], "--packed-document-distribution 'lognormal:0:1': needs MEAN >= 1"),
    ([PACKED_FLAG, LONG, "--model", "bert"], "--packed-document-distribution with --model bert"),
])
def test_bad_packed_flags_are_one_line_and_exit_2(change, message, capsys):
    assert cli.main(SMALL_ARGS + change) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_the_report_says_packed_with_per_document_attention(tmp_path, capsys):
    from megatron_dpp import arguments

    path = tmp_path / "strategy.json"
    assert cli.main(SMALL_ARGS + [PACKED_FLAG, "lognormal:256:1.5", "--output-strategy", str(path)]) == 0
    out = capsys.readouterr().out
    assert ("packed documents: lognormal:256:1.5, in full windows of 512 tokens, attention per document "
            "(--dataloader-inter-document-masking") in out
    content = strategy.read_strategy(path)
    assert content["sources"]["packed_documents"] == "lognormal:256:1.5"
    assert content["sources"]["seq_lengths"] is None
    flags = content["megatron_flags"]
    assert "--dataloader-inter-document-masking" in flags and "--variable-seq-lengths" not in flags
    args = arguments.build_parser().parse_args(flags)
    assert args.dataloader_inter_document_masking
    assert "--packed-document-distribution SPEC" in cli.build_parser().format_help()
