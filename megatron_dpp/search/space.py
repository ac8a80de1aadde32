"""The search space: every parallel layout Megatron (and this repo's --use-dpp runtime) accepts for
one model on one cluster, as `Layout` values. Only the rules that make a layout valid live here;
what a layout costs is cost.py's job.

Rules (each one the repo's own flag check, megatron_dpp/arguments.py, or Megatron's):
- TP divides the GPUs of a node (tensor parallelism stays inside a node), the attention heads and
  the FFN size; PP divides the layers; TP * PP divides the world; DP = world / (TP * PP); context
  parallelism is 1.
- VPP (model chunks per pipeline rank) divides the layers of a rank; VPP > 1 needs PP >= 2 and a
  number of microbatches that is a multiple of PP (the repo checks it for every interleaved run).
- The micro-batch size divides global batch / DP; microbatches per iteration M = global / (mbs * DP).
- recompute: none, selective (core attention), full (every layer, uniform, one layer per unit).
- The distributed optimizer only with DP > 1; sequence parallelism only with TP > 1; neither on
  CPU processes: the trainer refuses sequence parallelism without CUDA GPUs and Transformer
  Engine, and over gloo the distributed optimizer's reduce-scatter and all-gather cost more than
  the one all-reduce the cost model prices them at (docs/search.md, "Workflow").
- Schedules: Megatron's own order (1F1B, interleaved 1F1B for VPP > 1), and with PP >= 2 every
  dynamic policy of --use-dpp, each with and without --dpp-split-backward (split backwards hold
  activations until W; they exclude sequence parallelism, as the flag check does).
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

from megatron_dpp.pipeline import DYNAMIC_SCHEDULES
from megatron_dpp.pipeline.registry import INTERLEAVED_1F1B, ONE_F_ONE_B

RECOMPUTE_CHOICES = ("none", "selective", "full")


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

    @property
    def use_dpp(self) -> bool:
        return self.schedule in DYNAMIC_SCHEDULES

    def describe(self) -> str:
        return (f"TP{self.tp} PP{self.pp} VPP{self.vpp} DP{self.dp} mbs{self.micro_batch_size} "
                f"recompute={self.recompute} dist-opt={int(self.distributed_optimizer)} "
                f"SP={int(self.sequence_parallel)} {self.schedule}{'+W' if self.split_backward else ''}")


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


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def schedules_for(pp: int, vpp: int, sequence_parallel: bool) -> Iterator[tuple[str, bool]]:
    """(schedule, split_backward) pairs valid for a layout."""
    yield megatron_schedule(vpp), False
    if pp < 2:
        return
    for policy in DYNAMIC_SCHEDULES:
        yield policy, False
        if not sequence_parallel:
            yield policy, True


def parallel_sizes(inputs: SpaceInputs) -> Iterator[tuple[int, int, int]]:
    """Valid (tp, pp, dp)."""
    world = inputs.world_size
    for tp in divisors(inputs.gpus_per_node):
        if inputs.num_attention_heads % tp or inputs.ffn_hidden_size % tp:
            continue
        for pp in divisors(inputs.num_layers):
            if world % (tp * pp):
                continue
            yield tp, pp, world // (tp * pp)


def micro_batch_sizes(inputs: SpaceInputs, dp: int) -> list[int]:
    if inputs.global_batch_size % dp:
        return []
    return divisors(inputs.global_batch_size // dp)


def virtual_sizes(inputs: SpaceInputs, pp: int, num_microbatches: int) -> list[int]:
    per_rank = inputs.num_layers // pp
    if pp < 2 or num_microbatches % pp:
        return [1]
    return divisors(per_rank)


def enumerate_layouts(inputs: SpaceInputs) -> Iterator[Layout]:
    """Every valid layout (see the module docstring), in a fixed order."""
    for tp, pp, dp in parallel_sizes(inputs):
        for mbs in micro_batch_sizes(inputs, dp):
            m = inputs.global_batch_size // (mbs * dp)
            for vpp in virtual_sizes(inputs, pp, m):
                for recompute in RECOMPUTE_CHOICES:
                    for dist_opt in ((False, True) if dp > 1 and inputs.on_gpus else (False,)):
                        for sp in ((False, True) if tp > 1 and inputs.on_gpus else (False,)):
                            for schedule, split in schedules_for(pp, vpp, sp):
                                yield Layout(tp, pp, vpp, dp, mbs, m, recompute, dist_opt, sp,
                                             schedule, split)
