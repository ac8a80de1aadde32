"""GPT on Megatron-Core: layer spec choice, model chunks per pipeline rank, layout-independent init.

Weights are initialized from a seed per *global* parameter name (global layer number, full unsharded
shape, then the tensor-parallel slice), with Megatron's distributions. So every parallel layout
(pp, vpp, tp, dp) starts from the very same model: losses of different layouts agree, which is what
the parity tests check and what makes a schedule comparison fair.
"""
from __future__ import annotations

import hashlib
import importlib.util
import math
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec


@dataclass(frozen=True)
class GPTShape:
    """What GPTModel needs beyond TransformerConfig."""

    padded_vocab_size: int  # Megatron-LM's padding: a multiple of divisible-by x tp size
    max_position_embeddings: int
    untie_embeddings_and_output_weights: bool


def transformer_engine_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def gpt_layer_spec(config: TransformerConfig) -> ModuleSpec:
    """Transformer Engine layers on a GPU that has them, else Megatron-Core's local layers."""
    if transformer_engine_available():
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec()
    return get_gpt_layer_local_spec()


def build_gpt_chunks(config: TransformerConfig, shape: GPTShape, seed: int) -> list[GPTModel]:
    """The model chunks of this pipeline rank (one per virtual stage), initialized layout-free."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    spec = gpt_layer_spec(config)
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=shape.padded_vocab_size,
            max_sequence_length=shape.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=not shape.untie_embeddings_and_output_weights,
            position_embedding_type="learned_absolute",
            vp_stage=stage,
        )
        initialize_layout_independent(model, config, seed)
        chunks.append(model)
    return chunks


# ----------------------------------------------------------------------------------------------
# layout-independent initialization
# ----------------------------------------------------------------------------------------------
_LAYERS_PREFIX = "decoder.layers."
# Megatron scales the init of the layers that write into the residual stream by 1/sqrt(2L).
_SCALED_INIT = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")


def _global_name(model: GPTModel, local_name: str) -> str:
    """Map a chunk-local parameter name to its name in the unsplit model."""
    if local_name.startswith(_LAYERS_PREFIX):
        index, rest = local_name[len(_LAYERS_PREFIX):].split(".", 1)
        layer_number = model.decoder.layers[int(index)].layer_number  # 1-based, global
        return f"{_LAYERS_PREFIX}{layer_number - 1}.{rest}"
    if local_name == "output_layer.weight" and model.share_embeddings_and_output_weights:
        # The last stage's copy of the shared embedding must start equal to the first stage's.
        return "embedding.word_embeddings.weight"
    return local_name


def _name_seed(seed: int, global_name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{global_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _full_shape(param: torch.nn.Parameter, tp_size: int) -> tuple[list[int], int | None]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
        if getattr(param, "partition_stride", 1) != 1:
            raise ValueError("layout-independent init supports partition stride 1 only")
        dim = param.partition_dim
        shape[dim] *= tp_size
        return shape, dim
    return shape, None


@torch.no_grad()
def initialize_layout_independent(model: GPTModel, config: TransformerConfig, seed: int) -> None:
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    scaled_std = config.init_method_std / math.sqrt(2.0 * config.num_layers)
    for local_name, param in model.named_parameters():
        name = _global_name(model, local_name)
        if name.endswith("bias"):
            param.zero_()
            continue
        if "layernorm" in name:
            param.fill_(1.0)
            continue
        std = scaled_std if name.endswith(_SCALED_INIT) else config.init_method_std
        shape, split_dim = _full_shape(param, tp_size)
        generator = torch.Generator(device=param.device).manual_seed(_name_seed(seed, name))
        full = torch.empty(shape, dtype=torch.float32, device=param.device)
        full.normal_(mean=0.0, std=std, generator=generator)
        if split_dim is not None:
            full = full.chunk(tp_size, dim=split_dim)[tp_rank]
        param.copy_(full)
