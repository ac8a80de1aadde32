"""Measure a ModelProfile by running Megatron-Core's transformer layers as megatron_dpp.models
builds them (GPT: get_gpt_layer_local_spec, BERT: bert_layer_local_spec on CPU; Transformer
Engine's specs on a GPU that has it), in one process (tp = pp = 1).

Per sequence length and micro-batch size, for one transformer layer (TransformerBlocks without
the final layer norm):

- forward and backward time: a one-layer and a two-layer block run alternately, --repeats runs of
  each after --warmup runs; the layer's time is the median of the two-layer less the one-layer
  block's times (Galvatron's way: a model's time at two layer counts), and what the one-layer
  block takes beyond it is the fixed work every pipeline chunk does once per task, whatever its
  number of layers (the companion's stage_extra_ms chunk_forward / chunk_backward);
- the first and the last stage's extra work, forward and backward, the same way: the embedding
  timed alone; the last stage's (final layer norm, output layer at the model's vocabulary, loss)
  as a whole one-layer model's time less the embedding's and the one-layer block's;
- activation bytes kept for backward, exactly: every tensor that autograd saves during the forward
  (torch.autograd.graph.saved_tensors_hooks), each storage counted once, parameters excluded, and
  only storages still alive when the forward returns (a recomputed forward saves nothing); once
  per recompute mode, through Megatron-Core's own recompute paths (TransformerConfig
  recompute_granularity "selective", and "full" with recompute_method "uniform" and one layer per
  unit, as training sets them from the flags: megatron_dpp.models.transformer_config);
- the embedding's and the output head's activations (first and last stage's "other" memory), the
  same way on a whole one-layer model, each storage attributed to the module that saved it first.

Once per profile: Megatron-Core's optimizer step (get_megatron_optimizer: Adam, gradient clipping
1.0, over DistributedDataParallel's buffers, as megatron_dpp.training builds them, torch's fused
AdamW on a GPU without Transformer Engine or Apex as training runs it; no distributed
optimizer) on the one-layer model at the first sequence length, per parameter; and the per-task overhead of Megatron-Core's schedules, the time its
pipeline_parallel.schedules.forward_step and backward_step take around a one-parameter stage
beyond that stage's own forward and backward (medians over TASK_OVERHEAD_REPEATS runs).

At one tensor-parallel size (--measure-tensor-parallel-size, default 2), that many spawned gloo
processes (each on a core of its own where there are enough) run the same measurements together,
rank 0's figures kept: the times at every sequence length and micro-batch size (layer, chunk,
first and last stage, the all-reduces they do included: the companion's tensor_parallel_ms, which
the cost model takes instead of tp = 1's compute / tp plus modelled all-reduces), and the
activations (micro-batch: the largest). The other tensor-parallel sizes and every
sequence-parallel figure (sequence parallelism needs Transformer Engine in megatron_dpp) come
from the analytical model (megatron_dpp.search.memory_model), and so do
parameter counts and model states; memory_model's parameter counts are checked here against the
built model's.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
import warnings
import weakref
from typing import Callable, Iterable, Optional, Sequence

import torch

from megatron_dpp import kernels
from megatron_dpp.models import families
from megatron_dpp.parallel.layout import ParallelLayout
from megatron_dpp.search import memory_model as mm
from megatron_dpp.search.errors import SearchInputError
from megatron_dpp.search.model_profile import (CHUNK_PARTS, MB, STAGE_EXTRA_PARTS,
                                                TENSOR_PARALLEL_PARTS, LayerMemory, MemoryProfile,
                                                ModelProfile, OtherMemory, write_model_profile_dir)

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LAYER_TYPE = 0  # GPT's decoder layer and BERT's encoder layer: Galvatron's layer type 0
DEFAULT_TP_SIZES = (1, 2, 4, 8)
INIT_SEED = 1234
TASK_OVERHEAD_REPEATS = 200  # runs of the one-parameter stage (each takes microseconds)
WORKER_TIMEOUT_S = 300  # the tensor-parallel measurement's processes, start to finish
# Megatron-Core's warnings about what this CPU run does on purpose (no Apex or Transformer Engine:
# torch's own norm and kernels; selective recompute of the local, unfused core attention), which
# would bury the progress lines.
EXPECTED_WARNINGS = (".*Transformer Engine and Apex are not installed", ".*Apex is not installed",
                     ".*core_attn is from transformer_engine", ".*tp_group is None",
                     ".*full scope is deprecated", ".*CUDA_DEVICE_MAX_CONNECTIONS")


@dataclasses.dataclass(frozen=True)
class ProfilingOptions:
    """What to measure (from the command line)."""

    model: str
    """A name in models.families.MODEL_FAMILIES."""
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    seq_lengths: tuple[int, ...]
    micro_batch_sizes: tuple[int, ...]
    dtype: str
    """"bf16", "fp16" or "fp32"."""
    padded_vocab_size: int
    max_position_embeddings: int
    hidden_dropout: float
    attention_dropout: float
    tp_sizes: tuple[int, ...]
    """Tensor-parallel sizes written to the memory file (tp = 1 and measured_tp_size measured,
    the others analytical)."""
    measured_tp_size: int
    """Also measure activations at this tensor-parallel size, with that many local gloo
    processes (1: none)."""
    warmup: int
    """Untimed runs before timing each (seq, batch)."""
    repeats: int
    """Timed runs; the median is kept."""
    shape_fields: dict = dataclasses.field(default_factory=dict)
    """The model's own ModelShape fields (its family's shape_fields: BERT's binary head...)."""

    def shape(self, seq_length: int) -> mm.ModelShape:
        return mm.ModelShape(
            model=self.model, num_layers=1, hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads, ffn_hidden_size=self.ffn_hidden_size,
            seq_length=seq_length, padded_vocab_size=self.padded_vocab_size,
            max_position_embeddings=self.max_position_embeddings, dtype=self.dtype,
            hidden_dropout=self.hidden_dropout, attention_dropout=self.attention_dropout,
            **self.shape_fields)


# ----------------------------------------------------------------------------------------------
# one-process Megatron-Core
# ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def megatron_process_group(model: str, rank: int = 0, tensor_parallel_size: int = 1,
                           store_path: Optional[str] = None):
    """CPU patches (the model's too), a gloo group of `tensor_parallel_size` ranks (one
    tensor-parallel group, pp = 1) through a FileStore at store_path; undone on exit."""
    import torch.distributed as dist

    from megatron_dpp.models import MODEL_SPECS
    from megatron_dpp.platform import setup_platform

    setup_platform(MODEL_SPECS[model].cpu_patched_modules)
    from megatron.core import parallel_state, tensor_parallel

    created = not dist.is_initialized()
    with tempfile.TemporaryDirectory(prefix="model_profiling_") as directory:
        if created:
            store = dist.FileStore(store_path or os.path.join(directory, "store"),
                                   tensor_parallel_size)
            dist.init_process_group("gloo", store=store, rank=rank,
                                    world_size=tensor_parallel_size,
                                    timeout=datetime.timedelta(seconds=WORKER_TIMEOUT_S))
        parallel_state.initialize_model_parallel(tensor_parallel_size, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(INIT_SEED)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            if created:
                dist.destroy_process_group()


def single_process_megatron(model: str):
    """One rank: tp = pp = 1."""
    return megatron_process_group(model)


# The profiler's flags beyond the model's shape, each for a reason of its own; every other
# setting is what a training run's flags give (megatron_dpp.arguments, its defaults included).
PROFILER_FLAGS = (
    # It measures on the CPU whatever the machine (its inputs are CPU tensors).
    "--use-cpu-initialization",
    # Its layers run without DistributedDataParallel, whose main_grad buffers Megatron-Core's fused
    # weight-gradient accumulation writes into (the fusion is off on CPU anyway).
    "--no-gradient-accumulation-fusion",
)


def training_args(shape: mm.ModelShape, recompute: str = "none",
                  tp: int = 1) -> argparse.Namespace:
    """The training flags of a run of this shape at tensor-parallel size tp and pp = 1, parsed by
    megatron_dpp.arguments (full recompute: uniform, one layer per unit), plus PROFILER_FLAGS."""
    from megatron_dpp import arguments

    flags = ["--num-layers", shape.num_layers, "--hidden-size", shape.hidden_size,
             "--ffn-hidden-size", shape.ffn_hidden_size,
             "--num-attention-heads", shape.num_attention_heads, "--seq-length", shape.seq_length,
             "--max-position-embeddings", shape.max_position_embeddings,
             "--hidden-dropout", shape.hidden_dropout,
             "--attention-dropout", shape.attention_dropout,
             "--tensor-model-parallel-size", tp, *PROFILER_FLAGS]
    if shape.dtype != "fp32":
        flags.append(f"--{shape.dtype}")
    if recompute != "none":
        flags += ["--recompute-granularity", recompute]
    if recompute == "full":
        flags += ["--recompute-method", "uniform", "--recompute-num-layers", 1]
    if shape.untie_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    flags += families.model_family(shape.model).shape_flags(shape)
    args = arguments.build_parser(model=shape.model).parse_args([str(flag) for flag in flags])
    families.model_family(shape.model).validate(args)  # its architecture flags resolved
    arguments.validate_model_args(args)
    args.parallel = ParallelLayout()  # pp = 1, no virtual stages (validate_parallel_args' part)
    args.padded_vocab_size = shape.padded_vocab_size  # as build_tokenizer sets it
    return args


def transformer_config(shape: mm.ModelShape, recompute: str = "none", tp: int = 1):
    """Megatron-Core's TransformerConfig as training builds it (megatron_dpp.models.
    transformer_config) from training_args."""
    from megatron_dpp.models.transformer_config import transformer_config_from_args

    return transformer_config_from_args(training_args(shape, recompute, tp))


def layer_spec(model: str, args: argparse.Namespace):
    """The layer spec training builds for these flags (the core attention kernels chose)."""
    from megatron_dpp.models import MODEL_SPECS

    spec = MODEL_SPECS[model]
    return spec.layer_spec(kernels.core_attention_from_args(args).module,
                           **spec.layer_spec_options(args))


def build_layer(shape: mm.ModelShape, recompute: str = "none", tp: int = 1,
                num_layers: int = 1) -> torch.nn.Module:
    """One transformer layer (or `num_layers`) in a TransformerBlock (the block runs Megatron's
    full-recompute path), without the final layer norm, in training mode; tp: this rank's shard."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_dpp.models.transformer_config import transformer_config_from_args

    args = training_args(dataclasses.replace(shape, num_layers=num_layers), recompute, tp)
    block = TransformerBlock(transformer_config_from_args(args), layer_spec(shape.model, args),
                             pre_process=True, post_process=False)
    return block.train()


def build_model(shape: mm.ModelShape, tp: int = 1) -> torch.nn.Module:
    """The whole model with one layer, as training builds it (the model spec's build_chunks,
    pp = 1); in bf16/fp16 wrapped in Megatron-Core's Float16Module as Megatron-LM's get_model does
    (its position embedding is a plain fp32 torch.nn.Embedding until then)."""
    from megatron_dpp.models import MODEL_SPECS
    from megatron_dpp.models.transformer_config import transformer_config_from_args

    args = training_args(dataclasses.replace(shape, num_layers=1), tp=tp)
    config = transformer_config_from_args(args)
    (model,) = MODEL_SPECS[shape.model].build_chunks(args, config, INIT_SEED)
    if shape.dtype != "fp32":
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    return model.train()


def layer_inputs(shape: mm.ModelShape, batch: int) -> tuple[torch.Tensor, dict]:
    """The layer's input [s, b, h] (requires grad, as a received activation) and the attention mask
    the keyword inputs the model's layers get in training (its ModelSpec's sample_layer_inputs:
    the attention mask, Llama's rotary angles)."""
    from megatron_dpp.models import MODEL_SPECS

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(shape.seq_length, batch, shape.hidden_size, generator=generator)
    hidden = hidden.to(TORCH_DTYPES[shape.dtype]).requires_grad_()
    return hidden, MODEL_SPECS[shape.model].sample_layer_inputs(shape, batch)


def model_inputs(shape: mm.ModelShape, batch: int) -> dict:
    from megatron_dpp.models import MODEL_SPECS

    return MODEL_SPECS[shape.model].sample_model_inputs(shape, batch)


# ----------------------------------------------------------------------------------------------
# saved-tensor accounting
# ----------------------------------------------------------------------------------------------
class SavedTensors:
    """Records the tensors autograd saves while active: storage -> (bytes, region, tensor refs).

    A storage is counted once however many tensors view it; `alive_bytes` counts the storages
    that some saved tensor still holds (saves of a discarded graph, e.g. a recompute's no-grad
    forward, die with it). Parameters are excluded."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._storages: dict[int, tuple[int, str, list]] = {}
        self.region = "default"
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._excluded:
            return tensor
        entry = self._storages.get(key)
        if entry is None or not any(ref() is not None for ref in entry[2]):
            entry = (storage.nbytes(), self.region, [])  # new, or a freed storage's address reused
            self._storages[key] = entry
        entry[2].append(weakref.ref(tensor))
        return tensor

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    def alive_bytes(self, region: Optional[str] = None) -> int:
        return sum(nbytes for nbytes, where, refs in self._storages.values()
                   if (region is None or where == region)
                   and any(ref() is not None for ref in refs))


def measured_layer_activation_bytes(block: torch.nn.Module, shape: mm.ModelShape,
                                    batch: int) -> int:
    """Bytes one layer keeps for backward for one micro-batch (the layer's input included)."""
    hidden, inputs = layer_inputs(shape, batch)
    with SavedTensors(exclude=block.parameters()) as saved:
        output = block(hidden, **inputs)
    nbytes = saved.alive_bytes()
    del output
    return nbytes


def measured_other_activation_bytes(model: torch.nn.Module, shape: mm.ModelShape,
                                    batch: int) -> tuple[int, int]:
    """(embedding, head) bytes kept for backward by a whole one-layer model: each storage goes to
    the module that saved it first; the layer's own are left out."""
    saved = SavedTensors(exclude=model.parameters())
    saved.region = "head"

    def enter(region: str) -> Callable:
        def hook(*_args):
            saved.region = region
        return hook

    inner = getattr(model, "module", model)  # inside Float16Module
    from megatron_dpp.models import MODEL_SPECS

    layers = MODEL_SPECS[shape.model].transformer_layers(inner)
    handles = [inner.embedding.register_forward_pre_hook(enter("embedding")),
               inner.embedding.register_forward_hook(enter("head"))]
    for layer in layers:
        handles += [layer.register_forward_pre_hook(enter("layer")),
                    layer.register_forward_hook(enter("head"))]
    try:
        with saved:
            output = model(**model_inputs(shape, batch))
    finally:
        for handle in handles:
            handle.remove()
    result = saved.alive_bytes("embedding"), saved.alive_bytes("head")
    del output
    return result


def check_parameter_counts(model: torch.nn.Module, block: torch.nn.Module,
                           shape: mm.ModelShape) -> None:
    """memory_model's counts must be the built modules' (else the figures written are wrong)."""
    built_layer = sum(p.numel() for p in block.parameters())
    built_total = sum(p.numel() for p in model.parameters())
    one_layer = dataclasses.replace(shape, num_layers=1)
    expected = (mm.layer_parameter_count(shape), mm.total_parameter_count(one_layer))
    if (built_layer, built_total) != expected:
        raise RuntimeError(f"memory_model's parameter counts {expected} differ from "
                           f"Megatron-Core's "
                           f"{(built_layer, built_total)} (layer, one-layer model)")


# ----------------------------------------------------------------------------------------------
# tensor-parallel activations: tp local processes
# ----------------------------------------------------------------------------------------------
def _tensor_parallel_worker(rank: int, tp: int, options: ProfilingOptions, store_path: str,
                            result_path: str) -> None:
    """One tensor-parallel rank, on a core of its own where there are enough (as training pins
    its ranks): every rank runs the same layers (their all-reduces); rank 0 writes
    {"activations": {"seq:part": bytes} (part: a recompute mode, "embedding" or "head"),
    "times": {part (TENSOR_PARALLEL_PARTS): {"batch:seq": ms}}}."""
    for message in EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) >= tp:
        os.sched_setaffinity(0, {cores[rank]})
    torch.set_num_threads(1)
    largest = max(options.micro_batch_sizes)
    activations: dict[str, int] = {}
    times: dict[str, dict[str, float]] = {part: {} for part in TENSOR_PARALLEL_PARTS}
    with megatron_process_group(options.model, rank, tp, store_path):
        for seq in options.seq_lengths:
            shape = options.shape(seq)
            for mode in mm.RECOMPUTE_MODES:
                block = build_layer(shape, mode, tp)
                activations[f"{seq}:{mode}"] = measured_layer_activation_bytes(block, shape, largest)
            model = build_model(shape, tp)
            embedding, head = measured_other_activation_bytes(model, shape, largest)
            activations[f"{seq}:embedding"], activations[f"{seq}:head"] = embedding, head
            blocks = (build_layer(shape, tp=tp), build_layer(shape, tp=tp, num_layers=2))
            for batch in options.micro_batch_sizes:
                for part, ms in time_parts(blocks, model, shape, batch, options).items():
                    times[part][f"{batch}:{seq}"] = ms
    if rank == 0:
        pathlib.Path(result_path).write_text(json.dumps({"activations": activations,
                                                         "times": times}))


def measure_tensor_parallel(options: ProfilingOptions, tp: int
                            ) -> tuple[dict[tuple[int, str], int], dict[str, dict[tuple[int, int], float]]]:
    """Measured by tp spawned processes over gloo (no sequence parallelism: it needs Transformer
    Engine here): (seq, part) -> bytes one rank keeps at micro-batch max(micro_batch_sizes), and
    part (TENSOR_PARALLEL_PARTS) -> (batch, seq) -> ms on rank 0."""
    context = torch.multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="model_profiling_tp_") as directory:
        result_path = os.path.join(directory, "result.json")
        workers = [context.Process(target=_tensor_parallel_worker, daemon=True,
                                   args=(rank, tp, options, os.path.join(directory, "store"),
                                         result_path))
                   for rank in range(tp)]
        for worker in workers:
            worker.start()
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        unfinished = [worker for worker in workers if worker.is_alive()]
        for worker in unfinished:
            worker.terminate()
            worker.join(10)
        if unfinished:
            raise RuntimeError(f"the tp={tp} measurement ({tp} gloo processes) did not "
                               f"finish within {WORKER_TIMEOUT_S} s")
        failed = [worker.exitcode for worker in workers if worker.exitcode != 0]
        if failed or not os.path.exists(result_path):
            raise RuntimeError(f"the tp={tp} measurement failed (exit codes "
                               f"{[worker.exitcode for worker in workers]}); see its stderr above")
        raw = json.loads(pathlib.Path(result_path).read_text())
    activations = {(int(key.split(":")[0]), key.split(":")[1]): nbytes
                   for key, nbytes in raw["activations"].items()}
    times = {part: {tuple(int(x) for x in key.split(":")): ms for key, ms in table.items()}
             for part, table in raw["times"].items()}
    return activations, times


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LayerTimes:
    """Forward and backward ms of a one-layer block, split as Galvatron splits a model's time: the
    layer's own (a two-layer block's time less a one-layer block's) and the block's fixed part
    (the one-layer block's time less the layer's), which every pipeline chunk pays once per task
    whatever its number of layers."""
    one_layer_block: tuple[float, float]
    layer: tuple[float, float]
    chunk: tuple[float, float]


def time_layer(blocks: Sequence[torch.nn.Module], shape: mm.ModelShape, batch: int, warmup: int,
               repeats: int) -> LayerTimes:
    """`blocks`: a one-layer and a two-layer block, run alternately (`repeats` runs of each after
    `warmup` untimed ones) so that both see the same load. Per phase: the layer = the median of
    the runs' two-layer minus one-layer times, when that is above 0 and at most the one-layer
    block's median, else that median; the chunk's fixed part = the one-layer block's median less
    the layer."""
    hidden, inputs = layer_inputs(shape, batch)
    grad = torch.ones(shape.seq_length, batch, shape.hidden_size, dtype=hidden.dtype)
    timed = [([], []) for _ in blocks]
    for run in range(warmup + repeats):
        for block, (forward, backward) in zip(blocks, timed):
            start = time.perf_counter()
            output = block(hidden, **inputs)
            middle = time.perf_counter()
            output.backward(grad)
            end = time.perf_counter()
            hidden.grad = None
            if run >= warmup:
                forward.append((middle - start) * 1e3)
                backward.append((end - middle) * 1e3)
    one, two = timed
    whole = tuple(statistics.median(one[phase]) for phase in (0, 1))
    added = [statistics.median(b - a for a, b in zip(one[phase], two[phase])) for phase in (0, 1)]
    # Where noise hides the second layer (no positive difference), or makes it dearer than the
    # whole one-layer block, the block is all layer: no fixed part.
    layer = tuple(added[phase] if 0.0 < added[phase] <= whole[phase] else whole[phase]
                  for phase in (0, 1))
    return LayerTimes(one_layer_block=whole, layer=layer,
                      chunk=tuple(whole[phase] - layer[phase] for phase in (0, 1)))


def time_parts(blocks: Sequence[torch.nn.Module], model: torch.nn.Module, shape: mm.ModelShape,
               batch: int, options: ProfilingOptions) -> dict[str, float]:
    """{part (TENSOR_PARALLEL_PARTS): ms} at this batch: the layer's forward and backward and the
    chunk's fixed work (time_layer on the one- and two-layer `blocks`), the stages' extras
    (time_stage_extras on the one-layer `model`)."""
    layer = time_layer(blocks, shape, batch, options.warmup, options.repeats)
    extras = time_stage_extras(model, shape, batch, options.warmup, options.repeats,
                               layer.one_layer_block)
    return {"forward": layer.layer[0], "backward": layer.layer[1],
            **dict(zip(CHUNK_PARTS, layer.chunk)), **extras}


def _loss(output) -> torch.Tensor:
    """A scalar to run the whole model's backward from (BERT returns (lm loss, binary logits))."""
    if isinstance(output, tuple):
        output = output[0]
    return output.float().sum()


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def time_stage_extras(model: torch.nn.Module, shape: mm.ModelShape, batch: int, warmup: int,
                      repeats: int, layer_ms: tuple[float, float]) -> dict[str, float]:
    """{part: ms} for model_profile.STAGE_EXTRA_PARTS: the embedding alone (first stage), and the
    whole one-layer model less the embedding and `layer_ms` (a one-layer block's forward,
    backward: the layer and the chunk's fixed work): the last stage's final norm, output layer
    and loss. Never below 0."""
    inner = getattr(model, "module", model)  # inside Float16Module
    inputs = model_inputs(shape, batch)
    positions = torch.arange(shape.seq_length).repeat(batch, 1)
    timed = {"embedding": ([], []), "model": ([], [])}
    for run in range(warmup + repeats):
        start = time.perf_counter()
        embedded = inner.embedding(input_ids=inputs["input_ids"], position_ids=positions,
                                   tokentype_ids=inputs.get("tokentype_ids"))
        middle = time.perf_counter()
        embedded.backward(torch.ones_like(embedded))
        end = time.perf_counter()
        loss = _loss(model(**inputs))
        after_forward = time.perf_counter()
        loss.backward()
        after_backward = time.perf_counter()
        model.zero_grad(set_to_none=True)
        if run >= warmup:
            timed["embedding"][0].append(middle - start)
            timed["embedding"][1].append(end - middle)
            timed["model"][0].append(after_forward - end)
            timed["model"][1].append(after_backward - after_forward)
    first = [_median_ms(times) for times in timed["embedding"]]
    whole = [_median_ms(times) for times in timed["model"]]
    last = [max(0.0, whole[i] - first[i] - layer_ms[i]) for i in (0, 1)]
    return dict(zip(STAGE_EXTRA_PARTS, (*first, *last)))


def time_optimizer_step(shape: mm.ModelShape, warmup: int, repeats: int) -> float:
    """ms per parameter of Megatron-Core's optimizer step over a whole one-layer model (median of
    `repeats` steps after `warmup`, on the gradients of one forward and backward)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_dpp.mcore.optimizer import set_torch_adam_implementation

    model = build_model(shape)
    config = transformer_config(dataclasses.replace(shape, num_layers=1))
    half = shape.dtype != "fp32"
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=half),
                                  module=model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, clip_grad=1.0, bf16=shape.dtype == "bf16",
                        fp16=shape.dtype == "fp16", params_dtype=TORCH_DTYPES[shape.dtype]), [ddp])
    # The implementation training runs here (torch's fused AdamW on a GPU without Transformer
    # Engine or Apex).
    set_torch_adam_implementation(optimizer, fused=kernels.torch_fused_adam("adam"))
    _loss(ddp(**model_inputs(shape, 1))).backward()
    times = []
    for run in range(warmup + repeats):
        start = time.perf_counter()
        optimizer.step()
        if run >= warmup:
            times.append(time.perf_counter() - start)
    return _median_ms(times) / sum(p.numel() for p in model.parameters())


class _OneParameterStage(torch.nn.Module):
    """A pipeline stage with one parameter: input x weight (what a schedule needs of a model)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.input_tensor = None

    def set_input_tensor(self, input_tensor) -> None:
        self.input_tensor = input_tensor[0]

    def forward(self) -> torch.Tensor:
        return self.input_tensor * self.weight


def time_task_overhead(config, repeats: int = TASK_OVERHEAD_REPEATS) -> tuple[float, float]:
    """(forward, backward) ms that Megatron-Core's forward_step / backward_step (a middle stage's:
    no loss) take beyond the stage's own forward and backward, on a one-parameter stage."""
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel.schedules import backward_step, forward_step

    stage = _OneParameterStage()
    direct, scheduled = ([], []), ([], [])
    for run in range(repeats + 10):  # the first 10 warm up
        received = torch.ones(4, requires_grad=True)
        start = time.perf_counter()
        stage.set_input_tensor([received])
        output = stage()
        middle = time.perf_counter()
        torch.autograd.backward(output, grad_tensors=torch.ones(4))
        end = time.perf_counter()
        received = torch.ones(4, requires_grad=True)
        before = time.perf_counter()
        output, _ = forward_step(lambda _iterator, model: (model(), None), None, stage, 1, received,
                                 [], config, 1, is_last_stage=False)
        between = time.perf_counter()
        backward_step(received, output, torch.ones(4), ModelType.encoder_or_decoder, config)
        after = time.perf_counter()
        if run >= 10:
            direct[0].append(middle - start)
            direct[1].append(end - middle)
            scheduled[0].append(between - before)
            scheduled[1].append(after - between)
    return tuple(max(0.0, _median_ms(scheduled[i]) - _median_ms(direct[i])) for i in (0, 1))


# ----------------------------------------------------------------------------------------------
# the profile
# ----------------------------------------------------------------------------------------------
def _mb(nbytes: float) -> float:
    return nbytes / MB


def profile_model(options: ProfilingOptions,
                  progress: Callable[[str], None] = lambda line: None) -> ModelProfile:
    """Measure every (seq, batch) of `options`; call inside `single_process_megatron`."""
    forward_ms, backward_ms = {}, {}
    extras: dict[str, dict[tuple[int, int], float]] = {part: {} for part in
                                                       (*STAGE_EXTRA_PARTS, *CHUNK_PARTS)}
    layers, other = {}, {}
    largest_batch = max(options.micro_batch_sizes)
    tp_measured: dict[tuple[int, str], int] = {}
    tensor_parallel_ms = {}
    if options.measured_tp_size > 1:
        progress(f"measuring times and activations at tp={options.measured_tp_size} "
                 f"({options.measured_tp_size} gloo processes, up to {WORKER_TIMEOUT_S} s)")
        tp_measured, tp_times = measure_tensor_parallel(options, options.measured_tp_size)
        tensor_parallel_ms = {options.measured_tp_size: tp_times}
        largest_seq = options.seq_lengths[-1]
        progress(f"tp={options.measured_tp_size}, seq {largest_seq} micro-batch {largest_batch}: "
                 f"forward {tp_times['forward'][(largest_batch, largest_seq)]:.3f} ms, backward "
                 f"{tp_times['backward'][(largest_batch, largest_seq)]:.3f} ms per layer, "
                 "all-reduces included")
    steps = len(options.seq_lengths) * len(options.micro_batch_sizes)
    step = 0
    for seq in options.seq_lengths:
        shape = options.shape(seq)
        blocks = {mode: build_layer(shape, mode) for mode in mm.RECOMPUTE_MODES}
        two_layers = build_layer(shape, num_layers=2)
        model = build_model(shape)
        check_parameter_counts(model, blocks["none"], shape)
        measured = {}
        for batch in options.micro_batch_sizes:
            step += 1
            times = time_parts((blocks["none"], two_layers), model, shape, batch, options)
            fwd, bwd = times.pop("forward"), times.pop("backward")
            forward_ms[(LAYER_TYPE, batch, seq)] = fwd
            backward_ms[(LAYER_TYPE, batch, seq)] = bwd
            for part, ms in times.items():
                extras[part][(batch, seq)] = ms
            if batch == largest_batch:
                measured = {mode: measured_layer_activation_bytes(block, shape, batch)
                            for mode, block in blocks.items()}
                measured["embedding"], measured["head"] = measured_other_activation_bytes(
                    model, shape, batch)
            progress(f"[{step}/{steps}] {options.model} seq {seq} micro-batch {batch}: "
                     f"forward {fwd:.3f} ms, backward {bwd:.3f} ms per layer; every chunk +"
                     f"{times['chunk_forward']:.3f}/{times['chunk_backward']:.3f} ms; first stage +"
                     f"{extras['first_forward'][(batch, seq)]:.3f}/"
                     f"{extras['first_backward'][(batch, seq)]:.3f} ms, last stage +"
                     f"{extras['last_forward'][(batch, seq)]:.3f}/"
                     f"{extras['last_backward'][(batch, seq)]:.3f} ms")
        measured_by_tp = {1: measured}
        if tp_measured:
            measured_by_tp[options.measured_tp_size] = {
                part: nbytes for (s, part), nbytes in tp_measured.items() if s == seq}
        layers.update(_layer_memory(options, shape, measured_by_tp, largest_batch))
        other.update(_other_memory(options, shape, measured_by_tp, largest_batch))
    overhead = time_task_overhead(transformer_config(options.shape(options.seq_lengths[0])))
    optimizer = time_optimizer_step(options.shape(options.seq_lengths[0]), options.warmup,
                                    options.repeats)
    progress(f"optimizer step: {optimizer * 1e6:.3f} ms per million parameters")
    progress(f"per-task overhead of Megatron-Core's forward_step/backward_step: "
             f"{overhead[0]:.3f}/{overhead[1]:.3f} ms")
    measured_tps = "1" + (f" and {options.measured_tp_size}" if tp_measured else "")
    source = (f"measured on {_device_name()} by megatron_dpp.search.model_measurement: Megatron-Core "
              f"{options.model} layers, {options.dtype}, one process, torch threads "
              f"{torch.get_num_threads()}, median of {options.repeats} after {options.warmup} "
              f"warm-up; first/last stage extras (embedding; final norm, output layer at vocabulary "
              f"{options.padded_vocab_size}, loss) and every chunk's fixed work measured at "
              f"tp={measured_tps}; layer times at tp={measured_tps}; per-task overhead of "
              f"forward_step/backward_step and optimizer step per parameter measured; activations "
              f"measured at tp={measured_tps} (saved tensors at "
              f"micro-batch {largest_batch}, per sample; tp>1 with as many gloo processes), "
              f"other tp sizes, all sequence-parallel activations and all model states from the "
              f"analytical model (memory_model)")
    return ModelProfile(model=options.model, hidden_size=options.hidden_size,
                        num_attention_heads=options.num_attention_heads, dtype=options.dtype,
                        forward_ms=forward_ms, backward_ms=backward_ms,
                        memory=MemoryProfile(layers=layers, other=other), source=source,
                        stage_extra_ms=extras, task_overhead_ms=overhead,
                        optimizer_ms_per_parameter=optimizer, tensor_parallel_ms=tensor_parallel_ms)


def _device_name() -> str:
    import platform

    return f"{platform.machine()} CPU ({os.cpu_count()} cores)"


def _layer_memory(options: ProfilingOptions, shape: mm.ModelShape,
                  measured: dict[int, dict[str, int]], batch: int) -> dict:
    """Per sample: the measured tp sizes without sequence parallelism (tp = 1 is the same with
    it) measured, the others from memory_model."""
    parameter_mb = _mb(mm.layer_parameter_count(shape) * mm.ELEMENT_BYTES["fp32"])
    result = {}
    for sp in (False, True):
        def per_sample(tp: int, recompute: str) -> float:
            if tp in measured and (tp == 1 or not sp):
                return _mb(measured[tp][recompute] / batch)
            return _mb(mm.layer_activation_bytes(shape, batch, tp, sp, recompute) / batch)

        result[(LAYER_TYPE, sp, shape.seq_length)] = LayerMemory(
            parameter_mb=parameter_mb,
            activation_mb_per_sample={tp: per_sample(tp, "none") for tp in options.tp_sizes},
            checkpoint_mb_per_sample=per_sample(1, "full"),
            selective_mb_per_sample={tp: per_sample(tp, "selective") for tp in options.tp_sizes})
    return result


def _other_memory(options: ProfilingOptions, shape: mm.ModelShape,
                  measured: dict[int, dict[str, int]], batch: int) -> dict:
    """Model states from memory_model's counts (dp = 1, no distributed optimizer: Galvatron's
    cost model shards them itself); activations per sample, measured at the measured tp sizes
    (without sequence parallelism, or tp = 1), else from memory_model."""
    tied = families.model_family(shape.model).ties_output(shape.untie_embeddings_and_output_weights)
    result = {}
    for sp in (False, True):
        for stage in ("pp_off", "pp_on_first", "pp_on_last"):
            states, activation = {}, {}
            for tp in options.tp_sizes:
                embedding = mm.embedding_parameter_count(shape, tp)
                output = mm.output_parameter_count(shape, tp)
                shared = shape.padded_vocab_size // tp * shape.hidden_size if tied else 0
                if tp in measured and (tp == 1 or not sp):
                    first, last = measured[tp]["embedding"], measured[tp]["head"]
                else:
                    first = mm.embedding_activation_bytes(shape, batch, tp, sp)
                    last = mm.output_activation_bytes(shape, batch, tp, sp)
                count, nbytes = {"pp_off": (embedding + output - shared, first + last),
                                 "pp_on_first": (embedding, first),
                                 "pp_on_last": (output, last)}[stage]
                states[tp] = _mb(mm.model_state_bytes(count, shape.dtype))
                activation[tp] = _mb(nbytes / batch)
            result[(stage, sp, shape.seq_length)] = OtherMemory(states, activation)
    return result


# ----------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from megatron_dpp.one_line_errors import OneLineErrorParser

    parser = OneLineErrorParser(
        prog="profile_model.sh", allow_abbrev=False,
        description="Measure one transformer layer of a model (Megatron-Core, one process): "
                    "forward/backward time and activation memory per sequence length and "
                    "micro-batch size; write Galvatron's computation_profiling_* and "
                    "memory_profiling_* files plus our megatron_dpp_profiling_* companion.")
    parser.add_argument("--model", choices=sorted(families.MODEL_FAMILIES),
                        default=families.DEFAULT_MODEL,
                        help=f"Which model's layers to run (default {families.DEFAULT_MODEL}).")
    parser.add_argument("--hidden-size", type=int, required=True, help="Transformer hidden size.")
    parser.add_argument("--num-attention-heads", type=int, required=True,
                        help="Number of attention heads.")
    parser.add_argument("--ffn-hidden-size", type=int, default=None,
                        help="MLP hidden size (default: 4 * hidden size).")
    lengths = parser.add_mutually_exclusive_group()
    lengths.add_argument("--seq-length", type=int, default=None,
                         help="One sequence length to profile.")
    lengths.add_argument("--seq-lengths", type=int, nargs="+", default=None,
                         help="Several sequence lengths (3+ enable the quadratic fit in length).")
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1, 2, 4],
                        help="Micro-batch sizes to time (default 1 2 4); memory is measured at "
                             "the largest.")
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true", help="Run in bf16 (default fp32).")
    precision.add_argument("--fp16", action="store_true", help="Run in fp16 (default fp32).")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="Vocabulary size before padding (default: the model's tokenizer's, "
                             + ", ".join(f"{f.default_vocab_size} for {f.name}"
                                         for f in families.MODEL_FAMILIES.values())
                             + "); padded as Megatron-LM does.")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                        help="Pad the vocabulary to a multiple of this (default 128).")
    parser.add_argument("--max-position-embeddings", type=int, default=None,
                        help="Position embeddings (default: the largest sequence length).")
    parser.add_argument("--hidden-dropout", type=float, default=0.1,
                        help="Hidden dropout probability (default 0.1, as Megatron-LM).")
    parser.add_argument("--attention-dropout", type=float, default=0.1,
                        help="Attention dropout probability (default 0.1, as Megatron-LM).")
    families.add_architecture_shape_args(parser)  # Megatron-LM's (gpt takes them all)
    for family in families.MODEL_FAMILIES.values():  # each model's own shape flags
        family.add_shape_args(parser)
    parser.add_argument("--tensor-model-parallel-sizes", type=int, nargs="+",
                        default=list(DEFAULT_TP_SIZES),
                        help="Tensor-parallel sizes written to the memory file (default 1 2 4 8; "
                             "those that do not divide the heads are dropped; tp>1 analytical).")
    parser.add_argument("--measure-tensor-parallel-size", type=int, default=2,
                        help="Also measure the times (all-reduces included) and activations at "
                             "this tensor-parallel size with that many local gloo processes "
                             "(default 2; 1: only tp=1 is measured).")
    parser.add_argument("--warmup", type=int, default=3, help="Untimed runs first (default 3).")
    parser.add_argument("--repeats", type=int, default=10,
                        help="Timed runs of each block; the median is kept (default 10). More "
                             "repeats steady the tensor-parallel times, the noisiest figures.")
    parser.add_argument("--quick", action="store_true",
                        help="For tests: 1 warm-up run and 3 timed runs.")
    parser.add_argument("--output-dir", required=True,
                        help="Directory to write the profile files into (created if missing).")
    return parser


def options_from_args(args: argparse.Namespace) -> ProfilingOptions:
    """Checks every flag; raises SearchInputError with one line."""
    seqs = args.seq_lengths or ([args.seq_length] if args.seq_length else None)
    if not seqs:
        raise SearchInputError("give --seq-length N or --seq-lengths N [N ...]")
    positive = {"--hidden-size": [args.hidden_size], "--num-attention-heads":
                [args.num_attention_heads], "--seq-length(s)": seqs,
                "--micro-batch-sizes": args.micro_batch_sizes,
                "--make-vocab-size-divisible-by": [args.make_vocab_size_divisible_by],
                "--tensor-model-parallel-sizes": args.tensor_model_parallel_sizes,
                "--measure-tensor-parallel-size": [args.measure_tensor_parallel_size],
                "--repeats": [args.repeats]}
    for flag in ("ffn_hidden_size", "vocab_size", "max_position_embeddings"):
        if getattr(args, flag) is not None:
            positive["--" + flag.replace("_", "-")] = [getattr(args, flag)]
    for flag, values in positive.items():
        if any(value <= 0 for value in values):
            raise SearchInputError(f"{flag} must be positive, got {values}")
    if args.warmup < 0:
        raise SearchInputError(f"--warmup must be >= 0, got {args.warmup}")
    if args.hidden_size % args.num_attention_heads and args.kv_channels is None:
        raise SearchInputError(f"--hidden-size {args.hidden_size} is not divisible by "
                               f"--num-attention-heads {args.num_attention_heads}")
    for flag in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(args, flag) < 1.0:
            raise SearchInputError(f"--{flag.replace('_', '-')} must be in [0, 1)")
    max_positions = args.max_position_embeddings or max(seqs)
    if max(seqs) > max_positions:
        raise SearchInputError(f"--seq-length {max(seqs)} exceeds --max-position-embeddings "
                               f"{max_positions}")
    family = families.model_family(args.model)
    vocab = args.vocab_size or family.default_vocab_size
    multiple = args.make_vocab_size_divisible_by
    ffn = args.ffn_hidden_size or families.default_ffn_hidden_size(args)
    def divides(tp: int) -> bool:
        return args.num_attention_heads % tp == 0 and ffn % tp == 0

    measured_tp = args.measure_tensor_parallel_size
    if not divides(measured_tp):
        raise SearchInputError(f"--measure-tensor-parallel-size {measured_tp} does not divide "
                               f"--num-attention-heads {args.num_attention_heads} and the ffn "
                               f"hidden size {ffn}")
    tp_sizes = tuple(sorted({tp for tp in [1, measured_tp, *args.tensor_model_parallel_sizes]
                             if divides(tp)}))
    quick = args.quick
    return ProfilingOptions(
        model=args.model, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=ffn,
        seq_lengths=tuple(sorted(set(seqs))),
        micro_batch_sizes=tuple(sorted(set(args.micro_batch_sizes))),
        dtype="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
        padded_vocab_size=-(-vocab // multiple) * multiple,
        max_position_embeddings=max_positions, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, shape_fields=family.shape_fields(args),
        tp_sizes=tp_sizes, measured_tp_size=measured_tp, warmup=1 if quick else args.warmup,
        repeats=3 if quick else args.repeats)


def main(argv: Optional[Sequence[str]] = None) -> int:
    for message in EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = options_from_args(args)
    except SearchInputError as error:
        parser.error(str(error))
    print(f"profile_model: {options.model} hidden {options.hidden_size} heads "
          f"{options.num_attention_heads} {options.dtype}, seq {list(options.seq_lengths)}, "
          f"micro-batch {list(options.micro_batch_sizes)}", file=sys.stderr, flush=True)
    kernels.import_megatron_core()  # without a GPU: without torch's compiler
    with single_process_megatron(options.model):
        profile = profile_model(options, lambda line: print(line, file=sys.stderr, flush=True))
    for path in write_model_profile_dir(profile, args.output_dir):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
