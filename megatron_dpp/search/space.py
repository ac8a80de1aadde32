"""The search space: every parallel layout Megatron (and this repo's --use-dpp runtime) accepts for
one model on one cluster, as `Layout` values. Only the rules that make a layout valid live here;
what a layout costs is cost.py's job.

Rules (each one the repo's own flag check, megatron_dpp/arguments.py, or Megatron's):
- TP divides the GPUs of a node (tensor parallelism stays inside a node), the attention heads and
  the FFN size; TP * PP divides the world; DP = world / (TP * PP); context parallelism is 1.
- The layers split over the PP stages evenly (PP divides the layers), or, with PP >= 2 and one
  model chunk per rank, unevenly as Megatron-LM's --decoder-last-pipeline-num-layers splits them:
  the last stage gets `last_stage_layers` and the others share the rest evenly
  (parallel/split.py's rules). The last stage also runs the output layer and the loss, so
  fewer layers there can balance the stages; more layers there can lower the first stage's
  memory, which holds the most microbatches in flight.
- VPP (model chunks per pipeline rank) divides the layers of a rank of an even split; VPP > 1
  needs PP >= 2 and a number of microbatches that is a multiple of PP (the repo checks it for
  every interleaved run).
- The micro-batch size divides global batch / DP; microbatches per iteration M = global / (mbs * DP).
- recompute: none, selective (core attention), full (every layer, uniform, one layer per unit).
- The distributed optimizer only with DP > 1; sequence parallelism only with TP > 1; neither on
  CPU processes: the trainer refuses sequence parallelism without CUDA GPUs and Transformer
  Engine, and over gloo the distributed optimizer's reduce-scatter and all-gather cost more than
  the one all-reduce the cost model prices them at (docs/search.md, "Workflow").
- Schedules: Megatron's own order (1F1B, interleaved 1F1B for VPP > 1), and with PP >= 2 every
  dynamic policy of --use-dpp, each with and without --dpp-split-backward (split backwards hold
  activations until W; they exclude sequence parallelism, as the flag check does).
- Stage placements: Megatron's interleaved one for every schedule; with PP >= 2 and VPP 2 also
  ZB-V's v (--dpp-stage-placement v, runtime/flags.py) under the policies that have an order on it
  (V_PLACEMENT_POLICIES: zb-v and dpp:adaptive), with and without split backwards.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Iterator

from megatron_dpp.flag_errors import ArgsError
from megatron_dpp.parallel.split import PipelineSplit
from megatron_dpp.pipeline import DYNAMIC_SCHEDULES
from megatron_dpp.pipeline.placement import INTERLEAVED, V_SHAPE, Placement, named_placement
from megatron_dpp.pipeline.registry import ADAPTIVE, INTERLEAVED_1F1B, ONE_F_ONE_B, ZB_V

RECOMPUTE_CHOICES = ("none", "selective", "full")
# The --use-dpp policies the search runs on the v placement (check_policy_placement accepts them).
V_PLACEMENT_POLICIES = (ZB_V, ADAPTIVE)


def megatron_schedule(vpp: int) -> str:
    """Megatron's own order for `vpp` chunks per rank."""
    return ONE_F_ONE_B if vpp == 1 else INTERLEAVED_1F1B


@dataclasses.dataclass(frozen=True)
class Layout:
    """One parallel layout with its schedule."""

    tp: int  # tensor-parallel size
    pp: int  # pipeline-parallel size
    vpp: int  # model chunks per pipeline rank (1: no virtual stages)
    dp: int  # data-parallel size
    micro_batch_size: int  # sequences per microbatch
    num_microbatches: int  # microbatches per iteration per pipeline: global / (mbs * dp)
    recompute: str  # one of RECOMPUTE_CHOICES
    distributed_optimizer: bool  # optimizer state sharded over DP (only with dp > 1)
    sequence_parallel: bool  # only with tp > 1
    schedule: str  # Megatron's order (megatron_schedule) or a --use-dpp policy
    split_backward: bool  # --dpp-split-backward (dynamic policies only)
    # Layers of the last pipeline stage (Megatron-LM's --decoder-last-pipeline-num-layers; the
    # other stages share the rest evenly); 0: an even split.
    last_stage_layers: int = 0
    placement: str = INTERLEAVED  # --dpp-stage-placement (placement.PLACEMENT_NAMES)

    @property
    def use_dpp(self) -> bool:
        return self.schedule in DYNAMIC_SCHEDULES or self.placement != INTERLEAVED

    def stage_placement(self) -> Placement:
        """Which rank holds each virtual stage."""
        return _placement(self.placement, self.pp, self.vpp)

    def schedule_label(self) -> str:
        """The schedule as the search's table names it: policy, split backwards, placement."""
        split = " +split-backward" if self.split_backward else ""
        placed = f" ({self.placement} placement)" if self.placement != INTERLEAVED else ""
        return f"{self.schedule}{split}{placed}"

    def rank_layers(self, num_layers: int) -> list[int]:
        """Transformer layers of each pipeline rank (all its chunks)."""
        return list(_rank_layers(num_layers, self.pp, self.last_stage_layers))

    def describe(self) -> str:
        split = f" last-stage-layers={self.last_stage_layers}" if self.last_stage_layers else ""
        return (f"TP{self.tp} PP{self.pp} VPP{self.vpp} DP{self.dp} mbs{self.micro_batch_size} "
                f"recompute={self.recompute} dist-opt={int(self.distributed_optimizer)} "
                f"SP={int(self.sequence_parallel)}{split} "
                f"{self.schedule}{'+W' if self.split_backward else ''}"
                f"{'/' + self.placement if self.placement != INTERLEAVED else ''}")


@dataclasses.dataclass(frozen=True)
class SpaceInputs:
    """What the valid layouts depend on."""

    num_layers: int
    num_attention_heads: int
    ffn_hidden_size: int
    global_batch_size: int
    num_nodes: int
    gpus_per_node: int
    on_gpus: bool = True  # False: CPU processes, without the GPU-only features

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node


@functools.lru_cache(maxsize=None)
def _placement(name: str, pp: int, vpp: int) -> Placement:
    return named_placement(name, pp, vpp)


def pipeline_split(num_layers: int, pp: int, last_stage_layers: int) -> PipelineSplit:
    """The split of a layout's layers (parallel/split.py), last_stage_layers 0: even."""
    return PipelineSplit(num_layers, pp, last=last_stage_layers or None)


@functools.lru_cache(maxsize=None)
def _rank_layers(num_layers: int, pp: int, last_stage_layers: int) -> tuple[int, ...]:
    # Cached: the search asks it for every layout it prices, several times each.
    return tuple(pipeline_split(num_layers, pp, last_stage_layers).rank_layers())


@functools.lru_cache(maxsize=None)
def last_stage_choices(num_layers: int, pp: int) -> tuple[int, ...]:
    """The last stage's layer counts of one-chunk-per-rank layouts: 0 (an even split) where PP
    divides the layers, then every uneven split of Megatron's rules (the other stages share the
    rest evenly, at least one layer each)."""
    choices = [0] if num_layers % pp == 0 else []
    if pp < 2:
        return tuple(choices)
    for last in range(1, num_layers):
        split = pipeline_split(num_layers, pp, last)
        try:
            split.check()
        except ArgsError:
            continue
        if len(set(split.rank_layers())) > 1:  # an even one is the 0 above
            choices.append(last)
    return tuple(choices)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def schedules_for(pp: int, vpp: int, sequence_parallel: bool) -> Iterator[tuple[str, bool, str]]:
    """(schedule, split_backward, placement) triples valid for a layout."""
    yield megatron_schedule(vpp), False, INTERLEAVED
    if pp < 2:
        return
    for policy in DYNAMIC_SCHEDULES:
        yield policy, False, INTERLEAVED
        if not sequence_parallel:
            yield policy, True, INTERLEAVED
    if vpp != 2:  # the v holds two chunks a rank
        return
    for policy in V_PLACEMENT_POLICIES:
        yield policy, False, V_SHAPE
        if not sequence_parallel:
            yield policy, True, V_SHAPE


def parallel_sizes(inputs: SpaceInputs) -> Iterator[tuple[int, int, int]]:
    """Valid (tp, pp, dp)."""
    world = inputs.world_size
    for tp in divisors(inputs.gpus_per_node):
        if inputs.num_attention_heads % tp or inputs.ffn_hidden_size % tp:
            continue
        for pp in range(1, inputs.num_layers + 1):
            if world % (tp * pp) or not last_stage_choices(inputs.num_layers, pp):
                continue
            yield tp, pp, world // (tp * pp)


def micro_batch_sizes(inputs: SpaceInputs, dp: int) -> list[int]:
    if inputs.global_batch_size % dp:
        return []
    return divisors(inputs.global_batch_size // dp)


def virtual_sizes(inputs: SpaceInputs, pp: int, num_microbatches: int) -> list[int]:
    """Chunks per rank: more than one only for an even split."""
    if pp < 2 or num_microbatches % pp or inputs.num_layers % pp:
        return [1]
    return divisors(inputs.num_layers // pp)


def enumerate_layouts(inputs: SpaceInputs) -> Iterator[Layout]:
    """Every valid layout (see the module docstring), in a fixed order."""
    for tp, pp, dp in parallel_sizes(inputs):
        for mbs in micro_batch_sizes(inputs, dp):
            m = inputs.global_batch_size // (mbs * dp)
            for vpp in virtual_sizes(inputs, pp, m):
                lasts = last_stage_choices(inputs.num_layers, pp) if vpp == 1 else [0]
                for last in lasts:
                    for recompute in RECOMPUTE_CHOICES:
                        for dist_opt in ((False, True) if dp > 1 and inputs.on_gpus else (False,)):
                            for sp in ((False, True) if tp > 1 and inputs.on_gpus else (False,)):
                                for schedule, split, placed in schedules_for(pp, vpp, sp):
                                    yield Layout(tp, pp, vpp, dp, mbs, m, recompute, dist_opt, sp,
                                                 schedule, split, last, placed)
