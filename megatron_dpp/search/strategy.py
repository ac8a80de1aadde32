"""The strategy JSON: the search's winner, as the run scripts read it (`--strategy FILE`).

Format (version STRATEGY_VERSION), one JSON object:
  format            "megatron-dpp-strategy"
  version           STRATEGY_VERSION
  model             {"model": <models.families name>, "num_layers", "hidden_size", "num_attention_heads",
                     "ffn_hidden_size", "seq_length", "max_position_embeddings",
                     "padded_vocab_size", "dtype"}
  num_nodes         nodes of the job
  nproc_per_node    processes (GPUs) per node
  layout            {"tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "num_virtual_stages_per_pipeline_rank", "data_parallel_size",
                     "micro_batch_size", "global_batch_size", "num_microbatches", "recompute"
                     ("none"|"selective"|"full"), "distributed_optimizer", "sequence_parallel",
                     "decoder_last_pipeline_num_layers" (optional: the last stage's layers of an
                     uneven split, 0 or absent: even)}
  schedule          {"name": a schedule of megatron_dpp.pipeline, "use_dpp": bool,
                     "split_backward": bool, "placement" (optional: --dpp-stage-placement,
                     "interleaved" or "v"; absent: interleaved)}
  megatron_flags    the trainer's flags for this strategy, one argv token per list entry
  predicted         {"iteration_ms", "memory_bytes_per_rank" (fullest rank),
                     "activation_peak_bytes" (simulated), "bubble_fraction"}
  sources           {"hardware": HardwareProfile.source, "model": the layer figures' source,
                     "seq_lengths": the --seq-length-distribution or null, "packed_documents"
                     (optional: the --packed-document-distribution, full windows with attention
                     per document, or null)}

    python -m megatron_dpp.search.strategy FILE --print flags|nproc_per_node|num_nodes|model

prints the flags one argv token per line (for `mapfile -t`), or the one value. A file that is not
such a strategy: one line on stderr, exit 2.
"""
from __future__ import annotations

import json
import pathlib
import sys
from typing import TYPE_CHECKING, Any

from megatron_dpp.exit_codes import BAD_INPUT
from megatron_dpp.models.families import MODEL_FAMILIES
from megatron_dpp.parallel.split import LAST_FLAG
from megatron_dpp.one_line_errors import OneLineErrorParser
from megatron_dpp.pipeline.placement import INTERLEAVED, PLACEMENT_NAMES
from megatron_dpp.search.errors import SearchInputError

if TYPE_CHECKING:  # only for annotations: --print must not import numpy or the simulator
    from megatron_dpp.search.cost import LayoutCost, Problem

STRATEGY_FORMAT = "megatron-dpp-strategy"
STRATEGY_VERSION = 1
PRINTABLE = ("flags", "nproc_per_node", "num_nodes", "model")

# key -> expected Python type(s) of each section, checked by read_strategy.
_MODEL_KEYS = {"model": str, "num_layers": int, "hidden_size": int, "num_attention_heads": int,
               "ffn_hidden_size": int, "seq_length": int, "max_position_embeddings": int,
               "padded_vocab_size": int, "dtype": str}
_LAYOUT_KEYS = {"tensor_model_parallel_size": int, "pipeline_model_parallel_size": int,
                "num_virtual_stages_per_pipeline_rank": int, "data_parallel_size": int,
                "micro_batch_size": int, "global_batch_size": int, "num_microbatches": int,
                "recompute": str, "distributed_optimizer": bool, "sequence_parallel": bool}
# Keys a strategy may leave out (written by later versions of the search), with their default.
_OPTIONAL_LAYOUT_KEYS = {"decoder_last_pipeline_num_layers": (int, 0)}
_OPTIONAL_SOURCES_KEYS = {"packed_documents": (str, type(None))}
_SCHEDULE_KEYS = {"name": str, "use_dpp": bool, "split_backward": bool}
_OPTIONAL_SCHEDULE_KEYS = {"placement": (str, INTERLEAVED)}
_PREDICTED_KEYS = {"iteration_ms": (int, float), "memory_bytes_per_rank": int,
                   "activation_peak_bytes": int, "bubble_fraction": (int, float)}
_SOURCES_KEYS = {"hardware": str, "model": str, "seq_lengths": (str, type(None))}
_TOP_KEYS = {"format": str, "version": int, "model": dict, "num_nodes": int, "nproc_per_node": int,
             "layout": dict, "schedule": dict, "megatron_flags": list, "predicted": dict,
             "sources": dict}
_SECTIONS = {"model": _MODEL_KEYS, "layout": _LAYOUT_KEYS, "schedule": _SCHEDULE_KEYS,
             "predicted": _PREDICTED_KEYS, "sources": _SOURCES_KEYS}


def megatron_flags(problem: "Problem", cost: "LayoutCost") -> list[str]:
    """The trainer's flags (megatron_dpp/arguments.py names) for a priced layout, one argv token
    per entry: the model's shape, the batch, the layout, recompute, precision and the schedule."""
    shape, layout = problem.shape, cost.layout
    flags = ["--num-layers", shape.num_layers, "--hidden-size", shape.hidden_size,
             "--num-attention-heads", shape.num_attention_heads, "--ffn-hidden-size", shape.ffn_hidden_size,
             "--seq-length", shape.seq_length, "--max-position-embeddings", shape.max_position_embeddings,
             "--hidden-dropout", shape.hidden_dropout, "--attention-dropout", shape.attention_dropout,
             "--micro-batch-size", layout.micro_batch_size, "--global-batch-size", problem.global_batch_size,
             "--tensor-model-parallel-size", layout.tp, "--pipeline-model-parallel-size", layout.pp]
    if layout.vpp > 1:
        flags += ["--num-virtual-stages-per-pipeline-rank", layout.vpp]
    if layout.last_stage_layers:
        flags += [LAST_FLAG, layout.last_stage_layers]
    if layout.sequence_parallel:
        flags.append("--sequence-parallel")
    if layout.distributed_optimizer:
        flags.append("--use-distributed-optimizer")
    if _overlaps_grad_reduce(problem, layout):
        flags.append("--overlap-grad-reduce")  # cost.py prices the reductions overlapped
    if layout.recompute == "selective":
        flags += ["--recompute-granularity", "selective"]
    elif layout.recompute == "full":
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", 1]
    if shape.untie_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    flags += MODEL_FAMILIES[shape.model].shape_flags(shape)
    if shape.dtype != "fp32":
        flags.append(f"--{shape.dtype}")
    if problem.lengths is not None:
        flags.append("--variable-seq-lengths")
    if problem.packed is not None:
        flags.append("--dataloader-inter-document-masking")  # cost.py prices attention per document
    if layout.use_dpp:
        flags += ["--use-dpp", "--dpp-policy", layout.schedule]
        if layout.placement != INTERLEAVED:
            flags += ["--dpp-stage-placement", layout.placement]
        if layout.split_backward:
            flags.append("--dpp-split-backward")
    return [str(token) for token in flags]


def _overlaps_grad_reduce(problem: "Problem", layout) -> bool:
    """The cost model's rule (cost.Pricer.overlaps_grad_reduce), imported here only when a
    strategy is built: --print must not load the simulator."""
    from megatron_dpp.search.cost import Pricer
    return Pricer(problem).overlaps_grad_reduce(layout)


def build_strategy(problem: "Problem", cost: "LayoutCost", model_source: str) -> dict:
    """The strategy JSON of a priced layout (format: the module docstring)."""
    shape, layout, hardware = problem.shape, cost.layout, problem.hardware
    return {
        "format": STRATEGY_FORMAT,
        "version": STRATEGY_VERSION,
        "model": {"model": shape.model, "num_layers": shape.num_layers, "hidden_size": shape.hidden_size,
                  "num_attention_heads": shape.num_attention_heads,
                  "ffn_hidden_size": shape.ffn_hidden_size, "seq_length": shape.seq_length,
                  "max_position_embeddings": shape.max_position_embeddings,
                  "padded_vocab_size": shape.padded_vocab_size, "dtype": shape.dtype},
        "num_nodes": hardware.num_nodes,
        "nproc_per_node": hardware.gpus_per_node,
        "layout": {"tensor_model_parallel_size": layout.tp, "pipeline_model_parallel_size": layout.pp,
                   "num_virtual_stages_per_pipeline_rank": layout.vpp, "data_parallel_size": layout.dp,
                   "micro_batch_size": layout.micro_batch_size,
                   "global_batch_size": problem.global_batch_size,
                   "num_microbatches": layout.num_microbatches, "recompute": layout.recompute,
                   "distributed_optimizer": layout.distributed_optimizer,
                   "sequence_parallel": layout.sequence_parallel,
                   "decoder_last_pipeline_num_layers": layout.last_stage_layers},
        "schedule": {"name": layout.schedule, "use_dpp": layout.use_dpp,
                     "split_backward": layout.split_backward, "placement": layout.placement},
        "megatron_flags": megatron_flags(problem, cost),
        "predicted": {"iteration_ms": round(cost.time_ms, 3), "memory_bytes_per_rank": cost.memory_bytes,
                      "activation_peak_bytes": cost.activation_peak_bytes,
                      "bubble_fraction": round(cost.bubble_fraction, 4)},
        "sources": {"hardware": hardware.source, "model": model_source,
                    "seq_lengths": problem.lengths.spec if problem.lengths is not None else None,
                    "packed_documents": problem.packed.spec if problem.packed is not None else None},
    }


def _check_keys(where: str, content: dict, keys: dict) -> None:
    for key, kind in keys.items():
        if key not in content:
            raise SearchInputError(f"{where}: missing {key!r}")
        value = content[key]
        # bool is an int in Python: an int field must not take a bool, a bool field only a bool.
        if not isinstance(value, kind) or (kind in (int, (int, float)) and isinstance(value, bool)):
            raise SearchInputError(f"{where}: {key!r} = {value!r} has the wrong type")


def validate_strategy(content: Any, where: str = "strategy") -> dict:
    """Check a parsed strategy; SearchInputError (one line) names the first problem."""
    if not isinstance(content, dict):
        raise SearchInputError(f"{where}: not a JSON object")
    if content.get("format") != STRATEGY_FORMAT:
        raise SearchInputError(f"{where}: format is {content.get('format')!r}, not {STRATEGY_FORMAT!r}")
    if content.get("version") != STRATEGY_VERSION:
        raise SearchInputError(f"{where}: version {content.get('version')!r}; this reader knows "
                               f"version {STRATEGY_VERSION}")
    _check_keys(where, content, _TOP_KEYS)
    for section, keys in _SECTIONS.items():
        _check_keys(f"{where}: {section}", content[section], keys)
    layout = content["layout"]
    _check_keys(f"{where}: layout", layout,
                {key: kind for key, (kind, _) in _OPTIONAL_LAYOUT_KEYS.items() if key in layout})
    sources = content["sources"]
    _check_keys(f"{where}: sources", sources,
                {key: kind for key, kind in _OPTIONAL_SOURCES_KEYS.items() if key in sources})
    schedule = content["schedule"]
    _check_keys(f"{where}: schedule", schedule,
                {key: kind for key, (kind, _) in _OPTIONAL_SCHEDULE_KEYS.items() if key in schedule})
    if schedule.get("placement", INTERLEAVED) not in PLACEMENT_NAMES:
        raise SearchInputError(f"{where}: schedule placement {schedule['placement']!r} is not one of "
                               f"{PLACEMENT_NAMES}")
    if content["model"]["model"] not in MODEL_FAMILIES:
        raise SearchInputError(f"{where}: model {content['model']['model']!r} is not one of "
                               f"{tuple(MODEL_FAMILIES)}")
    if not all(isinstance(token, str) for token in content["megatron_flags"]):
        raise SearchInputError(f"{where}: megatron_flags must be a list of strings")
    for key in ("num_nodes", "nproc_per_node"):
        if content[key] < 1:
            raise SearchInputError(f"{where}: {key} = {content[key]} must be at least 1")
    return content


def write_strategy(content: dict, path) -> pathlib.Path:
    """Write a strategy (checked first) as indented JSON; returns the path."""
    validate_strategy(content, "strategy to write")
    path = pathlib.Path(path)
    if path.parent != pathlib.Path(""):
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content, indent=2) + "\n")
    return path


def read_strategy(path) -> dict:
    """Read and check a strategy file; SearchInputError (one line) for a missing, unreadable or
    malformed one."""
    path = pathlib.Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise SearchInputError(f"strategy {path}: {error.strerror or error}") from None
    try:
        content = json.loads(text)
    except json.JSONDecodeError as error:
        raise SearchInputError(f"strategy {path}: not JSON ({error.msg} at line {error.lineno})") from None
    return validate_strategy(content, f"strategy {path}")


def printed(content: dict, what: str) -> str:
    """What `--print what` writes (without the final newline)."""
    if what == "flags":
        return "\n".join(content["megatron_flags"])
    if what == "model":
        return content["model"]["model"]
    return str(content[what])


def main(argv=None) -> int:
    parser = OneLineErrorParser(prog="python -m megatron_dpp.search.strategy", allow_abbrev=False,
                                 description="Print one part of a strategy JSON written by "
                                             "start-search.sh.")
    parser.add_argument("file", help="The strategy JSON (start-search.sh --output-strategy).")
    parser.add_argument("--print", dest="what", required=True, choices=PRINTABLE,
                        help="flags: the trainer's flags, one argv token per line; nproc_per_node, "
                             "num_nodes: the job's size; model: gpt or bert.")
    args = parser.parse_args(argv)
    try:
        content = read_strategy(args.file)
    except SearchInputError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr, flush=True)
        return BAD_INPUT
    print(printed(content, args.what))
    return 0


if __name__ == "__main__":
    sys.exit(main())
