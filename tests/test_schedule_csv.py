"""Torch's schedule CSV (megatron_dpp/pipeline/schedule_csv.py): our orders written in it and read
back, and schedules torch itself wrote loaded and run in the simulator."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_dpp.pipeline import StaticOrderScheduler, TaskGraph, make_scheduler
from megatron_dpp.pipeline.placement import interleaved, v_shape
from megatron_dpp.pipeline.schedule_csv import (format_schedule_csv, parse_schedule_csv,
                                                read_schedule_csv, write_schedule_csv)
from megatron_dpp.sim import simulate


def _orders(name, graph):
    return [make_scheduler(name, graph, rank).order for rank in range(graph.P)]


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
@pytest.mark.parametrize("name,placement", [("zb-v", v_shape(4)), ("interleaved-1f1b", interleaved(4, 2)),
                                            ("1f1b", interleaved(3, 1))])
def test_orders_round_trip(name, placement, split):
    graph = TaskGraph(placement.P, placement.V, 8, split_backward=split, placement=placement)
    orders = _orders(name, graph)
    schedule = parse_schedule_csv(format_schedule_csv(graph, orders))
    assert schedule.placement == placement
    assert schedule.split_backward == split and schedule.num_microbatches == 8
    assert [list(order) for order in schedule.orders] == orders


def test_cells_name_global_stages_and_torchs_backward_letters(tmp_path):
    split = TaskGraph(2, 2, 2, split_backward=True, placement=v_shape(2))
    path = str(tmp_path / "zbv.csv")
    write_schedule_csv(path, split, _orders("zb-v", split))
    rows = open(path, newline="").read().splitlines()
    # Rank 0 holds stages 0 and 3 (the last): its chunk 1 is stage 3.
    assert rows[0] == "0F0,0F1,3F0,3I0,3W0,3F1,3I1,3W1,0I0,0W0,0I1,0W1"
    assert rows[1] == "1F0,2F0,1F1,2F1,2I0,2W0,1I0,1W0,2I1,2W1,1I1,1W1"
    assert read_schedule_csv(path).placement == v_shape(2)
    fused = TaskGraph(2, 2, 2, placement=v_shape(2))
    assert format_schedule_csv(fused, _orders("zb-v", fused)).splitlines()[0] == "0F0,0F1,3F0,3B0,3F1,3B1,0B0,0B1"


@pytest.mark.parametrize("text,message", [
    ("0F0,0SEND_F0\r\n", "not a compute action"),
    ("0F0,0B0\r\n1F0,0B0\r\n", "stage 0 has actions on ranks 0 and 1"),
    ("0F0,0B0,2F0,2B0\r\n", "stages \\[1\\] have no actions"),
    ("0F0,0B0,0I0,0W0\r\n", "mix full backwards"),
    ("0F0,0B0,0F0\r\n", "expected each of 1 stages"),
    ("0F0,0F1,0B0\r\n", "expected each of 1 stages"),
    ("", "no actions"),
])
def test_a_bad_file_is_one_line_value_error(text, message):
    with pytest.raises(ValueError, match=message) as raised:
        parse_schedule_csv(text)
    assert "\n" not in str(raised.value)


# --- files torch wrote ------------------------------------------------------------------------
# Torch builds its orders in the schedule classes, which need real pipeline stages to construct.
# The per-rank order methods and _dump_csv only read a few attributes of the schedule, so they run
# on a stand-in (SimpleNamespace) with those: the file is torch's own output for that schedule.

def _torch_zbv_csv(path, P, M):
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, ScheduleZBVZeroBubble

    schedule = SimpleNamespace(pp_group_size=P, _n_microbatches=M, num_stages=2 * P)
    schedule.pipeline_order = {rank: ScheduleZBVZeroBubble._calculate_single_rank_operations(schedule, rank)
                               for rank in range(P)}
    PipelineScheduleMulti._dump_csv(schedule, path)


def _torch_interleaved_csv(path, P, V, M):
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, ScheduleInterleaved1F1B

    rounds = max(1, M // P)
    schedule = SimpleNamespace(pp_group_size=P, _n_microbatches=M, n_local_stages=V,
                               microbatches_per_round=M // rounds)
    schedule.pipeline_order = {rank: ScheduleInterleaved1F1B._calculate_single_rank_operations(schedule, rank)
                               for rank in range(P)}
    PipelineScheduleMulti._dump_csv(schedule, path)


def _run(schedule):
    graph = schedule.task_graph()

    def factory(g, rank):
        return StaticOrderScheduler("torch csv", g, rank, 1, list(range(g.M)), schedule.orders[rank])

    result = simulate(graph, factory)
    assert len(result.timeline) == graph.P * graph.V * len(graph.phases) * graph.M
    return graph, result


@pytest.mark.parametrize("M", [4, 8])
@pytest.mark.parametrize("P", [2, 4])
def test_torchs_zbv_csv_loads_as_the_v_placement_and_runs(tmp_path, P, M):
    path = str(tmp_path / "zbv.csv")
    _torch_zbv_csv(path, P, M)
    schedule = read_schedule_csv(path)
    assert schedule.placement == v_shape(P) and schedule.split_backward
    graph, result = _run(schedule)
    assert [list(order) for order in schedule.orders] == _orders("zb-v", graph)
    assert result.makespan == pytest.approx(simulate(graph, "zb-v").makespan)


@pytest.mark.parametrize("M", [4, 8])
@pytest.mark.parametrize("P", [2, 4])
def test_torchs_interleaved_1f1b_csv_loads_as_the_interleaved_placement_and_runs(tmp_path, P, M):
    path = str(tmp_path / "interleaved.csv")
    _torch_interleaved_csv(path, P, 2, M)
    schedule = read_schedule_csv(path)
    assert schedule.placement == interleaved(P, 2) and not schedule.split_backward
    _run(schedule)
