"""Galvatron's strategy file (`galvatron_config_*.json`) to and from our `Layout`.

Galvatron's search engine writes, and its runtime reads, one JSON object (Hetu-Galvatron,
galvatron/core/search_engine/search_engine.py `save_results`, galvatron/utils/config_utils.py
`config2strategy`, galvatron/core/runtime/hybrid_parallel_config.py):

  pp_deg                int: pipeline stages
  tp_sizes_enc          "t,t,...": tensor-parallel size of every layer
  tp_consecutive_flags  "1,0,...": 1 = the layer's TP group is consecutive ranks
  dp_types_enc          "0,1,...": 1 = the layer's data parallelism is sdp (ZeRO-3), 0 = default_dp_type
  use_sp                "0,1,...": 1 = Ulysses sequence parallelism (over the tp size) (optional)
  checkpoint            "0,1,...": 1 = the layer is recomputed (full activation checkpointing) (optional)
  global_bsz, chunks    global batch, micro-batches per iteration
  pp_division           "l,l,...": layers per stage (optional: even, the remainder on the last)
  pipeline_type         gpipe | pipedream_flush (optional; its runtime's default: gpipe)
  default_dp_type       "ddp" | "zero2" | "zero3" (optional; default ddp)
  vtp, vsp, vcp         the embedding and output layer's TP size, Ulysses flag, CP size (optional)
  embed_sdp / vocab_sdp 1 = ZeRO-3 for them (optional); cp_sizes_enc, ep_sizes_enc,
                        tp_of_ep_sizes_enc: per-layer CP and MoE sizes (optional, default 1)
Keys besides these are ignored, as Galvatron's runtime ignores them.

Our layout has one TP, one recompute mode and one DP type for every layer, stages that are even
but for the last (Megatron-LM's --decoder-last-pipeline-num-layers: `pp_division` "5,5,5,3"
converts, "4,6,5,3" does not), Megatron's consecutive TP groups, no context or Ulysses parallelism
and no ZeRO-3: a Galvatron strategy with any of these varying or set converts with a one-line
SearchInputError naming the key. DP types:
ddp = ours without --use-distributed-optimizer, zero2 = with it (Megatron's distributed optimizer
shards the optimizer state and reduce-scatters the gradients: ZeRO-2's communication, its memory
as our cost model prices it). pipedream_flush is 1F1B; GPipe is refused (the search does not
price its all-forwards-first memory). Megatron's sequence parallelism is not a field of the file
(Galvatron sets it in its runtime's arguments): read as off; a layout with it writes a note.
"""
from __future__ import annotations

import json
import pathlib
from typing import Any, Optional

from megatron_dpp.pipeline.placement import INTERLEAVED
from megatron_dpp.pipeline.registry import ONE_F_ONE_B
from megatron_dpp.pipeline import registry
from megatron_dpp.search.errors import SearchInputError
from megatron_dpp.search.space import Layout, SpaceInputs, enumerate_layouts

PIPEDREAM_FLUSH = "pipedream_flush"
# Galvatron's gpipe is the schedule our registry names the same way.
GPIPE = registry.GPIPE
DP_TYPES = ("ddp", "zero2", "zero3")
RUNTIME_DEFAULTS = {"pipeline_type": GPIPE, "default_dp_type": "ddp"}  # its args_schema.py


def galvatron_config_file_name(model: str, num_nodes: int, gpus_per_node: int, memory_gb: float,
                               dtype: str) -> str:
    """Galvatron's name for a search result (`save_results`), without its optional parts."""
    return (f"galvatron_config_{model}_{num_nodes}nodes_{gpus_per_node}gpus_per_node_"
            f"{int(memory_gb)}GB_{dtype}.json")


def read_galvatron_config(path) -> dict:
    path = pathlib.Path(path)
    try:
        content = json.loads(path.read_text())
    except OSError as error:
        raise SearchInputError(f"--galvatron-config {path}: {error.strerror or error}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SearchInputError(f"--galvatron-config {path}: not JSON ({error})") from None
    if not isinstance(content, dict):
        raise SearchInputError(f"--galvatron-config {path}: not a JSON object")
    return content


def _int(config: dict, key: str, where: str, default: Any = None) -> int:
    value = config.get(key, default)
    if value is None:
        raise SearchInputError(f"{where}: missing {key!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise SearchInputError(f"{where}: {key} = {value!r} is not an integer")
    return value


def _per_layer(config: dict, key: str, where: str, num_layers: int, default: Optional[int]
               ) -> list[int]:
    """A per-layer list ("1,1,2" as Galvatron writes it, or a JSON list)."""
    value = config.get(key)
    if value is None:
        if default is None:
            raise SearchInputError(f"{where}: missing {key!r}")
        return [default] * num_layers
    try:
        values = ([int(v) for v in value.split(",")] if isinstance(value, str)
                  else [int(v) for v in value])
    except (TypeError, ValueError):
        raise SearchInputError(f"{where}: {key} = {value!r} is not a list of integers") from None
    if len(values) != num_layers:
        raise SearchInputError(f"{where}: {key} has {len(values)} layers, --num-layers is "
                               f"{num_layers}")
    return values


def _runs(values: list[int]) -> str:
    """'layers 0-15: 2, 16-31: 4'."""
    parts, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            parts.append(f"{start}-{i - 1}: {values[start]}" if i - 1 > start else
                         f"{start}: {values[start]}")
            start = i
    return "layers " + ", ".join(parts)


def _uniform(values: list[int], key: str, where: str, what: str) -> int:
    if len(set(values)) > 1:
        raise SearchInputError(f"{where}: {key} varies per layer ({_runs(values)}); our layout "
                               f"has one {what} for every layer: not expressible")
    return values[0]


def layout_from_galvatron(config: dict, where: str, inputs: SpaceInputs) -> Layout:
    """Our layout for a Galvatron strategy, or SearchInputError (one line, naming the key) for
    what ours cannot express. `inputs`: the model and job (--num-layers, the cluster, the batch)."""
    layers = inputs.num_layers
    pp = _int(config, "pp_deg", where)
    if pp < 1:
        raise SearchInputError(f"{where}: pp_deg = {pp} must be at least 1")
    tp = _uniform(_per_layer(config, "tp_sizes_enc", where, layers, None), "tp_sizes_enc", where,
                  "tensor-parallel size")
    for key, what in (("cp_sizes_enc", "context-parallel size"), ("ep_sizes_enc", "expert-parallel size"),
                      ("tp_of_ep_sizes_enc", "expert tensor-parallel size")):
        if _uniform(_per_layer(config, key, where, layers, 1), key, where, what) != 1:
            raise SearchInputError(f"{where}: {key} is not 1: our layouts have no {what}")
    if _uniform(_per_layer(config, "use_sp", where, layers, 0), "use_sp", where,
                "sequence-parallel mode") != 0:
        raise SearchInputError(f"{where}: use_sp is 1 (Ulysses sequence parallelism over the tp "
                               f"size): our layouts have Megatron's tensor parallelism only")
    consecutive = _per_layer(config, "tp_consecutive_flags", where, layers, None)
    if tp > 1 and _uniform(consecutive, "tp_consecutive_flags", where, "TP group placement") != 1:
        raise SearchInputError(f"{where}: tp_consecutive_flags is 0 (TP groups of strided ranks): "
                               f"Megatron's TP groups are consecutive ranks")
    checkpoint = _uniform(_per_layer(config, "checkpoint", where, layers, 0), "checkpoint", where,
                          "recompute mode")
    dp_types = _uniform(_per_layer(config, "dp_types_enc", where, layers, None), "dp_types_enc",
                        where, "data-parallel type")
    default_dp_type = config.get("default_dp_type", RUNTIME_DEFAULTS["default_dp_type"])
    if default_dp_type not in DP_TYPES:
        raise SearchInputError(f"{where}: default_dp_type {default_dp_type!r} is not one of {DP_TYPES}")
    global_bsz, chunks = _int(config, "global_bsz", where), _int(config, "chunks", where)
    if global_bsz != inputs.global_batch_size:
        raise SearchInputError(f"{where}: global_bsz {global_bsz} differs from "
                               f"--global-batch-size {inputs.global_batch_size}")
    world = inputs.world_size
    if world % (tp * pp):
        raise SearchInputError(f"{where}: tp {tp} x pp_deg {pp} does not divide the "
                               f"{world} GPUs of the job")
    dp = world // (tp * pp)
    if chunks < 1 or global_bsz % (dp * chunks):
        raise SearchInputError(f"{where}: global_bsz {global_bsz} is not {chunks} chunks of equal "
                               f"micro-batches on {dp} data-parallel replicas")
    if dp > 1 and (dp_types == 1 or default_dp_type == "zero3"):
        raise SearchInputError(f"{where}: dp_types_enc / default_dp_type ask for ZeRO-3 (sdp): our "
                               f"layouts do not shard parameters (ddp or zero2 only)")
    division = config.get("pp_division")
    if division is not None:
        stages = _per_layer({"pp_division": division}, "pp_division", where, pp, None) \
            if isinstance(division, (str, list)) else None
        if stages is None or sum(stages) != layers:
            raise SearchInputError(f"{where}: pp_division {division!r} is not {pp} stages of "
                                   f"{layers} layers")
    else:  # Galvatron's runtime: even, the remainder on the last stage
        stages = [layers // pp] * (pp - 1) + [layers - layers // pp * (pp - 1)]
    if len(set(stages[:-1])) > 1:
        raise SearchInputError(f"{where}: pp_division {','.join(map(str, stages))}: only the last "
                               f"stage's layers may differ from the others' in our layouts "
                               f"(Megatron-LM's --decoder-last-pipeline-num-layers): not expressible")
    last_stage_layers = stages[-1] if len(set(stages)) > 1 else 0
    pipeline_type = config.get("pipeline_type", RUNTIME_DEFAULTS["pipeline_type"])
    if pp > 1 and pipeline_type != PIPEDREAM_FLUSH:
        raise SearchInputError(f"{where}: pipeline_type {pipeline_type!r}: only {PIPEDREAM_FLUSH!r} "
                               f"(1F1B) converts (GPipe keeps every micro-batch's activations, "
                               f"which the search does not price)")
    if _int(config, "vtp", where, 1) != tp:
        raise SearchInputError(f"{where}: vtp {config.get('vtp', 1)} differs from the layers' tp "
                               f"{tp}: Megatron's embedding and output layer use the layers' TP")
    if _int(config, "vsp", where, 0) != 0 or _int(config, "vcp", where, 1) != 1:
        raise SearchInputError(f"{where}: vsp / vcp set (Ulysses or context parallelism of the "
                               f"embedding): not in our layouts")
    if dp > 1 and (_int(config, "embed_sdp", where, 0) or _int(config, "vocab_sdp", where, 0)):
        raise SearchInputError(f"{where}: embed_sdp / vocab_sdp is 1 (ZeRO-3 for the embedding): "
                               f"our layouts do not shard parameters")
    if tp > 1 and (inputs.gpus_per_node % tp or inputs.num_attention_heads % tp
                   or inputs.ffn_hidden_size % tp):
        raise SearchInputError(f"{where}: tp {tp} must divide the GPUs per node "
                               f"({inputs.gpus_per_node}), the heads and the FFN size")
    if stages[-1] < 1:
        raise SearchInputError(f"{where}: pp_division {','.join(map(str, stages))} leaves the last "
                               f"stage no layer")
    layout = Layout(tp=tp, pp=pp, vpp=1, dp=dp, micro_batch_size=global_bsz // (dp * chunks),
                    num_microbatches=chunks, recompute="full" if checkpoint else "none",
                    distributed_optimizer=dp > 1 and default_dp_type == "zero2"
                    and inputs.on_gpus,
                    sequence_parallel=False, schedule=ONE_F_ONE_B, split_backward=False,
                    last_stage_layers=last_stage_layers)
    if dp > 1 and default_dp_type == "zero2" and not inputs.on_gpus:
        raise SearchInputError(f"{where}: default_dp_type zero2 is our distributed optimizer, "
                               f"which the search prices for GPUs only (--cpu)")
    if layout not in set(enumerate_layouts(inputs)):
        raise SearchInputError(f"{where}: {layout.describe()} is not a layout the trainer "
                               f"accepts (docs/search.md, 'The layouts')")
    return layout


def inexpressible(layout: Layout) -> list[str]:
    """What of `layout` Galvatron's strategy file cannot hold (empty: all of it)."""
    reasons = []
    if layout.vpp > 1:
        reasons.append(f"{layout.vpp} virtual stages per rank")
    if layout.placement != INTERLEAVED:
        reasons.append(f"the {layout.placement} stage placement")
    if layout.schedule != ONE_F_ONE_B:
        reasons.append(f"schedule {layout.schedule}")
    if layout.split_backward:
        reasons.append("split backwards")
    if layout.recompute == "selective":
        reasons.append("selective recompute")
    return reasons


def galvatron_config_from_layout(layout: Layout, num_layers: int, global_batch_size: int) -> dict:
    """Galvatron's strategy for our layout; SearchInputError when `inexpressible` finds anything."""
    reasons = inexpressible(layout)
    if reasons:
        raise SearchInputError(f"{layout.describe()} is not expressible in Galvatron's strategy "
                               f"format: {', '.join(reasons)}")

    def every_layer(value: int) -> str:
        return ",".join([str(value)] * num_layers)

    config = {
        "pp_deg": layout.pp,
        "tp_sizes_enc": every_layer(layout.tp),
        "tp_consecutive_flags": every_layer(1),
        "dp_types_enc": every_layer(0),
        "use_sp": every_layer(0),
        "checkpoint": every_layer(1 if layout.recompute == "full" else 0),
        "global_bsz": global_batch_size,
        "chunks": layout.num_microbatches,
        "pp_division": ",".join(str(count) for count in layout.rank_layers(num_layers)),
        "pipeline_type": PIPEDREAM_FLUSH,
        "default_dp_type": "zero2" if layout.distributed_optimizer else "ddp",
        "vtp": layout.tp,
        "vsp": 0,
        "embed_sdp": 0,
    }
    return config


def sequence_parallel_note(layout: Layout) -> Optional[str]:
    """The line a written Galvatron strategy needs when the layout uses Megatron's sequence
    parallelism (not a field of the file)."""
    if not layout.sequence_parallel:
        return None
    return ("the layout uses Megatron's sequence parallelism, which Galvatron's strategy file "
            "does not hold: set its runtime's train.sequence_parallel")


def write_galvatron_config(config: dict, path) -> pathlib.Path:
    path = pathlib.Path(path)
    if path.parent != pathlib.Path(""):
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=4) + "\n")
    return path
