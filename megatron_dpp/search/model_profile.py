"""ModelProfile: a model's measured layer times and memory, in Galvatron's files.

A profile directory holds Galvatron's two files, with Galvatron's names and keys, so Galvatron's
own readers accept it:

- `computation_profiling_{dtype}_hidden_{h}_head_{a}.json`:
  {"layertype_{t}_bsz{b}_seq{s}": forward ms of one layer}
- `memory_profiling_{dtype}_hidden_{h}_head_{a}.json`:
  {"layertype_{t}[_sp]": {"{seq}": {
       "parameter_size": MB,
       "tp_activation_per_bsz_dict": {"checkpoint": MB, "1": MB, ...}}},
   "other_memory_{pp_off|pp_on_first|pp_on_last}[_sp]":
       {"{seq}": {"model_states": {"{tp}": MB}, "activation": {"{tp}": MB}}}}
  (MB = 2**20 bytes; activations per sample; parameter_size is the layer's parameters at 4 bytes
  each, Galvatron's fp32 convention)

and our companion file `megatron_dpp_profiling_{dtype}_hidden_{h}_head_{a}.json`, which Galvatron
ignores: {"model": <a models.families name>, "source": str,
          "backward_ms": {"layertype_{t}_bsz{b}_seq{s}": ms},
          "selective_activation_per_bsz": {"layertype_{t}[_sp]": {"{seq}": {"{tp}": MB}}},
          "stage_extra_ms": {"first_forward"|"first_backward"|"last_forward"|"last_backward"
                             |"chunk_forward"|"chunk_backward": {"bsz{b}_seq{s}": ms}},
                                                                  (optional; chunk_*: optional)
          "task_overhead_ms": {"forward": ms, "backward": ms},  (optional)
          "tensor_parallel_ms": {"{tp}": {"forward"|"backward"|"chunk_*"|"first_*"|"last_*":
                                 {"bsz{b}_seq{s}": ms}}},       (optional)
          "optimizer_ms_per_parameter": ms}                       (optional).
Without the companion, backward is taken as 2x forward (said in `source`); without stage_extra_ms
the cost model prices the first and last stage's extra work analytically, without its chunk_*
parts (every pipeline chunk's fixed work per task beyond its layers) no such cost, without
task_overhead_ms it adds no per-task cost, without optimizer_ms_per_parameter no optimizer step,
and a tp size without tensor_parallel_ms (times measured on tp processes running the layer
together) is priced as tp = 1's compute / tp plus the hardware profile's all-reduces (older
profiles have none of them).

Galvatron's own profiler's files (its current and previous layouts) read too, without a
companion (docs/search.md, "Galvatron's model profiles", has the evidence for each):

- names `{computation,memory}_profiling_{dtype}_{model}_{unit}.json` (e.g. `..._llama2-7b_all.json`),
  `..._hidden{h}_head{a}_seqlen{s}.json` and `..._hidden{h}_head{a}.json`;
- computation keys `layertype_{t}_bsz{b}_seq{s}`: forward ms of one layer PER SAMPLE at micro-batch
  b (Galvatron divides by the batch; its search engine multiplies by it), read as that x b;
  `layertype_{t}` (previous layout): per sample, no batch or length (the length from the file name
  `seqlen{s}`, else --seq-length); `layernum[...]_bsz{b}[_seq{s}]` (the raw model times it derives
  them from) and `layertype_other_...` (the non-layer part) are skipped, as its reader skips them;
- memory keys `layertype_{t}[_sp]` and `other_memory_{stage}[_sp]` with a sequence level, or
  (previous layout) without it: {"parameter_size", "tp_activation_per_bsz_dict"} and
  {"model_states": MB, "activation": MB} (one figure for every tp); the raw per-strategy
  measurements `{pp}_{tp}_{dp}[_c][_vtp][_sp]` are skipped.
Our own names' computation files (`hidden_{h}_head_{a}`, the layout of Galvatron's usage page for
third-party data) keep this module's reading: ms per micro-batch, as profile_model.sh writes them.
A key that is neither ours nor one of Galvatron's is an error (a typo would drop a figure).

Time between and beyond the measured points (`layer_forward_ms`): at each measured sequence
length a measured batch size takes its measured time, one between two measured sizes the line
through them, one outside the line through the two nearest (below the smallest never less than
proportional to it); one batch size: proportional to b (Galvatron's 'static' mode). Not
Galvatron's least-squares line over all sizes ('batch' mode): on CPUs the time per sample is not
monotonic in the batch (cache sizes), and a line over all sizes moves every measured point. Across
sequence lengths the per-length values at the asked batch are fitted in the length: one length:
proportional to s; two: the line through both; three or more: a + b*s + c*s^2 by least squares.
Outside the measured range the same fits extrapolate; a result is never below 0.
"""
from __future__ import annotations

import bisect
import dataclasses
import json
import pathlib
import re
from typing import Mapping, Optional

import numpy

from megatron_dpp.search.errors import SearchInputError

MB = 2 ** 20
DTYPES = ("bf16", "fp16", "fp32")
STAGES = ("pp_off", "pp_on_first", "pp_on_last")
CHECKPOINT_KEY = "checkpoint"
BACKWARD_FACTOR_WITHOUT_COMPANION = 2.0
_TIME_KEY = re.compile(r"^layertype_(\d+)_bsz(\d+)_seq(\d+)$")
# Galvatron's previous layout: one layer's forward ms per sample, at the file's length.
_PER_SAMPLE_KEY = re.compile(r"^layertype_(\d+)$")
# Galvatron's keys the search does not need: the raw model times its layer times are derived from
# (layernum[2]_bsz1_seq2048, layernum[6]_bsz2, layernum[2,2]_bsz1_seq[512,512]) and the time of
# everything besides the layers (layertype_other_bsz1_seq2048, layertype_other_0_bsz1_seq128).
_SKIPPED_TIME_KEY = re.compile(
    r"^(layernum\[[\d,]+\]|layernum\d+)_bsz\d+(_seq(\d+|\[[\d,]+\]))?$"
    r"|^layertype_other(_\d+)?_bsz\d+_seq(\d+|\[[\d,]+\])$")
# Galvatron's raw per-strategy memory measurements ("{pp}_{tp}_{dp}[_c][_vtp][_sp]": 1_1_8, 1_1_8_sp,
# 1_2_4_vtp_sp, 1_1_8_c), from which it derives the layertype_* and other_memory_* entries.
_SKIPPED_MEMORY_KEY = re.compile(r"^\d+_\d+_\d+(_c)?(_vtp)?(_sp)?$")
# File names: ours, and Galvatron's hidden/head styles (the rest: Galvatron's {model}_{unit}).
_OURS_NAME = re.compile(r"^hidden_(\d+)_head_(\d+)$")
_GALVATRON_HIDDEN_NAME = re.compile(r"^hidden(\d+)_head(\d+)(?:_seqlen(\d+))?$")
_SEQLEN_IN_NAME = re.compile(r"(?:^|_)seqlen(\d+)(?:_|$)")
_EXTRA_KEY = re.compile(r"^bsz(\d+)_seq(\d+)$")
# The work besides the layers: the first stage's embedding, the last stage's final norm, output
# layer and loss; forward and backward (one pipeline stage's tasks at a micro-batch and length).
STAGE_EXTRA_PARTS = ("first_forward", "first_backward", "last_forward", "last_backward")
# Every chunk's fixed work per task beyond its layers (the block's own: a one-layer block's time
# less the layer's); optional in stage_extra_ms (profiles before it have none: no such cost).
CHUNK_PARTS = ("chunk_forward", "chunk_backward")
# What a tensor-parallel measurement times (tensor_parallel_ms), per (batch, seq): one layer's
# forward and backward with its all-reduces, and the chunk's and stages' extra work, on one rank.
TENSOR_PARALLEL_PARTS = ("forward", "backward", *CHUNK_PARTS, *STAGE_EXTRA_PARTS)
TASK_OVERHEAD_PHASES = ("forward", "backward")
_LAYER_KEY = re.compile(r"^layertype_(\d+)(_sp)?$")
_OTHER_KEY = re.compile(r"^other_memory_(pp_off|pp_on_first|pp_on_last)(_sp)?$")


@dataclasses.dataclass(frozen=True)
class LayerMemory:
    """One layer type's memory at one sequence length (with or without sequence parallelism)."""

    parameter_mb: float
    """Galvatron's "parameter_size": the layer's parameters at 4 bytes each, in MB."""
    activation_mb_per_sample: Mapping[int, float]
    """tp -> MB one layer keeps for backward per sample, no recompute (Galvatron's "1", "2"...)."""
    checkpoint_mb_per_sample: float
    """MB per sample with full recompute (Galvatron's "checkpoint")."""
    selective_mb_per_sample: Mapping[int, float]
    """tp -> MB per sample with selective recompute (our companion file; empty without it)."""


@dataclasses.dataclass(frozen=True)
class OtherMemory:
    """The modules besides the layers (embedding, output layer, loss) on one kind of stage."""

    model_states_mb: Mapping[int, float]
    """tp -> MB of their parameters, gradients and optimizer state."""
    activation_mb_per_sample: Mapping[int, float]
    """tp -> MB of activations they keep per sample."""


@dataclasses.dataclass(frozen=True)
class MemoryProfile:
    """Galvatron's memory_profiling file, typed."""

    layers: Mapping[tuple[int, bool, int], LayerMemory]
    """(layer type, sequence parallel, seq length) -> the layer's memory."""
    other: Mapping[tuple[str, bool, int], OtherMemory]
    """(stage: "pp_off" | "pp_on_first" | "pp_on_last", sequence parallel, seq length) -> memory."""


@dataclasses.dataclass(frozen=True)
class ModelProfile:
    """One model's layer times and memory at one hidden size, head count and dtype."""

    model: str
    """The model's name (models.families; from the companion file; "unknown" without it)."""
    hidden_size: int
    num_attention_heads: int
    dtype: str
    """"bf16", "fp16" or "fp32"."""
    forward_ms: Mapping[tuple[int, int, int], float]
    """(layer type, batch, seq) -> one layer's forward time."""
    backward_ms: Mapping[tuple[int, int, int], float]
    """Same keys -> one layer's backward time (companion file; empty: 2x forward)."""
    memory: MemoryProfile
    source: str
    """What these figures are: how and where they were measured, what is computed."""
    stage_extra_ms: Mapping[str, Mapping[tuple[int, int], float]] = dataclasses.field(
        default_factory=dict)
    """part (STAGE_EXTRA_PARTS) -> (batch, seq) -> ms of the first or last stage's work besides
    its layers, at tp = 1; and part (CHUNK_PARTS) -> the same for every chunk's fixed work per
    task besides its layers (companion file; empty, or no chunk parts: not measured)."""
    task_overhead_ms: Optional[tuple[float, float]] = None
    """(forward, backward) ms that Megatron-Core's schedules' forward_step / backward_step add to
    one task beyond the model's own compute (companion file; None: not measured)."""

    optimizer_ms_per_parameter: Optional[float] = None
    """ms per parameter of Megatron-Core's optimizer step (companion file; None: not measured)."""

    tensor_parallel_ms: Mapping[int, Mapping[str, Mapping[tuple[int, int], float]]] = \
        dataclasses.field(default_factory=dict)
    """tp -> part (TENSOR_PARALLEL_PARTS) -> (batch, seq) -> ms on one rank of tp processes that
    ran the layer together, its all-reduces included (companion file; a tp size without an entry:
    tp = 1's compute / tp plus the hardware's all-reduces)."""

    def stage_extra(self, part: str, batch: int, seq: int) -> Optional[float]:
        """The measured extra work `part` at (batch, seq), fitted as the layer times are; None
        when the profile lacks it."""
        return _fit_table(self.stage_extra_ms.get(part), batch, seq, part)

    def tensor_parallel(self, tp: int, part: str, batch: int, seq: int) -> Optional[float]:
        """The measured `part` (TENSOR_PARALLEL_PARTS) at this tp, fitted as the layer times
        are; None when the profile has no measurement at this tp."""
        return _fit_table(self.tensor_parallel_ms.get(tp, {}).get(part), batch, seq, part)

    def layer_forward_ms(self, layer_type: int, batch: int, seq: int) -> float:
        return _fit_time(self.forward_ms, layer_type, batch, seq, "forward")

    def layer_backward_ms(self, layer_type: int, batch: int, seq: int) -> float:
        if not self.backward_ms:
            return BACKWARD_FACTOR_WITHOUT_COMPANION * self.layer_forward_ms(layer_type, batch, seq)
        return _fit_time(self.backward_ms, layer_type, batch, seq, "backward")


# ----------------------------------------------------------------------------------------------
# fitting
# ----------------------------------------------------------------------------------------------
def _fit_batch(points: Mapping[int, float], batch: int) -> float:
    """A measured batch size: its time. Between two measured sizes: the line through them.
    Outside: the line through the two nearest, and below the smallest never less than
    proportional to it (a per-call cost is not negative). One batch size: proportional."""
    if batch in points:
        return points[batch]
    batches = sorted(points)
    if len(batches) == 1:
        return points[batches[0]] * batch / batches[0]
    above = bisect.bisect_left(batches, batch)
    low, high = (batches[0], batches[1]) if above == 0 else (
        (batches[-2], batches[-1]) if above == len(batches) else (batches[above - 1], batches[above]))
    slope = (points[high] - points[low]) / (high - low)
    line = points[low] + slope * (batch - low)
    if above == 0:
        return max(line, points[low] * batch / low)
    return line


def _fit_seq(values: Mapping[int, float], seq: int) -> float:
    """Proportional (one length), linear (two) or quadratic least squares (three or more)."""
    if seq in values:
        return values[seq]
    if len(values) == 1:
        (s0, t0), = values.items()
        return t0 * seq / s0
    seqs = numpy.array(sorted(values), dtype=float)
    times = numpy.array([values[int(s)] for s in seqs])
    coefficients = numpy.polyfit(seqs, times, 1 if len(values) == 2 else 2)
    return float(numpy.polyval(coefficients, seq))


def _fit_table(table: Optional[Mapping[tuple[int, int], float]], batch: int, seq: int,
               what: str) -> Optional[float]:
    """A (batch, seq) -> ms table fitted as the layer times are; None for no table."""
    if not table:
        return None
    return _fit_time({(0, b, s): ms for (b, s), ms in table.items()}, 0, batch, seq, what)


def _fit_time(table: Mapping[tuple[int, int, int], float], layer_type: int, batch: int, seq: int,
              what: str) -> float:
    if batch <= 0 or seq <= 0:
        raise SearchInputError(f"batch and seq must be positive, got {batch}, {seq}")
    by_seq: dict[int, dict[int, float]] = {}
    for (t, b, s), ms in table.items():
        if t == layer_type:
            by_seq.setdefault(s, {})[b] = ms
    if not by_seq:
        raise SearchInputError(f"the model profile has no {what} time for layer type {layer_type}")
    per_seq = {s: _fit_batch(points, batch) for s, points in by_seq.items()}
    return max(0.0, _fit_seq(per_seq, seq))


# ----------------------------------------------------------------------------------------------
# files
# ----------------------------------------------------------------------------------------------
def _suffix(dtype: str, hidden_size: int, num_attention_heads: int) -> str:
    return f"{dtype}_hidden_{hidden_size}_head_{num_attention_heads}.json"


def computation_file_name(dtype: str, hidden_size: int, num_attention_heads: int) -> str:
    return "computation_profiling_" + _suffix(dtype, hidden_size, num_attention_heads)


def memory_file_name(dtype: str, hidden_size: int, num_attention_heads: int) -> str:
    return "memory_profiling_" + _suffix(dtype, hidden_size, num_attention_heads)


def companion_file_name(dtype: str, hidden_size: int, num_attention_heads: int) -> str:
    return "megatron_dpp_profiling_" + _suffix(dtype, hidden_size, num_attention_heads)


def _time_key(key: tuple[int, int, int]) -> str:
    t, b, s = key
    return f"layertype_{t}_bsz{b}_seq{s}"


def _tp_dict(values: Mapping[int, float]) -> dict[str, float]:
    return {str(tp): mb for tp, mb in sorted(values.items())}


def _sp_suffix(sequence_parallel: bool) -> str:
    return "_sp" if sequence_parallel else ""


def write_model_profile_dir(profile: ModelProfile, directory) -> list[pathlib.Path]:
    """Write Galvatron's two files and our companion; returns their paths."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = (profile.dtype, profile.hidden_size, profile.num_attention_heads)
    computation = {_time_key(k): ms for k, ms in sorted(profile.forward_ms.items())}
    memory: dict = {}
    selective: dict = {}
    for (t, sp, s), layer in sorted(profile.memory.layers.items()):
        name = f"layertype_{t}{_sp_suffix(sp)}"
        activation = {CHECKPOINT_KEY: layer.checkpoint_mb_per_sample,
                      **_tp_dict(layer.activation_mb_per_sample)}
        memory.setdefault(name, {})[str(s)] = {"parameter_size": layer.parameter_mb,
                                               "tp_activation_per_bsz_dict": activation}
        if layer.selective_mb_per_sample:
            selective.setdefault(name, {})[str(s)] = _tp_dict(layer.selective_mb_per_sample)
    for (stage, sp, s), other in sorted(profile.memory.other.items()):
        memory.setdefault(f"other_memory_{stage}{_sp_suffix(sp)}", {})[str(s)] = {
            "model_states": _tp_dict(other.model_states_mb),
            "activation": _tp_dict(other.activation_mb_per_sample)}
    companion = {"model": profile.model, "source": profile.source,
                 "backward_ms": {_time_key(k): ms for k, ms in sorted(profile.backward_ms.items())},
                 "selective_activation_per_bsz": selective}
    if profile.stage_extra_ms:
        companion["stage_extra_ms"] = {
            part: {f"bsz{b}_seq{s}": ms for (b, s), ms in sorted(table.items())}
            for part, table in profile.stage_extra_ms.items()}
    if profile.task_overhead_ms is not None:
        companion["task_overhead_ms"] = dict(zip(TASK_OVERHEAD_PHASES, profile.task_overhead_ms))
    if profile.optimizer_ms_per_parameter is not None:
        companion["optimizer_ms_per_parameter"] = profile.optimizer_ms_per_parameter
    if profile.tensor_parallel_ms:
        companion["tensor_parallel_ms"] = {
            str(tp): {part: {f"bsz{b}_seq{s}": ms for (b, s), ms in sorted(table.items())}
                      for part, table in parts.items()}
            for tp, parts in sorted(profile.tensor_parallel_ms.items())}
    paths = []
    for name, content in ((computation_file_name(*names), computation),
                          (memory_file_name(*names), memory),
                          (companion_file_name(*names), companion)):
        path = directory / name
        path.write_text(json.dumps(content, indent=2) + "\n")
        paths.append(path)
    return paths


def _read_json(path: pathlib.Path) -> dict:
    try:
        content = json.loads(path.read_text())
    except OSError as error:
        raise SearchInputError(f"cannot read {path}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise SearchInputError(f"{path} is not valid JSON: {error.msg} at line {error.lineno}") \
            from None
    if not isinstance(content, dict):
        raise SearchInputError(f"{path} must hold a JSON object")
    return content


def _number(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SearchInputError(f"{where} must be a number, got {value!r}")
    return float(value)


def _tp_values(values, where: str) -> dict[int, float]:
    if not isinstance(values, dict):
        raise SearchInputError(f"{where} must be an object of tp -> MB")
    out = {}
    for tp, mb in values.items():
        if tp == CHECKPOINT_KEY:
            continue
        if not str(tp).isdigit():
            raise SearchInputError(f"{where} has key {tp!r}; expected a tensor-parallel size")
        out[int(tp)] = _number(mb, f"{where}[{tp!r}]")
    return out


def _read_times(content: dict, path: pathlib.Path, per_sample: bool = False,
                default_seq: Optional[int] = None) -> dict[tuple[int, int, int], float]:
    """{"layertype_T_bszB_seqS": ms} -> {(T, B, S): ms of one layer at micro-batch B}.
    per_sample: Galvatron's files, whose times are per sample (x B here), which may also hold
    its previous layout's "layertype_T" (per sample at `default_seq`, taken at B = 1) and the
    keys it derives them from (skipped)."""
    times = {}
    for key, ms in content.items():
        match = _TIME_KEY.match(key)
        if match:
            t, b, s = (int(g) for g in match.groups())
            times[(t, b, s)] = _number(ms, f"{path}: {key}") * (b if per_sample else 1)
            continue
        if per_sample or _SKIPPED_TIME_KEY.match(key):
            if _SKIPPED_TIME_KEY.match(key):
                continue
            old = _PER_SAMPLE_KEY.match(key)
            if old:
                if default_seq is None:
                    raise SearchInputError(f"{path}: key {key!r} has no sequence length and the "
                                           f"file name none (seqlen{{S}}): give --seq-length")
                times[(int(old.group(1)), 1, default_seq)] = _number(ms, f"{path}: {key}")
                continue
        raise SearchInputError(f"{path}: key {key!r} is not layertype_T_bszB_seqS (nor one of "
                               f"Galvatron's layertype_T, layernum[...]_bszB[_seqS], "
                               f"layertype_other_bszB_seqS)")
    return times


def _read_stage_extras(content, path: pathlib.Path) -> dict[str, dict[tuple[int, int], float]]:
    if not isinstance(content, dict):
        raise SearchInputError(f"{path}: stage_extra_ms must be an object of part -> times")
    extras = {}
    for part, table in content.items():
        if part not in (*STAGE_EXTRA_PARTS, *CHUNK_PARTS) or not isinstance(table, dict):
            raise SearchInputError(f"{path}: stage_extra_ms has {part!r}; expected an object for "
                                   f"each of {', '.join(STAGE_EXTRA_PARTS)} (and optionally "
                                   f"{', '.join(CHUNK_PARTS)})")
        extras[part] = _read_batch_seq_times(table, f"{path}: stage_extra_ms.{part}")
    for parts in (STAGE_EXTRA_PARTS, CHUNK_PARTS):
        if any(part in extras for part in parts) and not all(extras.get(part) for part in parts):
            raise SearchInputError(f"{path}: stage_extra_ms has some of {', '.join(parts)} but "
                                   "not all, or one without times")
    return extras


def _read_tensor_parallel(content, path: pathlib.Path) -> dict:
    if not isinstance(content, dict):
        raise SearchInputError(f"{path}: tensor_parallel_ms must be an object of tp -> part -> times")
    result = {}
    for tp, parts in content.items():
        if not (isinstance(tp, str) and tp.isdigit() and int(tp) > 1) or not isinstance(parts, dict) \
                or set(parts) != set(TENSOR_PARALLEL_PARTS):
            raise SearchInputError(f"{path}: tensor_parallel_ms[{tp!r}] must be a tp size above 1 "
                                   f"with times for each of {', '.join(TENSOR_PARALLEL_PARTS)}")
        result[int(tp)] = {}
        for part, table in parts.items():
            where = f"{path}: tensor_parallel_ms.{tp}.{part}"
            if not isinstance(table, dict) or not table:
                raise SearchInputError(f"{where} must be an object of bszB_seqS -> ms")
            times = result[int(tp)][part] = _read_batch_seq_times(table, where)
            if min(times.values()) < 0:
                raise SearchInputError(f"{where}: times must not be negative")
    return result


def _read_batch_seq_times(table: dict, where: str) -> dict[tuple[int, int], float]:
    """{"bsz{b}_seq{s}": ms} -> {(b, s): ms}; `where` names the table in errors."""
    times = {}
    for key, ms in table.items():
        match = _EXTRA_KEY.match(key)
        if not match:
            raise SearchInputError(f"{where} key {key!r} is not bszB_seqS")
        times[tuple(int(g) for g in match.groups())] = _number(ms, f"{where}.{key}")
    return times


def _read_task_overhead(content, path: pathlib.Path) -> Optional[tuple[float, float]]:
    if content is None:
        return None
    if not isinstance(content, dict) or set(content) != set(TASK_OVERHEAD_PHASES):
        raise SearchInputError(f"{path}: task_overhead_ms must be {{\"forward\": ms, "
                               f"\"backward\": ms}}")
    values = tuple(_number(content[phase], f"{path}: task_overhead_ms.{phase}")
                   for phase in TASK_OVERHEAD_PHASES)
    if min(values) < 0:
        raise SearchInputError(f"{path}: task_overhead_ms must not be negative")
    return values


def _read_optimizer(value, path: pathlib.Path) -> Optional[float]:
    if value is None:
        return None
    ms = _number(value, f"{path}: optimizer_ms_per_parameter")
    if ms < 0:
        raise SearchInputError(f"{path}: optimizer_ms_per_parameter must not be negative")
    return ms


def _seq(key: str, where: str) -> int:
    if not str(key).isdigit():
        raise SearchInputError(f"{where}: sequence length key {key!r} is not a number")
    return int(key)


def _layer_memory(entry, here: str, selective_mb: dict) -> LayerMemory:
    try:
        activation = entry["tp_activation_per_bsz_dict"]
        parameter_mb = _number(entry["parameter_size"], here + " parameter_size")
        checkpoint = _number(activation[CHECKPOINT_KEY], here + " checkpoint")
    except (KeyError, TypeError) as error:
        raise SearchInputError(f"{here} lacks {error}") from None
    return LayerMemory(parameter_mb=parameter_mb,
                       activation_mb_per_sample=_tp_values(activation, here),
                       checkpoint_mb_per_sample=checkpoint,
                       selective_mb_per_sample=_tp_values(selective_mb, here + " (selective)"))


def _read_memory(content: dict, selective: dict, path: pathlib.Path,
                 default_seq: Optional[int] = None) -> MemoryProfile:
    """Galvatron's memory file: entries with a sequence level ({"{seq}": figures}) or, in its
    previous layout, without (the figures at `default_seq`; other_memory's one MB figure then
    holds at every tp size the layers list). Its raw per-strategy entries are skipped."""
    layers, other, flat_other = {}, {}, {}

    def at_default_seq(where: str) -> int:
        if default_seq is None:
            raise SearchInputError(f"{where} has no sequence level and the file name none "
                                   f"(seqlen{{S}}): give --seq-length")
        return default_seq

    for key, by_seq in content.items():
        where = f"{path}: {key}"
        if _SKIPPED_MEMORY_KEY.match(key):
            continue
        if not isinstance(by_seq, dict):
            raise SearchInputError(f"{where} must be an object of seq -> figures")
        layer_match, other_match = _LAYER_KEY.match(key), _OTHER_KEY.match(key)
        if layer_match:
            layer_type, sp = int(layer_match.group(1)), layer_match.group(2) is not None
            entries = ({str(at_default_seq(where)): by_seq} if "parameter_size" in by_seq
                       else by_seq)
            for seq_key, entry in entries.items():
                layers[(layer_type, sp, _seq(seq_key, where))] = _layer_memory(
                    entry, f"{where}[{seq_key!r}]", selective.get(key, {}).get(seq_key, {}))
        elif other_match:
            stage, sp = other_match.group(1), other_match.group(2) is not None
            if "model_states" in by_seq and not isinstance(by_seq["model_states"], dict):
                flat_other[(stage, sp, at_default_seq(where))] = (
                    _number(by_seq["model_states"], where + " model_states"),
                    _number(by_seq.get("activation"), where + " activation"))
                continue
            for seq_key, entry in by_seq.items():
                here = f"{where}[{seq_key!r}]"
                try:
                    states, activation = entry["model_states"], entry["activation"]
                except (KeyError, TypeError) as error:
                    raise SearchInputError(f"{here} lacks {error}") from None
                other[(stage, sp, _seq(seq_key, where))] = OtherMemory(
                    model_states_mb=_tp_values(states, here + " model_states"),
                    activation_mb_per_sample=_tp_values(activation, here + " activation"))
        else:
            raise SearchInputError(f"{path}: unknown key {key!r} (expected layertype_T[_sp], "
                                   f"other_memory_{{pp_off,pp_on_first,pp_on_last}}[_sp] or "
                                   f"Galvatron's PP_TP_DP[_c][_vtp][_sp])")
    tps = sorted({tp for layer in layers.values() for tp in layer.activation_mb_per_sample}) or [1]
    for key, (states, activation) in flat_other.items():
        other[key] = OtherMemory({tp: states for tp in tps}, {tp: activation for tp in tps})
    return MemoryProfile(layers=layers, other=other)


@dataclasses.dataclass(frozen=True)
class ProfileFiles:
    """One computation/memory file pair of a directory and how to read it."""

    computation: pathlib.Path
    memory: pathlib.Path
    galvatron: bool  # Galvatron's profiler's layout (times per sample), not our own names
    seq_length: Optional[int]  # the file name's seqlen{S}, for entries without a length


def _pair(directory: pathlib.Path, dtype: str, name: str, galvatron: bool) -> ProfileFiles:
    computation = directory / f"computation_profiling_{dtype}_{name}.json"
    memory = directory / f"memory_profiling_{dtype}_{name}.json"
    for path in (computation, memory):
        if not path.is_file():
            raise SearchInputError(f"no {path.name} in {directory} (profile the model with "
                                   f"run_scripts/profile_model.sh)")
    seq = _SEQLEN_IN_NAME.search(name)
    return ProfileFiles(computation, memory, galvatron, int(seq.group(1)) if seq else None)


def find_profile_files(directory, hidden_size: int, num_attention_heads: int, dtype: str,
                       name: Optional[str] = None) -> list[ProfileFiles]:
    """The file pairs to read, by name: `name` (the part after `_{dtype}_`) when given; else our
    `hidden_{h}_head_{a}`; else every Galvatron `hidden{h}_head{a}[_seqlen{s}]` pair (merged); else
    the one Galvatron `{model}_{unit}` pair of this dtype (several: SearchInputError asking for
    the name)."""
    directory = pathlib.Path(directory)
    if name is not None:
        return [_pair(directory, dtype, name, _OURS_NAME.match(name) is None)]
    ours = f"hidden_{hidden_size}_head_{num_attention_heads}"
    if (directory / f"computation_profiling_{dtype}_{ours}.json").is_file() or \
            not directory.is_dir():
        return [_pair(directory, dtype, ours, False)]
    prefix = f"computation_profiling_{dtype}_"
    names = sorted(path.name[len(prefix):-len(".json")] for path in directory.glob(prefix + "*.json"))
    matching = [n for n in names if (m := _GALVATRON_HIDDEN_NAME.match(n))
                and (int(m.group(1)), int(m.group(2))) == (hidden_size, num_attention_heads)]
    if matching:
        return [_pair(directory, dtype, n, True) for n in matching]
    models = [n for n in names if not (_GALVATRON_HIDDEN_NAME.match(n) or _OURS_NAME.match(n))]
    if len(models) == 1:
        return [_pair(directory, dtype, models[0], True)]
    if len(models) > 1:
        raise SearchInputError(f"{directory} holds several model profiles for {dtype} ("
                               + ", ".join(prefix + n + ".json" for n in models)
                               + "): choose one with --model-profile-name NAME (the part after "
                               f"{prefix})")
    return [_pair(directory, dtype, ours, False)]  # the error names our file


def _merge(into: dict, new: Mapping, what: str) -> None:
    for key, value in new.items():
        if key in into and into[key] != value:
            raise SearchInputError(f"{what}: two files give different figures for {key}")
        into[key] = value


def read_model_profile_dir(directory, hidden_size: int, num_attention_heads: int,
                           dtype: str, seq_length: Optional[int] = None,
                           name: Optional[str] = None) -> ModelProfile:
    """Read a model profile directory: our files (with our companion when present) or
    Galvatron's profiler's (`find_profile_files` says which pair). `seq_length`: the length of
    Galvatron entries that have none (previous layout) when the file name has no seqlen{S}."""
    if dtype not in DTYPES:
        raise SearchInputError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    directory = pathlib.Path(directory)
    pairs = find_profile_files(directory, hidden_size, num_attention_heads, dtype, name)
    if not pairs[0].galvatron:
        return _read_ours(directory, pairs[0], hidden_size, num_attention_heads, dtype)
    forward: dict = {}
    layers: dict = {}
    other: dict = {}
    for pair in pairs:
        seq = pair.seq_length or seq_length
        _merge(forward, _read_times(_read_json(pair.computation), pair.computation, True, seq),
               f"{directory} (computation)")
        memory = _read_memory(_read_json(pair.memory), {}, pair.memory, seq)
        _merge(layers, memory.layers, f"{directory} (memory)")
        _merge(other, memory.other, f"{directory} (memory)")
    if not forward:
        raise SearchInputError(f"{pairs[0].computation}: no layer times (layertype_T_bszB_seqS "
                               f"or layertype_T keys)")
    files = ", ".join(p.name for pair in pairs for p in (pair.computation, pair.memory))
    source = (f"Galvatron's profiler's files read from {directory}: {files}; its per-sample "
              f"layer times x the micro-batch; no companion: backward time taken as "
              f"{BACKWARD_FACTOR_WITHOUT_COMPANION:g}x forward, no selective recompute figures")
    return ModelProfile(model="unknown", hidden_size=hidden_size,
                        num_attention_heads=num_attention_heads, dtype=dtype, forward_ms=forward,
                        backward_ms={}, memory=MemoryProfile(layers=layers, other=other),
                        source=source)


def _read_ours(directory: pathlib.Path, pair: ProfileFiles, hidden_size: int,
               num_attention_heads: int, dtype: str) -> ModelProfile:
    """Our two files (and our companion when present)."""
    computation_path, memory_path = pair.computation, pair.memory
    companion_path = directory / companion_file_name(dtype, hidden_size, num_attention_heads)
    companion = _read_json(companion_path) if companion_path.is_file() else {}
    backward = companion.get("backward_ms", {})
    selective = companion.get("selective_activation_per_bsz", {})
    if not isinstance(backward, dict) or not isinstance(selective, dict):
        raise SearchInputError(f"{companion_path}: backward_ms and selective_activation_per_bsz "
                               f"must be objects")
    if companion:
        source = str(companion.get("source", f"read from {directory}"))
    else:
        source = (f"Galvatron files read from {directory}; no {companion_path.name}: backward "
                  f"time taken as {BACKWARD_FACTOR_WITHOUT_COMPANION:g}x forward, no selective "
                  f"recompute figures")
    return ModelProfile(
        model=str(companion.get("model", "unknown")),
        hidden_size=hidden_size, num_attention_heads=num_attention_heads, dtype=dtype,
        forward_ms=_read_times(_read_json(computation_path), computation_path),
        backward_ms=_read_times(backward, companion_path),
        memory=_read_memory(_read_json(memory_path), selective, memory_path),
        source=source,
        stage_extra_ms=_read_stage_extras(companion.get("stage_extra_ms", {}), companion_path),
        task_overhead_ms=_read_task_overhead(companion.get("task_overhead_ms"), companion_path),
        optimizer_ms_per_parameter=_read_optimizer(companion.get("optimizer_ms_per_parameter"),
                                                   companion_path),
        tensor_parallel_ms=_read_tensor_parallel(companion.get("tensor_parallel_ms", {}),
                                                 companion_path))
