"""The strategy search (megatron_dpp.search: space, cost, engine, strategy, cli): known best layouts,
pruning against brute force, the no-fit and bad-flag exits, the strategy JSON, the 175B case."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dpp.pipeline import DYNAMIC_SCHEDULES
from megatron_dpp.pipeline.placement import INTERLEAVED, V_SHAPE
from megatron_dpp.pipeline.registry import ADAPTIVE, ZB_V
from megatron_dpp.search import cli, cost, engine, galvatron_strategy, space, strategy
from megatron_dpp.search.errors import SearchInputError
from megatron_dpp.search.hardware import HardwareProfile, load_hardware
from megatron_dpp.search.lengths import microbatch_lengths, parse_distribution
from megatron_dpp.search import memory_model as mm
from megatron_dpp.search.memory_model import ModelShape

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def small_shape(**changes) -> ModelShape:
    fields = dict(model="gpt", num_layers=8, hidden_size=256, num_attention_heads=16, ffn_hidden_size=1024,
                  seq_length=1024, padded_vocab_size=1024, max_position_embeddings=1024, dtype="fp32")
    fields.update(changes)
    return ModelShape(**fields)


def flat_hardware(gpus: int, allreduce_gbps: float, p2p_gbps: float, nodes: int = 1) -> HardwareProfile:
    world = gpus * nodes
    sizes = [size for size in range(2, world + 1) if world % size == 0]
    return HardwareProfile(
        num_nodes=nodes, gpus_per_node=gpus,
        allreduce_busbw_gbps={(size, flag): allreduce_gbps for size in sizes for flag in (True, False)},
        p2p_gbps={size: p2p_gbps for size in sizes}, overlap_coefficient=1.1, sp_time_ms={},
        matmul_tflops={"fp32": 1.0, "bf16": 4.0}, source="test figures")


def problem(shape=None, hardware=None, budget=10**15, batch=16, lengths=None) -> cost.Problem:
    return cost.Problem(shape=shape or small_shape(), global_batch_size=batch,
                        hardware=hardware or flat_hardware(4, 100.0, 100.0),
                        memory_budget_bytes=budget, lengths=lengths)


# --- the space ------------------------------------------------------------------------------------
def test_space_follows_megatron_rules():
    inputs = space.SpaceInputs(num_layers=8, num_attention_heads=6, ffn_hidden_size=1536,
                               global_batch_size=12, num_nodes=2, gpus_per_node=4)
    layouts = list(space.enumerate_layouts(inputs))
    assert layouts
    for layout in layouts:
        assert layout.tp * layout.pp * layout.dp == 8
        assert 4 % layout.tp == 0 and 6 % layout.tp == 0 and 8 % layout.pp == 0
        assert 12 % (layout.micro_batch_size * layout.dp) == 0
        assert layout.num_microbatches == 12 // (layout.micro_batch_size * layout.dp)
        assert (8 // layout.pp) % layout.vpp == 0
        if layout.vpp > 1:
            assert layout.pp >= 2 and layout.num_microbatches % layout.pp == 0
        assert not layout.distributed_optimizer or layout.dp > 1
        assert not layout.sequence_parallel or layout.tp > 1
        assert not layout.split_backward or (layout.use_dpp and not layout.sequence_parallel)
        assert not layout.use_dpp or layout.pp >= 2
        if not layout.use_dpp:
            assert layout.schedule == space.megatron_schedule(layout.vpp)
    assert {layout.tp for layout in layouts} == {1, 2}  # 4 does not divide 6 heads
    assert {layout.schedule for layout in layouts} >= set(DYNAMIC_SCHEDULES)
    assert any(layout.vpp > 1 for layout in layouts) and any(layout.split_backward for layout in layouts)


def test_uneven_splits_join_the_space_as_megatron_accepts_them():
    """With one chunk per rank the last stage may hold any count of layers that leaves the other
    stages an even share of at least one (--decoder-last-pipeline-num-layers); a PP that does not
    divide the layers comes with uneven splits only."""
    assert space.last_stage_choices(8, 4) == (0, 5)  # 2|2|2|2, or 1|1|1|5
    assert space.last_stage_choices(12, 4) == (0, 6, 9)
    assert space.last_stage_choices(9, 2) == tuple(range(1, 9))  # 8|1 ... 1|8, no even split
    assert space.last_stage_choices(8, 1) == (0,)
    inputs = space.SpaceInputs(num_layers=9, num_attention_heads=4, ffn_hidden_size=512,
                               global_batch_size=12, num_nodes=1, gpus_per_node=6)
    layouts = list(space.enumerate_layouts(inputs))
    assert {layout.pp for layout in layouts} == {1, 2, 3, 6}
    assert {layout.last_stage_layers for layout in layouts if layout.pp == 2} == set(range(1, 9))
    assert {layout.last_stage_layers for layout in layouts if layout.pp == 6} == {4}  # 1x5 | 4
    for layout in layouts:
        counts = layout.rank_layers(9)
        assert len(counts) == layout.pp and sum(counts) == 9 and min(counts) >= 1
        assert len(set(counts[:-1])) <= 1  # the stages before the last share the rest evenly
        assert (layout.last_stage_layers == 0) == (len(set(counts)) == 1)
        assert not layout.last_stage_layers or layout.vpp == 1
    assert any(layout.vpp > 1 for layout in layouts)  # pp = 3: 3 layers each


def test_cpu_processes_get_no_gpu_only_features():
    inputs = space.SpaceInputs(num_layers=4, num_attention_heads=4, ffn_hidden_size=512, global_batch_size=8,
                               num_nodes=1, gpus_per_node=4, on_gpus=False)
    layouts = list(space.enumerate_layouts(inputs))
    assert any(layout.tp > 1 for layout in layouts) and any(layout.dp > 1 for layout in layouts)
    assert not any(layout.sequence_parallel or layout.distributed_optimizer for layout in layouts)
    result = engine.search(dataclasses.replace(problem(), on_gpus=False), top_k=2)
    assert result.dominated == 0 and result.best


# --- the cost model -------------------------------------------------------------------------------
def _layout(**changes) -> space.Layout:
    fields = dict(tp=1, pp=4, vpp=1, dp=1, micro_batch_size=1, num_microbatches=16, recompute="none",
                  distributed_optimizer=False, sequence_parallel=False, schedule=space.megatron_schedule(1),
                  split_backward=False)
    fields.update(changes)
    return space.Layout(**fields)


@pytest.mark.parametrize("changes", [
    {}, {"vpp": 2, "schedule": space.megatron_schedule(2)},
    {"schedule": DYNAMIC_SCHEDULES[0], "split_backward": True},
    {"vpp": 2, "schedule": DYNAMIC_SCHEDULES[0], "split_backward": True},
    {"last_stage_layers": 5}, {"pp": 2, "last_stage_layers": 3, "schedule": DYNAMIC_SCHEDULES[0]},
    {"vpp": 2, "schedule": ZB_V, "placement": V_SHAPE},
    {"vpp": 2, "schedule": ADAPTIVE, "split_backward": True, "placement": V_SHAPE},
])
def test_closed_form_bound_is_the_simulators_pipeline_bound(changes):
    pricer = cost.Pricer(problem(hardware=flat_hardware(4, 100.0, 0.5)))
    layout = _layout(**changes)
    result = pricer.simulate(layout, layout.num_microbatches)
    assert pricer.pipeline_bound_ms(layout) == pytest.approx(result.pipeline_bound, rel=1e-9)
    # Plus the tied embedding's all-reduce between the first and the last stage (DP 1: no other sync).
    estimate = pricer.estimate(layout)
    assert estimate.time_lower_ms == pytest.approx(result.pipeline_bound + pricer.embedding_sync_ms(layout))


def _measured_extras_profile(overhead=(0.25, 0.5)):
    """Layer times with the first/last stage extras and a per-task overhead, as profile_model.sh
    writes them."""
    from megatron_dpp.search.model_profile import MemoryProfile, ModelProfile

    extras = {"first_forward": 0.5, "first_backward": 0.25, "last_forward": 3.0, "last_backward": 4.0,
              "chunk_forward": 0.125, "chunk_backward": 0.0625}
    return ModelProfile(model="gpt", hidden_size=256, num_attention_heads=16, dtype="fp32",
                        forward_ms={(0, 1, 1024): 2.0, (0, 2, 1024): 4.0},
                        backward_ms={(0, 1, 1024): 3.0, (0, 2, 1024): 6.0},
                        memory=MemoryProfile(layers={}, other={}), source="test profile figures",
                        stage_extra_ms={part: {(1, 1024): ms, (2, 1024): 2 * ms} for part, ms in extras.items()},
                        task_overhead_ms=overhead, optimizer_ms_per_parameter=1e-6)


@pytest.mark.parametrize("changes", [
    {}, {"vpp": 2, "schedule": space.megatron_schedule(2)},
    {"vpp": 2, "schedule": DYNAMIC_SCHEDULES[0], "split_backward": True},
    {"pp": 1, "vpp": 1}, {"schedule": DYNAMIC_SCHEDULES[0], "split_backward": True, "num_microbatches": 40},
    {"pp": 2, "last_stage_layers": 2}, {"last_stage_layers": 5, "schedule": DYNAMIC_SCHEDULES[0]},
])
def test_closed_form_bound_with_stage_extras_and_task_overheads(changes):
    """Slower first and last ranks and per-task overheads: the closed form is still the
    simulator's bound, and the extrapolated price stays close to the full simulation."""
    extras_problem = dataclasses.replace(problem(hardware=flat_hardware(4, 100.0, 0.5)),
                                         model_profile=_measured_extras_profile())
    pricer = cost.Pricer(extras_problem)
    layout = _layout(**changes)
    model, _ = pricer.durations(layout)
    counts = layout.rank_layers(8)  # a rank's speed: its layers over the first's, plus its extras
    assert model.rank_speed[0] > 1.0 and model.rank_speed[-1] > counts[-1] / counts[0]
    # forward_step / backward_step's overhead plus the chunk's fixed work (at micro-batch 1)
    assert (model.forward_overhead, model.backward_overhead) == (0.25 + 0.125, 0.5 + 0.0625)
    result = pricer.simulate(layout, layout.num_microbatches)
    assert pricer.pipeline_bound_ms(layout) == pytest.approx(result.pipeline_bound, rel=1e-9)
    full = cost.Pricer(extras_problem, extrapolate=False)
    assert pricer.price(layout, pricer.estimate(layout)).time_ms == pytest.approx(
        full.price(layout, full.estimate(layout)).time_ms, rel=0.02)


def test_latency_prices_tensor_parallel_and_pipeline_messages():
    """A measured latency adds to each TP all-reduce of a layer (two per forward, two per
    backward) and to each pipeline hop (the simulator's CommModel.latency)."""
    base = flat_hardware(4, 100.0, 0.5)
    timed = dataclasses.replace(base, allreduce_latency_ms={2: 0.5, 4: 0.5}, p2p_latency_ms={2: 0.25, 4: 0.25})
    plain, slow = cost.Pricer(problem(hardware=base)), cost.Pricer(problem(hardware=timed))
    layer, layer_slow = (pricer.layer(1, 1024, 2, False, "none") for pricer in (plain, slow))
    assert layer_slow.forward_ms == pytest.approx(layer.forward_ms + 2 * 0.5)
    assert layer_slow.backward_ms == pytest.approx(layer.backward_ms + 2 * 0.5)
    layout = _layout()
    comm, comm_slow = plain.comm_model(layout), slow.comm_model(layout)
    assert comm_slow.latency == 0.25 and comm_slow.bandwidth == pytest.approx(comm.bandwidth)
    result = slow.simulate(layout, layout.num_microbatches)
    assert slow.pipeline_bound_ms(layout) == pytest.approx(result.pipeline_bound, rel=1e-9)


def test_memory_bound_holds_the_simulated_peak():
    lengths = parse_distribution("uniform:64:1024")
    pricer = cost.Pricer(problem(lengths=lengths))
    for layout in (_layout(), _layout(schedule=DYNAMIC_SCHEDULES[0], split_backward=True)):
        priced = pricer.price(layout, pricer.estimate(layout))
        assert 0 < priced.activation_peak_bytes
        states = max(pricer.state_bytes(layout))
        assert priced.activation_peak_bytes + states <= priced.memory_bytes


@pytest.mark.parametrize("spec,tolerance", [(None, 0.005), ("lognormal:600:0.3", 0.05)])
def test_extrapolation_stays_close_to_the_full_simulation(spec, tolerance):
    """Equal microbatches: the steady state is exact; variable ones: a sample of 32 of 96."""
    lengths = None if spec is None else parse_distribution(spec)
    pricer = cost.Pricer(problem(batch=96, lengths=lengths, hardware=flat_hardware(4, 100.0, 1.0)))
    for layout in (_layout(num_microbatches=96), _layout(num_microbatches=96, vpp=2,
                                                         schedule=space.megatron_schedule(2)),
                   _layout(num_microbatches=96, schedule=DYNAMIC_SCHEDULES[0])):
        priced = pricer.price(layout, pricer.estimate(layout))
        assert priced.simulated_microbatches < 96
        full = pricer.simulate(layout, 96).makespan
        assert priced.pipeline_ms == pytest.approx(full, rel=tolerance)


def test_an_uneven_split_prices_each_rank_by_its_layers():
    """Parameters, memory and task times of each rank follow its layers: 6 | 2 of 8 layers."""
    shape = small_shape()
    pricer = cost.Pricer(problem(shape=shape))
    even, uneven = _layout(pp=2), _layout(pp=2, last_stage_layers=2)
    assert uneven.rank_layers(8) == [6, 2] and "last-stage-layers=2" in uneven.describe()
    per_layer = mm.layer_parameter_count(shape, 1)
    embedding, output = pricer._extra_parameters(1)
    assert pricer.rank_parameters(uneven) == (6 * per_layer + embedding, 2 * per_layer + output)
    assert pricer.rank_parameters(even) == (4 * per_layer + embedding, 4 * per_layer + output)
    # Task times: the first rank runs 6 layers; the last 2, plus the output layer's work.
    layer = pricer.layer(1, shape.seq_length, 1, False, "none")
    first_extra, last_extra = pricer.stage_extras_ms(1, shape.seq_length, 1)
    model, _ = pricer.durations(uneven)
    assert model.linear == pytest.approx(6 * layer.forward_ms)
    work = 6 * (layer.forward_ms + layer.backward_ms)
    assert model.rank_speed == pytest.approx((1 + first_extra / work, 2 / 6 + last_extra / work))
    # Memory: the fullest chunk sizes the simulated budget; each rank holds its own layers.
    assert pricer.chunk_activation_bytes(uneven, shape.seq_length) == 6 * layer.activation_bytes
    assert pricer.chunk_activation_bytes(even, shape.seq_length) == 4 * layer.activation_bytes
    # The first rank holds 2 microbatches in flight (1F1B), the last 1: layers moved to the last
    # stage take memory off the fullest rank.
    assert pricer.inflight(even) == (2, 1)
    heavy_last = _layout(pp=2, last_stage_layers=6)
    assert pricer.memory_bytes(heavy_last) < pricer.memory_bytes(even) < pricer.memory_bytes(uneven)
    # The simulator budgets every rank by the fullest chunk; the reported peak is each rank's own.
    for layout in (heavy_last, uneven):
        priced = pricer.price(layout, pricer.estimate(layout))
        assert priced.activation_peak_bytes + max(pricer.state_bytes(layout)) <= priced.memory_bytes
    result = pricer.simulate(heavy_last, heavy_last.num_microbatches)
    assert pricer.activation_peak(heavy_last, result) == max(result.peak_bytes[0] // 3,
                                                            result.peak_bytes[1])
    # Gradient buckets and reductions follow the rank's parameters.
    two_replicas = _layout(pp=2, dp=2, num_microbatches=8, last_stage_layers=2)
    chunks, _ = pricer.sync_ms(two_replicas)
    assert chunks[0][0] > chunks[1][0]  # 6 layers + embedding against 2 layers + output layer


def test_a_costly_output_layer_moves_layers_off_the_last_stage():
    """A vocabulary of 64k at hidden 256: the output layer costs about a dozen layers' forward, so
    the last of two stages runs fewer layers in the best layout, faster than the even split."""
    shape = small_shape(padded_vocab_size=65536, untie_embeddings_and_output_weights=True)
    hardware = flat_hardware(2, 1e-4, 100.0)  # collectives at a crawl: TP and DP lose
    result = engine.search(problem(shape=shape, hardware=hardware), top_k=3)
    best = result.best[0]
    assert best.layout.pp == 2 and 0 < best.layout.last_stage_layers < 4
    pricer = cost.Pricer(problem(shape=shape, hardware=hardware))
    even = dataclasses.replace(best.layout, last_stage_layers=0)
    assert best.time_ms < pricer.price(even, pricer.estimate(even)).time_ms
    table = cli.format_table(result, shape.num_layers)
    split = ",".join(str(count) for count in best.layout.rank_layers(8))
    assert f"| 1 | 1 | 2 ({split}) | 1 | 1 |" in table
    assert {row.count("|") for row in table.splitlines()} == {14}  # a Markdown table: 13 cells a row


def test_variable_lengths_pad_each_microbatch_to_its_longest():
    lengths = microbatch_lengths(parse_distribution("uniform:10:100"), 50, 4, 64)
    assert len(lengths) == 50 and max(lengths) <= 64 and min(lengths) >= 10
    assert microbatch_lengths(None, 3, 2, 128) == [128, 128, 128]


# --- the search -----------------------------------------------------------------------------------
def test_slow_collectives_make_a_pure_pipeline_win():
    """All-reduces (TP and DP) at a crawl, point-to-point fast: only TP 1, DP 1 (PP = the world)
    avoids them, and with compute linear in the micro-batch the smallest micro-batch has the
    smallest bubble; recompute only adds time. (Untied embeddings: no all-reduce between the first
    and the last stage either.)"""
    untied = small_shape(untie_embeddings_and_output_weights=True)
    result = engine.search(problem(shape=untied, hardware=flat_hardware(4, 1e-4, 100.0)), top_k=3)
    best = result.best[0].layout
    assert (best.tp, best.pp, best.dp, best.micro_batch_size, best.recompute) == (1, 4, 1, 1, "none")
    assert result.best[0].grad_sync_exposed_ms == 0.0


def test_a_model_that_only_fits_with_recompute_gets_selective():
    """One GPU, a budget just below what the lightest layout without recompute needs: selective
    recompute (attention only) is cheaper than full and fits."""
    single = flat_hardware(1, 100.0, 100.0)
    pricer = cost.Pricer(problem(hardware=single))
    plain = _layout(pp=1, num_microbatches=16)
    budget = pricer.memory_bytes(plain) - 1
    assert budget < pricer.memory_bytes(dataclasses.replace(plain, micro_batch_size=2, num_microbatches=8))
    result = engine.search(problem(hardware=single, budget=budget), top_k=3)
    assert result.best and all(c.memory_bytes <= budget for c in result.best)
    assert result.best[0].layout.recompute == "selective"


@pytest.mark.parametrize("spec,budget_fraction,bucket", [
    (None, 0.5, None), ("uniform:100:1024", 0.35, None), (None, 0.5, 50_000)])
def test_pruning_never_drops_the_true_best(spec, budget_fraction, bucket, monkeypatch):
    """Brute force (every layout that fits, simulated) against the pruned search on 2 nodes x 2;
    small gradient buckets make chunk 0's reductions overlap its last backward."""
    if bucket is not None:
        monkeypatch.setattr(cost, "DDP_BUCKET_PARAMS", bucket)
        monkeypatch.setattr(cost, "DDP_BUCKET_PARAMS_PER_DP_RANK", 1)
        assert cost.Pricer(problem()).bucket_count(_layout(dp=2, pp=2, num_microbatches=8), 0) > 1
    lengths = None if spec is None else parse_distribution(spec)
    hardware = flat_hardware(2, 10.0, 5.0, nodes=2)
    base = problem(hardware=hardware, batch=8, lengths=lengths)
    largest = max(cost.Pricer(base).memory_bytes(layout)
                  for layout in space.enumerate_layouts(engine.space_inputs(base)))
    budgeted = dataclasses.replace(base, memory_budget_bytes=int(largest * budget_fraction))
    pruned = engine.search(budgeted, top_k=3)
    brute = engine.search(budgeted, top_k=10**6, prune=False)
    assert all(c.time_lower_ms <= c.time_ms * (1 + 1e-12) for c in brute.best)  # the bound is one
    del brute.best[3:]
    assert brute.over_memory > 0 and pruned.simulated < brute.simulated
    assert [c.time_ms for c in pruned.best] == pytest.approx([c.time_ms for c in brute.best], rel=1e-12)


def test_gpt3_175b_on_1024_gpus_quick_check():
    """Issue 17's scale (the time target is benchmarks/strategy_search_bench.py's): the pruned
    search simulates few layouts and returns a layout that fits."""
    shape = ModelShape(model="gpt", num_layers=96, hidden_size=12288, num_attention_heads=96,
                       ffn_hidden_size=4 * 12288, seq_length=2048, padded_vocab_size=51200,
                       max_position_embeddings=2048, dtype="bf16")
    hardware = load_hardware("8xH100-nvlink-ib400", 128, 8)
    big = cost.Problem(shape=shape, global_batch_size=1536, hardware=hardware, memory_budget_bytes=80 * 10**9)
    result = engine.search(big, top_k=3)
    assert result.layouts > 10_000 and result.simulated < 200
    best = result.best[0]
    assert best.layout.tp * best.layout.pp * best.layout.dp == 1024 and best.layout.tp <= 8
    assert best.memory_bytes <= 80 * 10**9
    assert all(c.time_lower_ms <= c.time_ms * (1 + 1e-12) for c in result.best)
    # Above the ideal: all FLOPs at the preset's peak over 1024 GPUs.
    ideal_ms = 96 * 1536 * 3 * cost.memory_model.layer_forward_flops(shape, 1) / 1024 / 989.4e12 * 1e3
    assert best.time_ms > ideal_ms


# --- the v placement -----------------------------------------------------------------------------
def test_v_layouts_join_the_space_where_the_runtime_runs_them():
    """Two chunks a rank, PP >= 2, zb-v or dpp:adaptive, fused or split backward (not split with
    sequence parallelism); every other layout keeps the interleaved placement."""
    inputs = space.SpaceInputs(num_layers=8, num_attention_heads=16, ffn_hidden_size=1024,
                               global_batch_size=16, num_nodes=1, gpus_per_node=4)
    layouts = list(space.enumerate_layouts(inputs))
    v = [layout for layout in layouts if layout.placement == V_SHAPE]
    assert {(layout.pp, layout.vpp) for layout in v} == {(2, 2), (4, 2)}
    assert {(layout.schedule, layout.split_backward) for layout in v} == {
        (ZB_V, False), (ZB_V, True), (ADAPTIVE, False), (ADAPTIVE, True)}
    assert all(layout.use_dpp for layout in v)
    assert not any(layout.split_backward and layout.sequence_parallel for layout in v)
    interleaved = [dataclasses.replace(layout, placement=INTERLEAVED) for layout in v
                   if layout.schedule == ADAPTIVE]
    assert set(interleaved) <= set(layouts)  # the same layout on Megatron's placement stays


def test_the_v_sends_one_message_fewer_each_way_and_syncs_no_embedding():
    """pp 4, two chunks a rank, uniform lengths, split backwards, DP 1, the budget far above
    both: the v's turn at rank P-1 stays on its rank (6 messages a microbatch each way, not 7)
    and its tied embedding's two copies are both on rank 0 (no all-reduce between stages), so
    with a costly message latency it is the faster of the two by construction."""
    hardware = dataclasses.replace(flat_hardware(4, 1.0, 100.0), p2p_latency_ms={2: 2.0, 4: 2.0})
    pricer = cost.Pricer(problem(hardware=hardware))
    interleaved = _layout(vpp=2, schedule=ADAPTIVE, split_backward=True)
    v = dataclasses.replace(interleaved, placement=V_SHAPE)
    assert (pricer.messages_per_microbatch(interleaved), pricer.messages_per_microbatch(v)) == (7, 6)
    assert pricer.embedding_sync_ms(interleaved) > 0.0 and pricer.embedding_sync_ms(v) == 0.0
    priced = {layout.placement: pricer.price(layout, pricer.estimate(layout)) for layout in (interleaved, v)}
    assert priced[V_SHAPE].messages_per_microbatch == 6
    # At least one latency less on the critical path each way, and no embedding all-reduce.
    assert priced[V_SHAPE].time_ms < priced[INTERLEAVED].time_ms - pricer.embedding_sync_ms(interleaved)
    # Its memory: rank 0 holds the embedding, the output layer and ZB-V's in-flight chunks.
    first, others = pricer.inflight(v)
    assert (first, others) == (8, 8)  # ZB-V holds 2P chunk activations on every rank
    assert priced[V_SHAPE].memory_bytes == pricer.memory_bytes(v)
    assert pricer.rank_parameters(v)[0] > pricer.rank_parameters(interleaved)[0]
    assert pricer.rank_parameters(v)[1] < pricer.rank_parameters(interleaved)[1]


def test_an_interleaved_price_is_what_it_was_before_the_v_placement():
    """Fixed cases priced before the search knew placements (commit f8d106f): unchanged."""
    pricer = cost.Pricer(problem())
    layout = _layout(vpp=2, schedule=ADAPTIVE, split_backward=True)
    priced = pricer.price(layout, pricer.estimate(layout))
    assert (priced.time_ms, priced.memory_bytes) == (pytest.approx(297.2314501119993, rel=1e-12), 2577784832)
    assert priced.time_lower_ms == pytest.approx(291.56284825600005, rel=1e-12)
    synced = cost.Pricer(problem(hardware=flat_hardware(4, 50.0, 20.0)))
    layout = _layout(pp=2, vpp=2, dp=2, num_microbatches=8, distributed_optimizer=True,
                     schedule=space.megatron_schedule(2))
    priced = synced.price(layout, synced.estimate(layout))
    assert (priced.time_ms, priced.memory_bytes) == (pytest.approx(287.04638156799984, rel=1e-12), 2260054016)


def test_the_search_proposes_the_v_where_it_is_fastest_with_its_flags(monkeypatch):
    """Costly messages: the best layout is a v one; its command line is the runtime's flags for
    it (two virtual stages, --use-dpp, --dpp-stage-placement v, the policy, split backwards) and
    passes the runtime's DPP flag check; tied embeddings with DP > 1 drop --overlap-grad-reduce,
    which the v refuses, and the cost model prices that sync exposed."""
    from megatron_dpp import arguments

    hardware = dataclasses.replace(flat_hardware(4, 1.0, 100.0), p2p_latency_ms={2: 2.0, 4: 2.0})
    searched = problem(hardware=hardware)
    result = engine.search(searched, top_k=3)
    best = result.best[0]
    assert best.layout.placement == V_SHAPE and best.layout.vpp == 2
    content = strategy.build_strategy(searched, best, "test figures")
    assert content["schedule"]["placement"] == V_SHAPE
    flags = content["megatron_flags"]
    assert flags[flags.index("--num-virtual-stages-per-pipeline-rank") + 1] == "2"
    assert flags[flags.index("--dpp-stage-placement") + 1] == V_SHAPE and "--use-dpp" in flags
    assert flags[flags.index("--dpp-policy") + 1] == best.layout.schedule
    assert ("--dpp-split-backward" in flags) == best.layout.split_backward
    assert ("--overlap-grad-reduce" in flags) == (best.layout.dp > 1 and not cost.Pricer(searched).tied())
    args = arguments.build_parser().parse_args(flags)
    monkeypatch.setenv("WORLD_SIZE", "4")
    arguments.derive_parallel_layout(args)
    arguments.validate_dpp_args(args)
    assert args.dpp_stage_placement == V_SHAPE
    assert strategy.validate_strategy(json.loads(json.dumps(content))) == content
    assert "(v placement)" in cli.format_table(result, searched.shape.num_layers)
    assert "the v stage placement" in galvatron_strategy.inexpressible(best.layout)
    content["schedule"]["placement"] = "w"
    with pytest.raises(SearchInputError, match="schedule placement 'w' is not one of"):
        strategy.validate_strategy(content)
    del content["schedule"]["placement"]  # a strategy written before placements reads as interleaved
    strategy.validate_strategy(content)


def test_the_v_with_tied_embeddings_and_data_parallelism_reduces_after_the_pipeline():
    """No --overlap-grad-reduce there: the gradient sync starts after the rank's last task, so it
    is exposed whole, never less than with the reductions overlapped."""
    pricer = cost.Pricer(problem(hardware=flat_hardware(4, 1.0, 100.0)))
    v = _layout(pp=2, vpp=2, dp=2, num_microbatches=8, schedule=ADAPTIVE, placement=V_SHAPE)
    assert pricer.tied() and not pricer.overlaps_grad_reduce(v)
    assert pricer.overlaps_grad_reduce(dataclasses.replace(v, placement=INTERLEAVED))
    priced = pricer.price(v, pricer.estimate(v))
    chunks, gathers = pricer.sync_ms(v)
    assert priced.grad_sync_exposed_ms >= sum(chunks[0]) + gathers[0] - 1e-9


# --- the CLI and the strategy file ------------------------------------------------------------
SMALL_ARGS = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "16",
              "--seq-length", "512", "--global-batch-size", "16", "--num-nodes", "1",
              "--num-gpus-per-node", "4", "--hardware", "8xH100-nvlink-ib400", "--memory-budget-gb", "80",
              "--bf16", "--top", "3"]


def test_cli_prints_the_table_the_command_and_a_strategy_that_round_trips(tmp_path, capsys):
    path = tmp_path / "strategy.json"
    assert cli.main(SMALL_ARGS + ["--output-strategy", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| # | TP | PP | VPP | DP | mbs |" in out and "torchrun --nnodes 1 --nproc-per-node 4" in out
    assert "hardware figures: preset 8xH100-nvlink-ib400" in out
    content = strategy.read_strategy(path)
    assert content["version"] == strategy.STRATEGY_VERSION and content["nproc_per_node"] == 4
    assert json.loads(path.read_text()) == content
    layout = content["layout"]
    assert layout["tensor_model_parallel_size"] * layout["pipeline_model_parallel_size"] \
        * layout["data_parallel_size"] == 4
    printed = subprocess.run([sys.executable, "-m", "megatron_dpp.search.strategy", str(path), "--print",
                              "flags"], capture_output=True, text=True, timeout=60, env=ENV)
    assert printed.returncode == 0, printed.stderr
    flags = printed.stdout.splitlines()
    assert flags == content["megatron_flags"]
    assert flags[flags.index("--tensor-model-parallel-size") + 1] == str(layout["tensor_model_parallel_size"])
    for what, expected in (("nproc_per_node", "4"), ("num_nodes", "1"), ("model", "gpt")):
        assert strategy.printed(content, what) == expected


def test_strategy_flags_are_the_trainers_flags():
    """Every flag the strategy writes is one megatron_dpp.arguments accepts (split backward and a
    dynamic policy included)."""
    from megatron_dpp import arguments

    priced = cost.LayoutCost(layout=_layout(vpp=2, schedule=DYNAMIC_SCHEDULES[0], split_backward=True,
                                            recompute="full", dp=2, distributed_optimizer=True),
                             time_ms=1.0, pipeline_ms=1.0, grad_sync_exposed_ms=0.0, optimizer_ms=0.0, memory_bytes=1,
                             activation_peak_bytes=1, bubble_fraction=0.1, simulated_microbatches=16,
                             time_lower_ms=1.0)
    flags = strategy.megatron_flags(problem(lengths=parse_distribution("uniform:1:9")), priced)
    args = arguments.build_parser().parse_args(flags)
    assert args.use_dpp and args.dpp_split_backward and args.dpp_policy == DYNAMIC_SCHEDULES[0]
    assert args.num_virtual_stages_per_pipeline_rank == 2 and args.recompute_granularity == "full"
    assert args.variable_seq_lengths and args.use_distributed_optimizer and args.overlap_grad_reduce
    assert args.decoder_last_pipeline_num_layers is None
    uneven = dataclasses.replace(priced, layout=_layout(last_stage_layers=5))
    args = arguments.build_parser().parse_args(strategy.megatron_flags(problem(), uneven))
    assert args.decoder_last_pipeline_num_layers == 5 and args.pipeline_model_parallel_size == 4


def test_a_strategy_names_an_uneven_split_and_reads_without_one(tmp_path):
    """The last stage's layers are a layout key (0: even); a strategy written before the key
    existed reads as an even split, and a key of the wrong type is one line."""
    priced = cost.LayoutCost(layout=_layout(pp=2, last_stage_layers=2), time_ms=1.0, pipeline_ms=1.0,
                             grad_sync_exposed_ms=0.0, optimizer_ms=0.0, memory_bytes=1,
                             activation_peak_bytes=1, bubble_fraction=0.1, simulated_microbatches=16,
                             time_lower_ms=1.0)
    content = strategy.build_strategy(problem(), priced, "test figures")
    assert content["layout"]["decoder_last_pipeline_num_layers"] == 2
    flags = content["megatron_flags"]
    assert flags[flags.index("--decoder-last-pipeline-num-layers") + 1] == "2"
    path = strategy.write_strategy(content, tmp_path / "uneven.json")
    assert strategy.read_strategy(path) == content
    del content["layout"]["decoder_last_pipeline_num_layers"]
    strategy.validate_strategy(content)
    content["layout"]["decoder_last_pipeline_num_layers"] = "2"
    with pytest.raises(SearchInputError, match="'decoder_last_pipeline_num_layers' = '2' has the wrong type"):
        strategy.validate_strategy(content)


@pytest.mark.parametrize("text,problem_word", [
    ("not json", "not JSON"), ("[]", "not a JSON object"),
    (json.dumps({"format": strategy.STRATEGY_FORMAT, "version": 99}), "version 99"),
    (json.dumps({"format": strategy.STRATEGY_FORMAT, "version": strategy.STRATEGY_VERSION}), "missing"),
])
def test_a_bad_strategy_file_is_one_line_and_exit_2(tmp_path, text, problem_word):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(SearchInputError, match=problem_word):
        strategy.read_strategy(path)
    done = subprocess.run([sys.executable, "-m", "megatron_dpp.search.strategy", str(path), "--print",
                           "flags"], capture_output=True, text=True, timeout=60, env=ENV)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and problem_word in done.stderr


def test_no_layout_fits_prints_the_smallest_memory_and_exits_2(capsys):
    args = [*SMALL_ARGS]
    args[args.index("--memory-budget-gb") + 1] = "0.001"
    assert cli.main(args) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if "error" in line]
    assert len(lines) == 1 and "no layout fits --memory-budget-gb 0.001: the smallest needs" in lines[0]
    assert captured.out == ""
    smallest = float(lines[0].split("needs ")[1].split(" GB")[0])
    assert smallest > 0.001


@pytest.mark.parametrize("change,message", [
    (["--no-such-flag"], "unrecognized arguments"),
    (["--variable-seq-lengths"], "go together"),
    (["--variable-seq-lengths", "--seq-length-distribution", "normal:1:2"], "expected uniform"),
    (["--hardware", "no-such-preset"], "neither a preset"),
    (["--num-attention-heads", "7"], "not divisible"),
    (["--fp16"], "not allowed with argument --bf16"),
    (["--cpu"], "the search prices CPU runs in fp32 only"),
    (["--hidden-dropout", "1.5"], "must be in [0, 1)"),
])
def test_bad_flags_are_one_line_and_exit_2(change, message, capsys):
    with pytest.raises(SystemExit) as raised:
        code = cli.main(SMALL_ARGS + change)
        raise SystemExit(code)
    assert raised.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


@pytest.mark.timeout(120)
def test_start_search_script_runs_from_any_directory(tmp_path):
    done = subprocess.run(["bash", str(REPO / "run_scripts" / "start-search.sh"), *SMALL_ARGS, "--top", "1",
                           "--output-strategy", "s.json"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=110, env=ENV)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "s.json").is_file() and "simulated" in done.stderr
    bad = subprocess.run(["bash", str(REPO / "run_scripts" / "start-search.sh"), "--top", "1"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60, env=ENV)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_a_model_profile_sets_the_layer_times(tmp_path, capsys):
    """One GPU (no pipeline, no collectives): the iteration is every sequence through every layer
    at the profile's forward + backward, plus the analytical output layer."""
    from megatron_dpp.search.model_profile import MemoryProfile, ModelProfile, write_model_profile_dir

    profile = ModelProfile(model="gpt", hidden_size=256, num_attention_heads=16, dtype="fp32",
                           forward_ms={(0, 1, 1024): 2.0, (0, 2, 1024): 4.0},
                           backward_ms={(0, 1, 1024): 3.0, (0, 2, 1024): 6.0},
                           memory=MemoryProfile(layers={}, other={}), source="test profile figures")
    write_model_profile_dir(profile, tmp_path)
    args = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "16", "--seq-length", "1024",
            "--vocab-size", "1024", "--global-batch-size", "16", "--num-nodes", "1", "--num-gpus-per-node", "1",
            "--memory-budget-gb", "1000", "--top", "1", "--model-profile", str(tmp_path)]
    hardware_dir = tmp_path / "hw"
    from megatron_dpp.search.hardware import write_hardware_dir
    write_hardware_dir(flat_hardware(1, 1.0, 1.0), hardware_dir)
    assert cli.main(args + ["--hardware", str(hardware_dir)]) == 0
    out = capsys.readouterr().out
    assert "model figures: test profile figures" in out
    assert cli.main(args + ["--hardware", str(hardware_dir), "--model", "bert"]) == 2
    assert "profiles gpt layers, not --model bert" in capsys.readouterr().err
    content = json.loads(out[out.index("{"):])
    output_ms = 3 * 2.0 * 1024 * 256 * 1024 / 1e12 * 1e3  # forward + backward of the logits, per sequence
    assert content["predicted"]["iteration_ms"] == pytest.approx(16 * (8 * 5.0 + output_ms), rel=1e-3)
    # With the measured stage extras and per-task overhead: those instead of the analytical logits.
    measured = _measured_extras_profile()
    write_model_profile_dir(measured, tmp_path)
    assert cli.main(args + ["--hardware", str(hardware_dir)]) == 0
    out = capsys.readouterr().out
    content = json.loads(out[out.index("{"):])
    per_sequence = 8 * 5.0 + (0.5 + 0.25 + 3.0 + 4.0)  # layers and extras (linear in the batch)
    tasks = content["layout"]["num_microbatches"]  # one forward and one backward each
    optimizer_ms = 1e-6 * mm.total_parameter_count(small_shape())  # every parameter on the one GPU
    chunk_ms = 16 * (0.125 + 0.0625)  # each task's fixed chunk work, linear in the batch too
    assert content["predicted"]["iteration_ms"] == pytest.approx(
        16 * per_sequence + tasks * (0.25 + 0.5) + chunk_ms + optimizer_ms, abs=2e-3)


def test_a_chunk_s_fixed_work_makes_more_tasks_dearer():
    """The same pipeline with interleaved stages runs twice the tasks: with a measured fixed work
    per chunk task its price rises by at least that work on the busiest rank; without, by less."""
    base = _measured_extras_profile(overhead=(0.0, 0.0))
    no_chunk = dataclasses.replace(base, stage_extra_ms={
        part: table for part, table in base.stage_extra_ms.items() if not part.startswith("chunk")})
    hardware = flat_hardware(4, 100.0, 0.5)
    prices = {}
    for name, profile in (("chunk", base), ("none", no_chunk)):
        pricer = cost.Pricer(dataclasses.replace(problem(hardware=hardware), model_profile=profile))
        prices[name] = [pricer.price(layout, pricer.estimate(layout)).time_ms for layout in (
            _layout(), _layout(vpp=2, schedule=space.megatron_schedule(2)))]
    extra_tasks = _layout().num_microbatches  # per rank, forward and backward each
    assert prices["chunk"][1] - prices["chunk"][0] >= (
        prices["none"][1] - prices["none"][0] + extra_tasks * (0.125 + 0.0625) * 0.99)


def test_times_measured_at_a_tensor_parallel_size_replace_the_modelled_ones():
    """A profile with times measured on 2 processes: at TP 2 the layer, the chunk's fixed work
    and the stages' extras are those (all-reduces included); other TP sizes keep tp = 1 / TP
    plus the hardware's all-reduces."""
    from megatron_dpp.search.model_profile import TENSOR_PARALLEL_PARTS

    measured = {"forward": 1.5, "backward": 2.5, "chunk_forward": 0.75, "chunk_backward": 0.25,
                "first_forward": 0.375, "first_backward": 0.125, "last_forward": 2.0, "last_backward": 3.0}
    assert set(measured) == set(TENSOR_PARALLEL_PARTS)
    base = _measured_extras_profile(overhead=(0.0, 0.0))
    profile = dataclasses.replace(base, tensor_parallel_ms={2: {
        part: {(1, 1024): ms, (2, 1024): 2 * ms} for part, ms in measured.items()}})
    hardware = flat_hardware(4, 100.0, 0.5)
    pricer = cost.Pricer(dataclasses.replace(problem(hardware=hardware), model_profile=profile))
    plain = cost.Pricer(dataclasses.replace(problem(hardware=hardware), model_profile=base))
    layer = pricer.layer(1, 1024, 2, False, "none")
    assert (layer.forward_ms, layer.backward_ms) == pytest.approx((1.5, 2.5))
    assert pricer.stage_extras_ms(2, 1024, 2) == pytest.approx((2 * 0.5, 2 * 5.0))
    assert pricer.task_overhead_ms(1, 1024, 2) == pytest.approx((0.75, 0.25))
    # Sequence parallelism and TP 4 were not measured: as without the measurement.
    for tp, sp in ((2, True), (4, False)):
        assert pricer.layer(1, 1024, tp, sp, "none") == plain.layer(1, 1024, tp, sp, "none")
    assert pricer.task_overhead_ms(1, 1024, 4) == plain.task_overhead_ms(1, 1024, 4)
    assert pricer.stage_extras_ms(1, 1024, 4) == plain.stage_extras_ms(1, 1024, 4)
