"""A model chunk for a stage that Megatron-Core's interleaved placement would put on another rank.

Megatron-Core builds the chunk of (pipeline rank p, virtual stage v) with the layers of stage
v*P + p: TransformerBlock and TransformerLayer ask `pg_collection.pp.rank()` for p
(get_num_layers_to_build, get_transformer_layer_offset, the global layer numbers) and
LanguageModule asks it whether the chunk is the first stage; with a layout string
(--pipeline-model-parallel-layout) PipelineParallelLayerLayout asks parallel_state's
get_pipeline_model_parallel_rank() instead; and BertModel builds its TransformerBlock without its
own collection, which then takes ProcessGroupCollection.use_mpu_process_groups(). Another
placement puts stage s on
another rank (the v placement: stage 2P-1-r is chunk 1 of rank r); that chunk is Megatron-Core's
chunk (rank, virtual stage) where Megatron-Core's placement has stage s, built under
`building_as_pipeline_rank(rank)`: a collection whose pipeline group says its rank is that rank
(also what use_mpu_process_groups returns meanwhile), and parallel_state's pipeline rank set to
it, until the chunk is built. Only the building reads that rank: the chunk's collectives run
over its tensor-parallel group, and the pipeline's messages are the DPP runtime's.
tests/test_stage_placement_model.py checks that a chunk built so has the layers, layer numbers and
ends of its stage. Its sharded state dict
(a checkpoint's) is built under `reading_as_pipeline_rank(rank)`, parallel_state's pipeline rank
set to that rank: with a layout string Megatron-Core takes the chunk's layer offset from there.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Iterator

from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection


class PipelineGroupAsRank:
    """The pipeline process group, answering rank() with the rank whose chunk is being built.
    Anything but rank() and size() goes to the real group; a collective over it fails loudly
    (torch.distributed takes ProcessGroups only), which is what a use beyond building would do."""

    def __init__(self, group, rank: int):
        self._group = group
        self._rank = rank

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._group.size()

    def __getattr__(self, name):
        return getattr(self._group, name)


@contextlib.contextmanager
def building_as_pipeline_rank(rank: int) -> Iterator[ProcessGroupCollection]:
    """While a chunk is built: the job's process groups with the pipeline group answering rank()
    with `rank` (the model's pg_collection), and parallel_state's pipeline rank set to `rank`;
    `rank` is the one Megatron-Core's interleaved placement gives the stage being built (with its
    vp_stage). A module the chunk builds without being given a collection (BertModel's
    TransformerBlock) gets it from use_mpu_process_groups, which returns this one meanwhile.
    parallel_state's own value and use_mpu_process_groups come back after, however the building
    ends."""
    collection = copy.copy(ProcessGroupCollection.use_mpu_process_groups())
    collection.pp = PipelineGroupAsRank(collection.pp, rank)
    saved_default = ProcessGroupCollection.__dict__["use_mpu_process_groups"]
    ProcessGroupCollection.use_mpu_process_groups = classmethod(
        lambda cls, required_pgs=None: collection)
    try:
        with reading_as_pipeline_rank(rank):
            yield collection
    finally:
        ProcessGroupCollection.use_mpu_process_groups = saved_default


@contextlib.contextmanager
def reading_as_pipeline_rank(rank: int) -> Iterator[None]:
    """parallel_state's pipeline rank set to `rank` until the block ends, however it ends: for
    what Megatron-Core computes from a built chunk of another placement's stage and asks
    parallel_state for, not the chunk's collection. Its sharded state dict
    (TransformerBlock.sharded_state_dict) takes each layer's local index from the layer offset,
    which a layout string (PipelineParallelLayerLayout.get_layer_offset) reads from
    parallel_state; the checkpoint's own RNG and pipeline keys stay per real rank, outside it."""
    saved = parallel_state._MPU_PIPELINE_MODEL_PARALLEL_RANK  # None: asked of the group
    parallel_state.set_pipeline_model_parallel_rank(rank)
    try:
        yield
    finally:
        parallel_state.set_pipeline_model_parallel_rank(saved)
