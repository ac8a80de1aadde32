"""Layout-independent initialization of a Megatron-Core model chunk, and this pipeline rank's
chunks built with it (build_model_chunks: GPT's, Llama's and BERT's).

Weights are initialized from a seed per *global* parameter name (global layer number, full unsharded
shape, then the tensor-parallel slice), with Megatron's distributions. So every parallel layout
(pp, vpp, tp, dp) starts from the very same model: losses of different layouts agree, which is what
the parity tests check and what makes a schedule comparison fair. The model supplies the mapping
from a chunk-local parameter name to its global name (ModelSpec.global_parameter_name).
"""
from __future__ import annotations

import contextlib
import hashlib
import math
from typing import Callable

import torch
from megatron.core import parallel_state
from megatron.core.transformer import TransformerConfig

from megatron_dpp.mcore.stage_view import building_as_pipeline_rank
from megatron_dpp.pipeline.placement import INTERLEAVED, interleaved, named_placement

# Megatron scales the init of the layers that write into the residual stream by 1/sqrt(2L).
_SCALED_INIT = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")


def _name_seed(seed: int, global_name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{global_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _full_shape(param: torch.nn.Parameter, tp_size: int) -> tuple[list[int], int | None]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
        dim = param.partition_dim
        shape[dim] *= tp_size
        return shape, dim
    return shape, None


@torch.no_grad()
def initialize_layout_independent(model: torch.nn.Module, config: TransformerConfig, seed: int,
                                  global_name: Callable[[torch.nn.Module, str], str]) -> None:
    """Overwrite every parameter of `model` (one chunk) with its layout-independent value."""
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    scaled_std = config.init_method_std / math.sqrt(2.0 * config.num_layers)
    for local_name, param in model.named_parameters():
        name = global_name(model, local_name)
        if name.endswith("bias"):
            param.zero_()
            continue
        if "layernorm" in name or "layer_norm" in name:  # BERT's LM head says layer_norm
            param.fill_(1.0)
            continue
        std = scaled_std if name.endswith(_SCALED_INIT) else config.init_method_std
        shape, split_dim = _full_shape(param, tp_size)
        generator = torch.Generator(device=param.device).manual_seed(_name_seed(seed, name))
        full = torch.empty(shape, dtype=torch.float32, device=param.device)
        full.normal_(mean=0.0, std=std, generator=generator)
        if split_dim is not None:
            # A strided shard (SwiGLU's fc1: gate and up halves, stride 2) holds every tp_size-th
            # of tp_size * stride pieces, as Megatron-Core's own CPU init splits it.
            stride = getattr(param, "partition_stride", 1)
            pieces = full.chunk(tp_size * stride, dim=split_dim)
            full = torch.cat(pieces[tp_rank::tp_size], dim=split_dim)
        param.copy_(full)


def stacked_model_global_name(layers, layers_prefix: str, shares_embedding: bool,
                              local_name: str) -> str:
    """The global name of a parameter of a Megatron-Core GPT or BERT chunk: `layers` (the chunk's
    TransformerBlock layers, named under `layers_prefix`) renumbered by their global layer number,
    and the last stage's copy of a shared embedding named like the first stage's, so both start
    equal."""
    if local_name.startswith(layers_prefix):
        index, rest = local_name[len(layers_prefix):].split(".", 1)
        layer_number = layers[int(index)].layer_number  # 1-based, global
        return f"{layers_prefix}{layer_number - 1}.{rest}"
    if local_name == "output_layer.weight" and shares_embedding:
        return "embedding.word_embeddings.weight"
    return local_name


def stage_placement(args) -> str:
    """The placement the job's chunks are built for: --dpp-stage-placement; Megatron-Core's
    interleaved one for the tools that build a model without the training flags (the converters,
    the search's measurements)."""
    return getattr(args, "dpp_stage_placement", INTERLEAVED)


def build_model_chunks(model_class: type, layer_spec, config: TransformerConfig, seed: int,
                       global_name: Callable[[torch.nn.Module, str], str],
                       placement: str = INTERLEAVED, **model_arguments) -> list[torch.nn.Module]:
    """This pipeline rank's chunks of `model_class` (GPTModel, BertModel or a subclass), one per
    virtual stage, each with its share of `layer_spec`'s layers and initialized layout-free;
    `model_arguments`: the rest of the model's constructor (vocabulary, positions, tying).
    `placement` (pipeline/placement.py's PLACEMENT_NAMES, --dpp-stage-placement): which stage each
    chunk is; chunk c is the placement's stage s, with the layers Megatron-Core gives stage s
    (so uneven splits and layout strings count stages the same way on every placement), the
    embedding where s is the first stage and the output layer and loss where it is the last.
    config.perform_initialization False (Megatron-Core's switch): no initialization at all, for
    a caller that fills every parameter itself (the Hugging Face converter, the export)."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    layout = named_placement(placement, pp_size, vpp or 1)
    # Megatron-Core builds the layers of the stage its own placement puts at (rank, vp_stage).
    megatron_layout = interleaved(pp_size, vpp or 1)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks = []
    for chunk in range(vpp or 1):
        stage = layout.stage(rank, chunk)
        megatron_rank, vp_stage = megatron_layout.location(stage)
        with contextlib.ExitStack() as building:
            where = {}
            if megatron_rank != rank:
                where["pg_collection"] = building.enter_context(
                    building_as_pipeline_rank(megatron_rank))
            model = model_class(
                config=config,
                transformer_layer_spec=layer_spec,
                pre_process=stage == layout.first_stage,
                post_process=stage == layout.last_stage,
                vp_stage=vp_stage if vpp else None,
                **where,
                **model_arguments,
            )
        if config.perform_initialization:
            initialize_layout_independent(model, config, seed, global_name)
        chunks.append(model)
    return chunks
