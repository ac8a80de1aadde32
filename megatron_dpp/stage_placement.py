"""The job's stage placement (--dpp-stage-placement), as training and its checkpoints see it.

Megatron-LM asks parallel_state which pipeline rank holds the loss (is_pipeline_last_stage) and the
tied embedding's copies (its embedding group: the first and the last pipeline rank). Both follow
the placement: on the v placement (pipeline/placement.py's v_shape) the last stage, with the loss
and the output layer, is chunk 1 of pipeline rank 0, beside the embedding on its chunk 0. Set
once, beside parallel_state, by training/setup.py's initialize_distributed.
"""
from __future__ import annotations

import contextlib

from megatron.core import parallel_state

from megatron_dpp.mcore.stage_view import reading_as_pipeline_rank
from megatron_dpp.pipeline.placement import INTERLEAVED, Placement, interleaved, named_placement

_name = INTERLEAVED


def use_stage_placement(name: str) -> None:
    """The job's placement, before the model is built (initialize_distributed)."""
    global _name
    _name = name


def job_placement_name() -> str:
    """--dpp-stage-placement of this job (a checkpoint records it)."""
    return _name


def job_placement() -> Placement:
    """The placement of this job's pipeline (parallel_state initialized)."""
    return named_placement(_name, parallel_state.get_pipeline_model_parallel_world_size(),
                           parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1)


def as_megatron_builds_chunk(chunk: int):
    """A context for Megatron-Core code run on this rank's `chunk` that reads the pipeline rank
    from parallel_state (its sharded state dict): that rank set to the one Megatron-Core's
    interleaved placement gives the chunk's stage, as models/init.py built the chunk; nothing to
    set where it is this rank (every chunk of the interleaved placement, chunk 0 of the v)."""
    placement = job_placement()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    megatron_rank, _vp_stage = interleaved(placement.P, placement.V).location(
        placement.stage(rank, chunk))
    if megatron_rank == rank:
        return contextlib.nullcontext()
    return reading_as_pipeline_rank(megatron_rank)


def holds_the_loss() -> bool:
    """This pipeline rank holds the last stage: it computes the loss and reports it."""
    placement = job_placement()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    return placement.local_chunk(rank, placement.last_stage) is not None


def embedding_ranks_for(name: str, chunks_per_rank: int, tied: bool):
    """initialize_model_parallel's get_embedding_ranks for placement `name`: the ranks holding a
    copy of the word embedding (the first and last stage's), each once; None: Megatron-Core's
    default (the first and the last pipeline rank)."""
    if name == INTERLEAVED:
        return None

    def embedding_ranks(pp_ranks: list[int]) -> list[int]:
        placement = named_placement(name, len(pp_ranks), chunks_per_rank)
        holders = sorted({placement.location(stage)[0]
                          for stage in placement.embedding_stages(tied)})
        return [pp_ranks[rank] for rank in holders]
    return embedding_ranks
