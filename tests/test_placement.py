"""Stage placement as data (megatron_dpp/pipeline/placement.py): the interleaved and V placements,
any placement from the rank of each stage, their text form, and the task graph and ready rule on
a V placement."""
from __future__ import annotations

import pytest

from megatron_dpp.pipeline import Phase, ReadyTracker, Task, TaskGraph
from megatron_dpp.pipeline.placement import (Placement, from_stage_ranks, interleaved,
                                             parse_placement, v_shape)


def test_interleaved_is_megatrons_chunk_times_p_plus_rank():
    placement = interleaved(4, 3)
    assert (placement.P, placement.V, placement.num_stages, placement.name) == (4, 3, 12, "interleaved")
    for rank in range(4):
        for chunk in range(3):
            stage = placement.stage(rank, chunk)
            assert stage == chunk * 4 + rank
            assert placement.location(stage) == (rank, chunk)
    assert placement.first_stage == 0 and placement.last_stage == 11
    assert placement.stages_of(1) == (1, 5, 9)
    assert placement.chunks_deepest_first(1) == (2, 1, 0)
    assert placement.local_chunk(3, placement.last_stage) == 2
    assert placement.local_chunk(0, placement.last_stage) is None
    assert not placement.next_on_same_rank(3) and not placement.previous_on_same_rank(4)


def test_v_shape_goes_down_the_ranks_and_back_up():
    placement = v_shape(4)
    assert placement.stage_ranks == (0, 1, 2, 3, 3, 2, 1, 0)
    assert (placement.P, placement.V, placement.name) == (4, 2, "v")
    assert placement.stages_of(0) == (0, 7)
    assert placement.stages_of(3) == (3, 4)
    assert placement.location(4) == (3, 1)
    # The turn of the V: stage 3's output stays on rank 3.
    assert placement.next_on_same_rank(3) and placement.previous_on_same_rank(4)
    assert [s for s in range(8) if placement.next_on_same_rank(s)] == [3]
    # Rank 0 holds the first stage (data) and the last (the loss).
    assert placement.local_chunk(0, placement.first_stage) == 0
    assert placement.local_chunk(0, placement.last_stage) == 1
    assert placement.embedding_stages(tied_embeddings=False) == (0,)
    assert placement.embedding_stages(tied_embeddings=True) == (0, 7)
    assert placement.next_stage(7) is None and placement.previous_stage(0) is None


def test_from_stage_ranks_numbers_each_ranks_chunks_in_stage_order():
    placement = from_stage_ranks([1, 0, 0, 1])
    assert placement.name == "custom"
    assert placement.stages_of(1) == (0, 3) and placement.stages_of(0) == (1, 2)
    assert placement.stage(1, 1) == 3
    assert placement.next_on_same_rank(1)
    # A list that is a known placement is that placement.
    assert from_stage_ranks([0, 1, 0, 1]) == interleaved(2, 2)
    assert from_stage_ranks([0, 1, 1, 0]).name == "v"


@pytest.mark.parametrize("placement", [interleaved(4, 2), interleaved(1), v_shape(3),
                                       from_stage_ranks([2, 0, 1, 1, 0, 2])])
def test_a_placement_prints_and_parses_back(placement):
    assert parse_placement(str(placement)) == placement
    assert eval(repr(placement), {"Placement": Placement}) == placement


def test_the_text_forms():
    assert str(interleaved(4, 2)) == "interleaved:4x2"
    assert str(v_shape(4)) == "v:4"
    assert str(from_stage_ranks([1, 0])) == "ranks:1,0"


@pytest.mark.parametrize("build,message", [
    (lambda: from_stage_ranks([0, 0, 1]), "same number of stages"),
    (lambda: from_stage_ranks([0, 2]), "same number of stages"),
    (lambda: from_stage_ranks([]), "non-empty"),
    (lambda: from_stage_ranks([0, -1]), "same number of stages"),
    (lambda: interleaved(0, 1), "P, V >= 1"),
    (lambda: v_shape(0), "P >= 1"),
    (lambda: parse_placement("zigzag:4"), "not a placement"),
    (lambda: parse_placement("v:four"), "not a placement"),
    (lambda: interleaved(2, 2).stage(2, 0), "no chunk 0 on rank 2"),
    (lambda: interleaved(2, 2).location(4), "no stage 4"),
    (lambda: TaskGraph(4, 2, 4, placement=v_shape(2)), "placement v:2 has P=2"),
])
def test_bad_input_is_one_line_value_error(build, message):
    with pytest.raises(ValueError, match=message) as raised:
        build()
    assert "\n" not in str(raised.value)


# --- the task graph and the ready rule on a V placement -------------------------------------------

def test_the_default_graph_is_interleaved():
    graph = TaskGraph(4, 2, 8)
    assert graph.placement == interleaved(4, 2)
    assert graph.virtual_stage(1, 1) == 5 and graph.stage_location(5) == (1, 1)


def test_v_graph_turns_on_the_last_rank_without_leaving_it():
    P = 4
    graph = TaskGraph(P, 2, 3, placement=v_shape(P))
    F, B = Phase.F, Phase.B
    # Stage P-1 (rank P-1, chunk 0) sends its forward to stage P (rank P-1, chunk 1).
    assert graph.output_target(P - 1, Task(F, 1, 0)) == (P - 1, Task(F, 1, 1))
    assert graph.input_source(P - 1, Task(F, 1, 1)) == (P - 1, Task(F, 1, 0))
    # And stage P's input gradient goes back to stage P-1 on the same rank.
    assert graph.output_target(P - 1, Task(B, 1, 1)) == (P - 1, Task(B, 1, 0))
    assert graph.input_source(P - 1, Task(B, 1, 0)) == (P - 1, Task(B, 1, 1))
    # Chunk 1 runs back up the ranks: stage P+1 is rank P-2's chunk 1.
    assert graph.output_target(P - 1, Task(F, 0, 1)) == (P - 2, Task(F, 0, 1))
    assert graph.output_target(1, Task(B, 0, 1)) == (2, Task(B, 0, 1))
    # Rank 0's chunk 1 is the last stage: no forward output, no gradient to wait for.
    assert graph.output_target(0, Task(F, 0, 1)) is None
    assert graph.input_source(0, Task(B, 0, 1)) is None
    assert graph.input_source(0, Task(F, 0, 0)) is None
    assert graph.output_target(0, Task(B, 0, 0)) is None
    assert "placement=v:4" in repr(graph)


def test_v_ready_rule_rank_zero_starts_and_ends_the_pipeline():
    graph = TaskGraph(2, 2, 2, placement=v_shape(2))
    rank0, rank1 = ReadyTracker(graph, 0), ReadyTracker(graph, 1)
    F, B = Phase.F, Phase.B
    assert rank0.ready == {Task(F, 0, 0), Task(F, 1, 0)}  # the first stage reads data
    assert rank1.ready == set()
    assert not rank0.needs_input(Task(B, 0, 1))  # the loss stage makes its own gradient
    # The loss stage's forward, once finished, makes its backward ready with no message.
    rank0.input_arrived(Task(F, 0, 1))
    rank0.start(Task(F, 0, 1))
    rank0.finish(Task(F, 0, 1))
    assert Task(B, 0, 1) in rank0.ready
    # On rank 1 the turn of the V: chunk 0's backward waits for chunk 1's on the same rank.
    rank1.input_arrived(Task(F, 0, 0))
    rank1.start(Task(F, 0, 0))
    rank1.finish(Task(F, 0, 0))
    assert Task(B, 0, 0) not in rank1.ready
    assert rank1.needs_input(Task(B, 0, 0))
