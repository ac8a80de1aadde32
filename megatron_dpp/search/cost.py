"""What one layout costs: memory per rank (without the simulator) and time per iteration (the
simulator's pipeline time on modeled task durations, plus the data-parallel gradient sync).

Memory of a pipeline rank = model states (memory_model.model_state_bytes over the rank's
parameters: its layers, plus the embedding on the first stage and the output layer on the last)
+ activations. A layout's layers per rank are even, or uneven as Megatron-LM's
--decoder-last-pipeline-num-layers splits them (space.Layout.last_stage_layers): each rank's
parameters, activations, task times (the simulator's rank speed: its layers over the first
rank's) and gradient reductions follow its own layers. The activation term is the bound the schedule keeps on that rank in the simulator's
and the runtime's own accounting: Megatron's in-flight count for the rank (at least V) times one
chunk's activations at the full --seq-length (memory_model.layer_activation_bytes per layer, or
the model profile's measured bytes where it has that length, TP and recompute and the batch is
full-length), which is pipeline.default_budget_bytes (the 'auto' budget
that --use-dpp enforces; 1F1B and interleaved 1F1B hold exactly that). The simulated peak of the
sampled batch never exceeds it and is reported beside it. Plus the embedding's activations per
in-flight microbatch of chunk 0 on the first rank, the output layer's (logits) on the last, and
with full recompute one layer's full activations rebuilt during a backward. With split backwards a
chunk's activations also count the output gradients its W keeps (5h + ffn values per token and
layer).

Time of a task (ms): per layer, forward = compute / TP + two tensor-parallel all-reduces of the
layer's output (sequence parallelism: all-gathers and reduce-scatters of the same bus volume,
Korthikanti et al. 2022); backward = backward compute / TP + two all-reduces (at a TP size the
model profile measured on that many processes, without sequence parallelism: the measured
forward and backward, all-reduces included; likewise the chunk's and the stages' extra work), plus with full
recompute one more forward and with selective recompute the core attention's forward again (the
part of the layer's FLOPs quadratic in the sequence). Compute comes from the model profile
(forward, backward; measured at TP 1) or, without one, from memory_model.layer_forward_flops at
the hardware's matmul rate (backward 2x forward). A split backward's W is half the backward
compute. The first and last rank's extra work (`stage_extras_ms`) is spread over their tasks as
the simulator's rank speed: the model profile's measured embedding (first) and final norm +
output layer + loss (last, / TP), forward and backward; without them only the last rank's output
layer (2 * tokens * hidden * vocab FLOPs, 3x with its backward). Every task also costs the model
profile's measured per-task overhead of Megatron-Core's forward_step / backward_step and its
measured fixed work of a chunk beyond its layers (`task_overhead_ms`: the simulator's
forward_overhead / backward_overhead; 0 for what the profile lacks), so a layout of more, smaller
tasks (interleaved stages, smaller micro-batches) pays for them. Point-to-point messages carry
micro-batch x length x hidden values (/ TP with sequence parallelism) at hardware.p2p_ms. Every
collective and message costs the hardware profile's latency (alpha) plus bytes / bandwidth
(alpha 0 where the profile has none).
Variable sequence lengths: each microbatch is padded to its longest sequence (lengths.py); its
size in the TaskGraph is its forward time over a full-length one's (the attention term makes it
superlinear in the length) and its act_bytes are its own length's.
Packed documents (--packed-document-distribution; lengths.microbatch_documents): every microbatch is
micro-batch full windows of --seq-length tokens, attention per document
(--dataloader-inter-document-masking), so its forward time is the full window's less the part of
its attention the document boundaries cut off: the window's forward minus its attention compute
(the part of the layer's FLOPs quadratic in the length, `LayerFigures.attention_ms`) times
1 - sum of s_i^2 / (micro-batch x seq_length^2) over its document pieces s_i; its size in the
TaskGraph is that over the full window's forward, and its act_bytes are the window's (a function of
the tokens). The backward scales as its forward (pipeline/work.py's segments_work prices the
runtime's microbatches the same way).

Stage placement (space.Layout.placement; everything asks the layout's Placement): on the v
(--dpp-stage-placement v) the TaskGraph carries it, so the simulator runs ZB-V's order (or
dpp:adaptive's spine on it) and sends no message between stages P-1 and P (both on rank P-1); the
activation bound is ZB-V's in-flight count; rank 0 holds the first and the last stage (embedding,
output layer with its own copy of a tied weight, logits, both stages' extra work) and the other
ranks their layers only; the tied embedding needs no all-reduce between stages, and with DP > 1
and tied embeddings the reductions start after the pipeline (no --overlap-grad-reduce, which the
runtime refuses there).

Data-parallel gradient sync (DP > 1; the strategy turns on --overlap-grad-reduce): each chunk's
gradients are all-reduced (with the distributed optimizer reduce-scattered, half the bus volume)
over the DP group (its ranks are TP apart in Megatron's rank order: priced as contiguous with
TP = 1 or inside one node, else at the hardware's non-contiguous figure), starting once that
chunk and every later chunk ran their last backward (W with split backwards), in the order
V-1..0, one at a time (runtime/grad_sync.py); under Megatron's own schedules chunk 0's buckets
(Megatron-Core's default size) start during its last backward, as DDP's hooks launch them. Compute that overlaps a reduction runs
hardware.overlap_coefficient times slower. The distributed optimizer then
all-gathers the updated parameters (half an all-reduce of the parameter bytes), exposed, and with
tied embeddings on several stages the word embedding's gradient is all-reduced between the first
and the last stage, exposed. Then the optimizer step, exposed: the model profile's measured ms per
parameter times the fullest rank's parameters (/ DP with the distributed optimizer; 0 without that
figure). Not modelled: stragglers between data-parallel replicas.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from megatron_dpp.models.families import MODEL_FAMILIES
from megatron_dpp.pipeline import Phase, TaskGraph, megatron_inflight_forwards
from megatron_dpp.pipeline.placement import INTERLEAVED
from megatron_dpp.search import memory_model
from megatron_dpp.search.errors import SearchInputError
from megatron_dpp.search.hardware import HardwareProfile
from megatron_dpp.search.lengths import LengthDistribution, microbatch_documents, microbatch_lengths
from megatron_dpp.search.model_profile import CHUNK_PARTS, MB, STAGE_EXTRA_PARTS, ModelProfile
from megatron_dpp.search.space import Layout
from megatron_dpp.sim import CommModel, DurationModel, SimResult, simulate

# Bytes of a reduced gradient element: fp32 main gradients whatever the dtype (grad_reduce_in_fp32,
# as megatron_dpp.training.config sets it; memory_model.model_state_bytes counts them so; the
# search does not model --grad-reduce-in-bf16's bf16 gradients).
GRAD_BYTES = memory_model.FP32_BYTES
# The output layer's forward + backward over its forward (logits matmul, then two for its backward).
OUTPUT_WORK_RATIO = 3.0
# Megatron-Core DDP's default bucket with --overlap-grad-reduce: max(40M, 1M x DP) parameters.
DDP_BUCKET_PARAMS, DDP_BUCKET_PARAMS_PER_DP_RANK = 40_000_000, 1_000_000
# Layer type of the transformer layer in Galvatron's profile files (GPT and BERT have one type).
TRANSFORMER_LAYER_TYPE = 0
# Without a model profile: backward compute = this x forward compute (two matmuls per forward one).
BACKWARD_FLOPS_RATIO = 2.0
# Extrapolation (`Pricer.simulated_counts`, `Pricer.price`): the longer of the two simulated runs
# has this many times P microbatches, and at least the minimum; equal-length batches, then
# variable-length ones.
SIM_UNIFORM_PERIODS, SIM_UNIFORM_MIN = 3, 12
SIM_VARIABLE_PERIODS, SIM_VARIABLE_MIN = 4, 48


@dataclasses.dataclass(frozen=True)
class Problem:
    """Everything a search prices layouts against (fixed across layouts)."""

    shape: memory_model.ModelShape
    global_batch_size: int
    hardware: HardwareProfile
    memory_budget_bytes: int  # per GPU
    model_profile: Optional[ModelProfile] = None  # measured layer times; None: analytical
    lengths: Optional[LengthDistribution] = None  # --variable-seq-lengths; None: all seq_length
    # --packed-document-distribution: full windows packed from these documents, attention per
    # document; None: no packing (excludes `lengths`).
    packed: Optional[LengthDistribution] = None
    on_gpus: bool = True  # False: the job runs on CPU processes (space.SpaceInputs.on_gpus)

    def __post_init__(self):
        if self.lengths is not None and self.packed is not None:
            raise SearchInputError("variable sequence lengths and packed documents exclude each "
                                   "other: a packed microbatch is full windows")

    @property
    def dtype_bytes(self) -> int:
        return memory_model.ELEMENT_BYTES[self.shape.dtype]

    @property
    def unequal_microbatches(self) -> bool:
        """Do the microbatches of a batch differ in size (variable lengths or packed documents)?"""
        return self.lengths is not None or self.packed is not None


@dataclasses.dataclass(frozen=True)
class LayerFigures:
    """One transformer layer at one (micro-batch, length, TP, SP, recompute)."""

    forward_ms: float  # compute / TP + tensor-parallel communication
    backward_ms: float  # the same for the backward, recompute included
    weight_grad_ms: float  # the part of backward_ms that a split backward's W runs
    activation_bytes: int  # kept for the backward (memory_model.layer_activation_bytes)
    weight_grad_bytes: int  # kept from B to W with split backwards: the linears' output gradients
    attention_ms: float = 0.0  # the part of forward_ms's compute quadratic in the length (core attention)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A layout priced without the simulator."""

    layout: Layout
    memory_bytes: int  # the fullest rank (exact: see the module docstring)
    time_lower_ms: float  # no schedule can run an iteration faster


@dataclasses.dataclass(frozen=True)
class LayoutCost:
    """A layout priced with the simulator."""

    layout: Layout
    time_ms: float  # predicted time per iteration
    pipeline_ms: float  # the simulated pipeline makespan (extrapolated to all microbatches)
    grad_sync_exposed_ms: float  # the gradient sync left after the pipeline
    optimizer_ms: float  # the optimizer step after it (time_ms = pipeline + grad sync + this)
    memory_bytes: int  # the fullest rank
    activation_peak_bytes: int  # the simulated peak of the sampled batch, fullest rank
    bubble_fraction: float  # 1 - mean rank work / pipeline_ms
    simulated_microbatches: int  # microbatches simulated (all of them, or the long extrapolation run)
    time_lower_ms: float  # the estimate's bound, for the pruning's record
    messages_per_microbatch: int = 0  # each way (Pricer.messages_per_microbatch)


class Pricer:
    """Prices layouts of one Problem; caches the parts layouts share."""

    def __init__(self, problem: Problem, extrapolate: bool = True):
        self.problem = problem
        self.extrapolate = extrapolate  # False: simulate every microbatch of every layout
        self._layers: dict = {}
        self._states: dict = {}
        self._counts: dict = {}
        self._lengths: dict = {}
        self._documents: dict = {}
        self._durations: dict = {}
        self._syncs: dict = {}
        self._sims: dict = {}
        self._estimates: dict = {}  # (memory, pipeline bound) per layout up to its schedule
        self.simulations = 0  # simulator runs so far (cache hits excluded)

    # --- per layer ----------------------------------------------------------------------------
    def layer(self, micro_batch: int, length: int, tp: int, sp: bool, recompute: str) -> LayerFigures:
        key = (micro_batch, length, tp, sp, recompute)
        figures = self._layers.get(key)
        if figures is None:
            figures = self._layers[key] = self._layer(*key)
        return figures

    def _layer(self, micro_batch, length, tp, sp, recompute) -> LayerFigures:
        problem, shape = self.problem, self.problem.shape
        at_length = dataclasses.replace(shape, seq_length=length)
        flops = memory_model.layer_forward_flops(at_length, micro_batch)
        # The part of the FLOPs quadratic in the length (core attention), from f(2s) - 2 f(s) =
        # 2 q s^2 for f(s) = l s + q s^2: selective recompute runs it again.
        doubled = dataclasses.replace(shape, seq_length=2 * length)
        attention_share = max(0.0, (memory_model.layer_forward_flops(doubled, micro_batch) - 2 * flops)
                              / 2.0) / flops
        message = micro_batch * length * shape.hidden_size * problem.dtype_bytes
        tp_comm = 2 * problem.hardware.allreduce_ms(message, tp, True)
        measured_at_tp = self._measured_at_tp(tp, sp, "forward", micro_batch, length)
        if measured_at_tp is not None:
            # Measured on tp processes running the layer together: its all-reduces are in it
            # (the modelled ones, at most the measured time, are only split out of it).
            measured_backward = self._measured_at_tp(tp, sp, "backward", micro_batch, length)
            tp_comm = min(tp_comm, measured_at_tp, measured_backward)
            forward, backward = measured_at_tp - tp_comm, measured_backward - tp_comm
        elif problem.model_profile is not None:
            forward = problem.model_profile.layer_forward_ms(TRANSFORMER_LAYER_TYPE, micro_batch, length) / tp
            backward = problem.model_profile.layer_backward_ms(TRANSFORMER_LAYER_TYPE, micro_batch, length) / tp
        else:
            forward = problem.hardware.matmul_ms(flops / tp, shape.dtype)
            backward = BACKWARD_FLOPS_RATIO * forward
        attention = attention_share * forward
        recomputed = {"none": 0.0, "selective": attention, "full": forward + tp_comm}
        kept_for_w = micro_batch * length * (5 * shape.hidden_size + shape.ffn_hidden_size) // tp
        activation = self._profiled_activation(micro_batch, length, tp, sp, recompute)
        if activation is None:
            activation = memory_model.layer_activation_bytes(at_length, micro_batch, tp, sp, recompute)
        return LayerFigures(
            forward_ms=forward + tp_comm,
            backward_ms=backward + tp_comm + recomputed[recompute],
            weight_grad_ms=backward / 2.0,
            activation_bytes=activation,
            weight_grad_bytes=kept_for_w * problem.dtype_bytes,
            attention_ms=attention,
        )

    def _measured_at_tp(self, tp: int, sp: bool, part: str, micro_batch: int,
                        length: int) -> Optional[float]:
        """The model profile's `part` measured on tp processes (tensor_parallel_ms), without
        sequence parallelism (which it cannot measure here); None otherwise."""
        profile = self.problem.model_profile
        if profile is None or tp == 1 or sp:
            return None
        return profile.tensor_parallel(tp, part, micro_batch, length)

    def _profiled_activation(self, micro_batch, length, tp, sp, recompute) -> int | None:
        """The model profile's measured activation bytes of one layer, when it has this length,
        TP and recompute and the batch is all full-length (a variable-length batch takes every
        length from memory_model, so that its microbatches compare); else None."""
        profile = self.problem.model_profile
        if profile is None or self.problem.lengths is not None:
            return None
        memory = profile.memory.layers.get((TRANSFORMER_LAYER_TYPE, sp, length))
        if memory is None:
            return None
        per_sample = {"none": memory.activation_mb_per_sample.get(tp),
                      "selective": memory.selective_mb_per_sample.get(tp),
                      "full": memory.checkpoint_mb_per_sample}[recompute]
        return None if per_sample is None else int(per_sample * MB * micro_batch)

    def output_forward_ms(self, micro_batch: int, length: int, tp: int) -> float:
        """The output layer's logits matmul: 2 * tokens * hidden * vocab FLOPs over TP."""
        shape = self.problem.shape
        flops = 2.0 * micro_batch * length * shape.hidden_size * shape.padded_vocab_size / tp
        return self.problem.hardware.matmul_ms(flops, shape.dtype)

    # --- parameters and memory ----------------------------------------------------------------
    def rank_layers(self, layout: Layout) -> tuple[int, int]:
        """Transformer layers of (the first, the last) pipeline rank. The middle ranks of an
        uneven split (space.Layout.last_stage_layers) hold the first's and no embedding."""
        counts = layout.rank_layers(self.problem.shape.num_layers)
        return counts[0], counts[-1]

    def rank_parameters(self, layout: Layout) -> tuple[int, int]:
        """Parameters of (the first, the last) pipeline rank (one TP shard). One stage holds a
        tied output weight once; the last of several keeps its own copy (memory_model), on its
        rank: the last rank, or on the v the first (which then holds both copies)."""
        shape, tp = self.problem.shape, layout.tp
        per_layer = memory_model.layer_parameter_count(shape, tp)
        first_layers, last_layers = self.rank_layers(layout)
        embedding, output = self._extra_parameters(tp)
        if layout.pp == 1:
            shared = shape.padded_vocab_size // tp * shape.hidden_size if self.tied() else 0
            return (first_layers * per_layer + embedding + output - shared,) * 2
        if self.loss_on_first_rank(layout):
            return first_layers * per_layer + embedding + output, last_layers * per_layer
        return first_layers * per_layer + embedding, last_layers * per_layer + output

    @staticmethod
    def end_ranks(layout: Layout) -> tuple[int, int]:
        """The ranks of the first stage (the embedding) and of the last stage (the loss)."""
        placement = layout.stage_placement()
        return (placement.location(placement.first_stage)[0],
                placement.location(placement.last_stage)[0])

    def loss_on_first_rank(self, layout: Layout) -> bool:
        """Are the first and the last stage on one rank (one stage, or the v placement)?"""
        first, last = self.end_ranks(layout)
        return first == last

    def kind_ranks(self, layout: Layout) -> tuple[int, tuple[int, ...]]:
        """The ranks the two rank kinds of rank_parameters stand for: the first stage's rank,
        and the last stage's, or where that is the first's too (the v) every other rank (they
        all hold just their layers)."""
        first, last = self.end_ranks(layout)
        if first != last or layout.pp == 1:
            return first, (last,)
        return first, tuple(rank for rank in range(layout.pp) if rank != first)

    @staticmethod
    def messages_per_microbatch(layout: Layout) -> int:
        """Point-to-point messages one microbatch's forward sends (its backward as many back):
        one per hop between neighbouring stages on different ranks."""
        placement = layout.stage_placement()
        return sum(1 for stage in range(placement.last_stage) if not placement.next_on_same_rank(stage))

    def overlaps_grad_reduce(self, layout: Layout) -> bool:
        """Does the layout run --overlap-grad-reduce (DP > 1)? Not the v with tied embeddings:
        it sums the two copies on rank 0 before the data-parallel reduction, which the runtime's
        flag check refuses to start during the backward (runtime/flags.py)."""
        return layout.dp > 1 and not (self.loss_on_first_rank(layout) and layout.pp > 1 and self.tied())

    def tied(self) -> bool:
        """Output weights tied to the word embedding (some models always tie them)."""
        shape = self.problem.shape
        return MODEL_FAMILIES[shape.model].ties_output(shape.untie_embeddings_and_output_weights)

    def embedding_sync_ms(self, layout: Layout) -> float:
        """Tied weights on several stages: after the data-parallel sync, Megatron all-reduces the
        word embedding's gradient between the first and the last stage (finalize_model_grads),
        exposed; the two are far apart in the rank order (Galvatron's non-contiguous pair). On
        one rank (one stage, or the v) the copies are summed in place: no message."""
        if self.loss_on_first_rank(layout) or not self.tied():
            return 0.0
        shape = self.problem.shape
        count = shape.padded_vocab_size // layout.tp * shape.hidden_size
        return self.problem.hardware.allreduce_ms(count * GRAD_BYTES, 2, False)

    def optimizer_ms(self, layout: Layout) -> float:
        """The optimizer step, exposed after the gradient sync: the model profile's measured ms
        per parameter times the fullest rank's parameters (over DP with the distributed
        optimizer, which steps only its shard); 0 without that figure."""
        profile = self.problem.model_profile
        if profile is None or profile.optimizer_ms_per_parameter is None:
            return 0.0
        params = max(self.rank_parameters(layout))
        if layout.distributed_optimizer:
            params = -(-params // layout.dp)
        return profile.optimizer_ms_per_parameter * params

    def _extra_parameters(self, tp: int) -> tuple[int, int]:
        """(embedding, output layer) parameters of one TP shard."""
        shape = self.problem.shape
        return (memory_model.embedding_parameter_count(shape, tp),
                memory_model.output_parameter_count(shape, tp))

    def state_bytes(self, layout: Layout) -> tuple[int, int]:
        """Model states of (the first, the last) pipeline rank."""
        key = (layout.tp, layout.pp, layout.dp, layout.distributed_optimizer,
               layout.last_stage_layers, layout.placement)
        if key not in self._states:
            dtype = self.problem.shape.dtype
            self._states[key] = tuple(
                memory_model.model_state_bytes(count, dtype, layout.dp, layout.distributed_optimizer)
                for count in self.rank_parameters(layout))
        return self._states[key]

    def inflight(self, layout: Layout) -> tuple[int, int]:
        """Chunk activations the schedule bounds (the two rank kinds of kind_ranks, the most of
        the second's ranks): the in-flight count of the placement's reference order (Megatron's,
        ZB-V's on the v), at least V (pipeline.default_budget_bytes)."""
        key = (layout.pp, layout.vpp, layout.num_microbatches, layout.placement,
               layout.split_backward and layout.placement != INTERLEAVED)
        if key not in self._counts:
            graph = TaskGraph(layout.pp, layout.vpp, layout.num_microbatches,
                              split_backward=key[-1], placement=layout.stage_placement())
            first, others = self.kind_ranks(layout)
            self._counts[key] = tuple(max(max(megatron_inflight_forwards(graph, rank) for rank in ranks),
                                          layout.vpp)
                                      for ranks in ((first,), others))
        return self._counts[key]

    def chunk_activation_bytes(self, layout: Layout, length: int, layers: Optional[int] = None) -> int:
        """What one forward of one microbatch of padded `length` holds on one chunk of `layers`
        layers until it is released (its B; its W with split backwards). Without `layers`, the
        fullest chunk's: the bytes the simulator and the --use-dpp runtime size every rank's
        budget by (models/memory_model.chunk_activation_bytes)."""
        figures = self.layer(layout.micro_batch_size, length, layout.tp, layout.sequence_parallel,
                             layout.recompute)
        per_layer = figures.activation_bytes + (figures.weight_grad_bytes if layout.split_backward else 0)
        if layers is None:
            layers = max(self.rank_layers(layout)) // layout.vpp
        return layers * per_layer

    def memory_bytes(self, layout: Layout) -> int:
        """The fullest rank's bytes (the two rank kinds of kind_ranks: on the interleaved
        placement the middle ones hold no more activations than the first and no embedding)."""
        shape, mbs, tp, sp = self.problem.shape, layout.micro_batch_size, layout.tp, layout.sequence_parallel
        first_states, last_states = self.state_bytes(layout)
        first_count, last_count = self.inflight(layout)
        first_chunk, last_chunk = (self.chunk_activation_bytes(layout, shape.seq_length, layers // layout.vpp)
                                   for layers in self.rank_layers(layout))
        transient = 0
        if layout.recompute == "full":
            transient = self.layer(mbs, shape.seq_length, tp, sp, "none").activation_bytes
        embedding = memory_model.embedding_activation_bytes(shape, mbs, tp, sp) * math.ceil(first_count / layout.vpp)
        output = memory_model.output_activation_bytes(shape, mbs, tp, sp)
        first = first_states + first_count * first_chunk + embedding + transient
        last = last_states + last_count * last_chunk + transient
        if self.loss_on_first_rank(layout):  # one stage, or the v: the logits on the first rank
            return max(first + output, last)
        return max(first, last + output)

    # --- time ---------------------------------------------------------------------------------
    def lengths(self, layout: Layout) -> list[int]:
        key = (layout.num_microbatches, layout.micro_batch_size)
        if key not in self._lengths:
            self._lengths[key] = microbatch_lengths(self.problem.lengths, layout.num_microbatches,
                                                    layout.micro_batch_size, self.problem.shape.seq_length)
        return self._lengths[key]

    def documents(self, layout: Layout) -> list[tuple[int, ...]]:
        """--packed-document-distribution: each microbatch's document pieces (its attention
        segments; lengths.microbatch_documents, one seeded batch per micro-batch size and count)."""
        key = (layout.num_microbatches, layout.micro_batch_size)
        if key not in self._documents:
            self._documents[key] = microbatch_documents(self.problem.packed, layout.num_microbatches,
                                                        layout.micro_batch_size,
                                                        self.problem.shape.seq_length)
        return self._documents[key]

    @staticmethod
    def packed_size(full: LayerFigures, segments, micro_batch: int, window: int) -> float:
        """A packed microbatch's forward over a full window's (module docstring): the window's
        forward less the attention the document boundaries cut off."""
        pairs = math.fsum(float(s) * s for s in segments) / (micro_batch * float(window) ** 2)
        return 1.0 - full.attention_ms * (1.0 - pairs) / full.forward_ms

    def durations(self, layout: Layout) -> tuple[DurationModel, list[float]]:
        """The simulator's duration model (in ms) and the microbatch sizes (forward time of a
        microbatch / that of a full-length one)."""
        key = (layout.tp, layout.pp, layout.micro_batch_size, layout.num_microbatches,
               layout.sequence_parallel, layout.recompute, layout.split_backward,
               layout.last_stage_layers, layout.placement)
        if key not in self._durations:
            self._durations[key] = self._duration_model(layout)
        return self._durations[key]

    def _duration_model(self, layout: Layout) -> tuple[DurationModel, list[float]]:
        shape = self.problem.shape
        rank_layers = layout.rank_layers(shape.num_layers)
        per_rank = rank_layers[0]
        full = self.layer(layout.micro_batch_size, shape.seq_length, layout.tp, layout.sequence_parallel,
                          layout.recompute)
        forward = per_rank * full.forward_ms
        layers_work = forward + per_rank * full.backward_ms
        # Each rank's layers over the first's, and the first and the last stage's extra work
        # spread over their tasks, as the simulator's rank speed (with one stage, or on the v,
        # both are on one rank).
        first, last = self.stage_extras_ms(layout.micro_batch_size, shape.seq_length, layout.tp)
        first_rank, last_rank = self.end_ranks(layout)
        speed = [layers / per_rank for layers in rank_layers]
        speed[first_rank] += first / layers_work
        speed[last_rank] += last / layers_work
        if self.problem.packed is not None:
            sizes = [self.packed_size(full, segments, layout.micro_batch_size, shape.seq_length)
                     for segments in self.documents(layout)]
        else:
            size_of = {length: self.layer(layout.micro_batch_size, length, layout.tp,
                                          layout.sequence_parallel, layout.recompute).forward_ms
                       / full.forward_ms for length in set(self.lengths(layout))}
            sizes = [size_of[length] for length in self.lengths(layout)]
        overhead = self.task_overhead_ms(layout.micro_batch_size, shape.seq_length, layout.tp,
                                         layout.sequence_parallel)
        model = DurationModel(
            linear=forward, backward_ratio=full.backward_ms / full.forward_ms, rank_speed=tuple(speed),
            forward_overhead=overhead[0], backward_overhead=overhead[1],
            weight_grad_fraction=full.weight_grad_ms / full.backward_ms if layout.split_backward
            else DurationModel.weight_grad_fraction)
        return model, sizes

    def task_overhead_ms(self, micro_batch: int, length: int, tp: int = 1,
                         sp: bool = False) -> tuple[float, float]:
        """(forward, backward) ms every task costs besides its layers: the model profile's
        measured forward_step / backward_step overhead of Megatron-Core's schedules plus its
        measured fixed work of a chunk (a one-layer block's time less the layer's; measured at
        this tp where the profile has it), at this micro-batch and length; 0 for what the
        profile lacks."""
        profile = self.problem.model_profile
        if profile is None:
            return 0.0, 0.0
        steps = profile.task_overhead_ms or (0.0, 0.0)
        chunk = []
        for part in CHUNK_PARTS:
            at_tp = self._measured_at_tp(tp, sp, part, micro_batch, length)
            chunk.append(at_tp if at_tp is not None else
                         profile.stage_extra(part, micro_batch, length) or 0.0)
        return steps[0] + chunk[0], steps[1] + chunk[1]

    def stage_extras_ms(self, micro_batch: int, length: int, tp: int) -> tuple[float, float]:
        """(first, last) stage's work besides its layers per microbatch, forward + backward: the
        model profile's measured embedding and final norm + output layer + loss (measured at
        this TP where the profile has it, else tp = 1's with the latter over TP, as its logits
        are split), or without them no embedding cost and the analytical logits matmul
        (`output_forward_ms`, OUTPUT_WORK_RATIO with its backward)."""
        profile = self.problem.model_profile

        def per_stage(time_of) -> tuple[float, float]:  # time_of(part) -> ms
            return tuple(sum(time_of(f"{stage}_{phase}") for phase in ("forward", "backward"))
                         for stage in ("first", "last"))

        if self._measured_at_tp(tp, False, "first_forward", micro_batch, length) is not None:
            # Measured on tp processes: the vocabulary-parallel all-reduces are in it.
            return per_stage(lambda part: self._measured_at_tp(tp, False, part, micro_batch, length))
        if profile is not None and all(part in profile.stage_extra_ms for part in STAGE_EXTRA_PARTS):
            first, last = per_stage(lambda part: profile.stage_extra(part, micro_batch, length))
            return first, last / tp
        return 0.0, OUTPUT_WORK_RATIO * self.output_forward_ms(micro_batch, length, tp)

    def comm_model(self, layout: Layout) -> CommModel:
        """The simulator prices a message as latency + act_bytes / bandwidth: the hardware's p2p
        latency, and the bandwidth scaled so that a full-length microbatch's act_bytes take as
        long as its real message."""
        shape = self.problem.shape
        message = layout.micro_batch_size * shape.seq_length * shape.hidden_size * self.problem.dtype_bytes
        if layout.sequence_parallel:
            message //= layout.tp
        ms = self.problem.hardware.p2p_ms(message, layout.pp)
        if ms <= 0.0:
            return CommModel()
        latency = self.problem.hardware.p2p_latency(layout.pp)
        if ms <= latency:
            return CommModel(latency=latency)
        return CommModel(latency=latency,
                         bandwidth=self.chunk_activation_bytes(layout, shape.seq_length) / (ms - latency))

    def pipeline_lower_bound(self, layout: Layout, model: DurationModel, sizes: list[float],
                             hop: float) -> float:
        """simulator's TaskDurations.pipeline_bound for these durations, in closed form: for each
        rank r its work, and after rank 0's some microbatch's chunk-0 forward through ranks
        0..r-1 (fill), F and B work, and its chunk-0 backward back through them (drain)."""
        P, V = layout.pp, layout.vpp
        forward, backward = model.linear, model.linear * model.backward_ratio
        total, smallest = math.fsum(sizes), min(sizes)
        w = model.weight_grad_fraction if layout.split_backward else 0.0
        tasks = V * len(sizes)  # forwards (and backwards, and Ws) per rank
        overheads = tasks * (model.forward_overhead + model.backward_overhead * (2 if w else 1))
        crossing_overheads = tasks * (model.forward_overhead + model.backward_overhead)
        speed = model.rank_speed
        work = [(forward + backward) * total * speed[r] + overheads for r in range(P)]
        placement = layout.stage_placement()
        best, fill, drain = work[0], 0.0, 0.0
        if w:  # the crossing ends with rank 0's chunk-0 W of that microbatch
            drain = backward * w / V * smallest * speed[0] + model.backward_overhead
        for r in range(1, P):
            # Chunk 0 of rank r-1 hands to chunk 0 of rank r (both placements), by message
            # unless the two stages share a rank.
            message = 0.0 if placement.next_on_same_rank(placement.stage(r - 1, 0)) else hop
            fill += forward / V * smallest * speed[r - 1] + model.forward_overhead + message
            drain += backward * (1 - w) / V * smallest * speed[r - 1] + model.backward_overhead + message
            crossing = (forward + backward * (1 - w)) * total * speed[r] + crossing_overheads
            best = max(best, fill + max(crossing + drain, work[r]))
        return best

    def sync_ms(self, layout: Layout) -> tuple[list[list[float]], list[float]]:
        """(per rank kind (first, last): each chunk's gradient reduction, ms; per rank kind: the
        distributed optimizer's exposed parameter all-gather, ms). Zero with DP 1."""
        dp, tp, V = layout.dp, layout.tp, layout.vpp
        if dp == 1:
            return [[0.0] * V, [0.0] * V], [0.0, 0.0]
        key = (dp, tp, layout.pp, V, layout.distributed_optimizer, layout.last_stage_layers,
               layout.placement)
        if key not in self._syncs:
            self._syncs[key] = self._sync_ms(layout)
        return self._syncs[key]

    def _sync_ms(self, layout: Layout) -> tuple[list[list[float]], list[float]]:
        dp, tp, V = layout.dp, layout.tp, layout.vpp
        shape, hardware = self.problem.shape, self.problem.hardware
        per_layer = memory_model.layer_parameter_count(shape, tp)
        # Megatron's data-parallel groups are TP apart inside a block of TP * DP ranks: contiguous
        # with TP 1 or inside one node; else Galvatron's non-contiguous figure (one rank per node
        # and group at most: never faster than Megatron's groups).
        contiguous = tp == 1 or tp * dp <= hardware.gpus_per_node
        reduce_share = 0.5 if layout.distributed_optimizer else 1.0
        chunks, gathers = [], []
        for kind, (total, layers) in enumerate(zip(self.rank_parameters(layout),
                                                   self.rank_layers(layout))):
            layer_params = layers // V * per_layer
            params = [a + b for a, b in zip([layer_params] * V,
                                            self._chunk_extras(layout, kind, total - V * layer_params))]
            chunks.append([reduce_share * hardware.allreduce_ms(count * GRAD_BYTES, dp, contiguous)
                           for count in params])
            gathers.append(0.5 * hardware.allreduce_ms(sum(params) * self.problem.dtype_bytes, dp, contiguous)
                           if layout.distributed_optimizer else 0.0)
        return chunks, gathers

    def _chunk_extras(self, layout: Layout, kind: int, extra: int) -> list[int]:
        """A rank kind's parameters besides its layers (`extra`) per chunk: the embedding in the
        first stage's chunk, the output layer in the last stage's; on the v rank 0 holds both."""
        placement = layout.stage_placement()
        rank = self.kind_ranks(layout)[0] if kind == 0 else self.kind_ranks(layout)[1][0]
        first_chunk = placement.local_chunk(rank, placement.first_stage)
        last_chunk = placement.local_chunk(rank, placement.last_stage)
        chunks = [0] * layout.vpp
        if first_chunk is not None and last_chunk is not None and first_chunk != last_chunk:
            output = self._extra_parameters(layout.tp)[1]
            chunks[first_chunk], chunks[last_chunk] = extra - output, output
        elif extra:
            chunks[first_chunk if first_chunk is not None else last_chunk] = extra
        return chunks

    def estimate(self, layout: Layout) -> Estimate:
        # Memory and the pipeline bound do not depend on which schedule runs the tasks (only on
        # whether backwards are split): the layouts that differ only in it share them.
        key = (layout.tp, layout.pp, layout.vpp, layout.dp, layout.micro_batch_size,
               layout.num_microbatches, layout.recompute, layout.distributed_optimizer,
               layout.sequence_parallel, layout.split_backward, layout.last_stage_layers,
               layout.placement)
        shared = self._estimates.get(key)
        if shared is None:
            shared = self._estimates[key] = (self.memory_bytes(layout),
                                             self.pipeline_bound_ms(layout))
        memory, pipeline_bound = shared
        chunks, gathers = self.sync_ms(layout)
        # The first rank's last bucket of chunk 0 is ready only when the pipeline's drain ends.
        last_bucket = chunks[0][0] / self.bucket_count(layout, 0)
        bound = (pipeline_bound + last_bucket + gathers[0]
                 + self.embedding_sync_ms(layout) + self.optimizer_ms(layout))
        return Estimate(layout, memory, bound)

    # --- the simulator ------------------------------------------------------------------------
    def graph(self, layout: Layout, count: int) -> tuple[TaskGraph, DurationModel]:
        """The first `count` microbatches of the layout's batch as a TaskGraph."""
        model, sizes = self.durations(layout)
        lengths = self.lengths(layout)[:count]
        act = [self.chunk_activation_bytes(layout, length) for length in lengths]
        graph = TaskGraph(layout.pp, layout.vpp, count, sizes[:count], act,
                          max_act_bytes=self.chunk_activation_bytes(layout, self.problem.shape.seq_length),
                          split_backward=layout.split_backward, placement=layout.stage_placement())
        return graph, model

    def simulate(self, layout: Layout, count: int) -> SimResult:
        graph, model = self.graph(layout, count)
        comm = self.comm_model(layout)
        key = (layout.pp, layout.vpp, count, layout.schedule, layout.split_backward, model, comm,
               tuple(graph.sizes), tuple(graph.act_bytes), graph.max_act_bytes, layout.placement)
        if key not in self._sims:
            self.simulations += 1
            self._sims[key] = simulate(graph, layout.schedule, model, comm)
        return self._sims[key]

    def simulated_counts(self, layout: Layout) -> tuple[int, int] | None:
        """(M1, M2): the microbatch counts `price` simulates to extrapolate, or None to simulate
        all M. Multiples of P (interleaved orders need them); uniform batches reach their steady
        state within a few P, variable ones need more microbatches to average their sizes."""
        P, M = layout.pp, layout.num_microbatches
        periods, minimum = (SIM_VARIABLE_PERIODS, SIM_VARIABLE_MIN) if self.problem.unequal_microbatches else (
            SIM_UNIFORM_PERIODS, SIM_UNIFORM_MIN)
        long_count = max(periods * P, -(-minimum // P) * P)
        if not self.extrapolate or M <= long_count + P:
            return None
        return long_count, max(P, long_count // 2 // P * P)

    def price(self, layout: Layout, estimate: Estimate) -> LayoutCost:
        """Simulate the layout's pipeline. Long pipelines (see `simulated_counts`) are simulated on
        their first M1 and M2 < M1 microbatches and extrapolated to M: the makespan is the
        pipeline bound B (closed form, `pipeline_lower_bound`, exact for any M) plus an excess
        E = T - B, taken linear in the busiest rank's work W through the two runs, with a slope
        between 0 (a fixed excess: fill and drain effects, as 1F1B on equal microbatches) and
        E(M1) / W(M1) (an excess proportional to the work: stalls in every steady-state period,
        as static orders on unequal microbatches). The gradient sync's tail after the pipeline is
        taken from the M1 run's timeline (it only depends on the drain)."""
        M = layout.num_microbatches
        model, sizes = self.durations(layout)
        counts = self.simulated_counts(layout)
        result = self.simulate(layout, M if counts is None else counts[0])
        pipeline = result.makespan
        if counts is not None:
            short = self.simulate(layout, counts[1])
            work = [self._work(layout, model, sizes[:n], max(model.rank_speed)) for n in (M, *counts)]
            excess = [result.makespan - result.pipeline_bound, short.makespan - short.pipeline_bound]
            slope = (excess[0] - excess[1]) / (work[1] - work[2]) if work[1] > work[2] else 0.0
            slope = min(max(slope, 0.0), max(excess[0], 0.0) / work[1])
            bound = self.pipeline_bound_ms(layout)
            pipeline = bound + excess[0] + slope * (work[0] - work[1])
        tail = self._sync_tail(layout, result) + self.embedding_sync_ms(layout)
        mean_work = self._work(layout, model, sizes, math.fsum(model.rank_speed) / layout.pp)
        optimizer = self.optimizer_ms(layout)
        time_ms = pipeline + tail + optimizer
        return LayoutCost(
            layout=layout, time_ms=time_ms, pipeline_ms=pipeline, grad_sync_exposed_ms=tail,
            optimizer_ms=optimizer,
            memory_bytes=estimate.memory_bytes, activation_peak_bytes=self.activation_peak(layout, result),
            bubble_fraction=max(0.0, 1.0 - mean_work / pipeline),
            simulated_microbatches=M if counts is None else counts[0], time_lower_ms=estimate.time_lower_ms,
            messages_per_microbatch=self.messages_per_microbatch(layout))

    def activation_peak(self, layout: Layout, result: SimResult) -> int:
        """The simulated peak of activation bytes, fullest rank. The simulator sizes every rank's
        microbatches by the fullest chunk (as the --use-dpp runtime budgets them); a rank of an
        uneven split with fewer layers holds that many fewer bytes per microbatch."""
        counts = layout.rank_layers(self.problem.shape.num_layers)
        fullest = max(counts)
        return max(peak * layers // fullest for peak, layers in zip(result.peak_bytes, counts))

    def pipeline_bound_ms(self, layout: Layout) -> float:
        """The simulator's pipeline bound of the layout's whole batch (all M microbatches)."""
        model, sizes = self.durations(layout)
        comm = self.comm_model(layout)
        hop = 0.0 if layout.pp == 1 else comm.transfer_time(
            min(self.chunk_activation_bytes(layout, length) for length in set(self.lengths(layout))))
        return self.pipeline_lower_bound(layout, model, sizes, hop)

    @staticmethod
    def _work(layout: Layout, model: DurationModel, sizes: list[float], speed: float) -> float:
        """A rank's work on these microbatches at this rank speed, its per-task overheads included."""
        backwards = 2 if layout.split_backward else 1  # B and W tasks each pay the overhead
        overheads = layout.vpp * len(sizes) * (model.forward_overhead + backwards * model.backward_overhead)
        return (1 + model.backward_ratio) * model.linear * math.fsum(sizes) * speed + overheads

    def _sync_tail(self, layout: Layout, result: SimResult) -> float:
        """How long the iteration runs past the pipeline's makespan for the gradient sync (see the
        module docstring), over the ranks of the two rank kinds (the ones with the most
        parameters)."""
        if layout.dp == 1:
            return 0.0
        chunks, gathers = self.sync_ms(layout)
        V = layout.vpp
        release = Phase.W if layout.split_backward else Phase.B
        first_rank, other_ranks = self.kind_ranks(layout)
        ranks = {rank: 1 for rank in other_ranks}
        ranks[first_rank] = 0  # rank -> its kind in sync_ms
        during_backward = self.overlaps_grad_reduce(layout)
        last_task = {rank: [(0.0, 0.0)] * V for rank in ranks}  # (start, end) of the last release
        busy = {rank: [] for rank in ranks}
        end = {rank: 0.0 for rank in ranks}
        for rank, task, start, stop in result.timeline:
            if rank not in ranks:
                continue
            busy[rank].append((start, stop))
            end[rank] = max(end[rank], stop)
            if task.phase == release and stop > last_task[rank][task.chunk][1]:
                last_task[rank][task.chunk] = (start, stop)
        coefficient = self.problem.hardware.overlap_coefficient
        finish = 0.0
        for rank, kind in ranks.items():
            clock, ready, windows = 0.0, 0.0, []
            for chunk in reversed(range(V)):  # V-1 first; a chunk waits for every later one
                # Without --overlap-grad-reduce finalize_model_grads reduces after the rank's pipeline.
                first, last = last_task[rank][chunk] if during_backward else (end[rank], end[rank])
                buckets = self.bucket_count(layout, kind) if chunk == 0 else 1
                for bucket in range(buckets):  # bucket k's layers are done k+1 buckets into the task
                    ready = max(ready, last - (last - first) * (buckets - 1 - bucket) / buckets)
                    start = max(clock, ready)
                    clock = start + chunks[kind][chunk] / buckets
                    windows.append((start, clock))
            overlapped = sum(max(0.0, min(stop, b) - max(start, a))
                             for start, stop in busy[rank] for a, b in windows if b > a)
            finish = max(finish, max(end[rank] + (coefficient - 1.0) * overlapped, clock) + gathers[kind])
        return max(0.0, finish - result.makespan)

    def bucket_count(self, layout: Layout, kind: int) -> int:
        """Gradient buckets of chunk 0 on the first (kind 0) or last (1) rank whose reductions
        start during that chunk's last backward: Megatron's own schedules let DDP's hooks launch
        them (only chunk 0 is bucketed, Megatron-Core's default bucket of max(40M, 1M x DP)
        parameters); --use-dpp starts a chunk's reductions after its last backward (one)."""
        if layout.use_dpp or layout.dp == 1:
            return 1
        shape = self.problem.shape
        per_layer = memory_model.layer_parameter_count(shape, layout.tp)
        layers = self.rank_layers(layout)[kind]
        params = layers // layout.vpp * per_layer
        if kind == 0 or layout.vpp == 1:  # the embedding is in chunk 0, the output layer in V-1
            params += self.rank_parameters(layout)[kind] - layers * per_layer
        bucket = max(DDP_BUCKET_PARAMS, DDP_BUCKET_PARAMS_PER_DP_RANK * layout.dp)
        return max(1, -(-params // bucket))
