"""The dynamic pipeline parallelism flags (--use-dpp, --dpp-policy, --dpp-memory-budget,
--dpp-timeout, --dpp-split-backward, --dpp-stage-placement, --dpp-schedule; --help's "dynamic
pipeline parallelism" group) and their
checks. The policies, budgets and their parsers live in megatron_dpp.pipeline, the runtime's
defaults in runtime/config.py (DPPConfig); megatron_dpp.arguments composes this module.

Both are imported when the flags are added or checked, not with this module, so that importing
megatron_dpp.arguments loads neither.
"""
from __future__ import annotations

import argparse
from typing import Optional

from megatron_dpp.flag_errors import ArgsError, require
from megatron_dpp.kernels import TRANSFORMER_ENGINE_BACKENDS
from megatron_dpp.pipeline.placement import INTERLEAVED


def add_dpp_args(parser: argparse.ArgumentParser) -> None:
    from megatron_dpp.pipeline import (AUTO_BUDGET, DEFAULT_POLICY, PROVISIONED_BUDGET,
                                       SCHEDULE_NAMES, V_PLACEMENT_SCHEDULES)
    from megatron_dpp.pipeline.placement import INTERLEAVED, PLACEMENT_NAMES
    from megatron_dpp.runtime.config import DPPConfig

    group = parser.add_argument_group("dynamic pipeline parallelism")
    group.add_argument("--use-dpp", action="store_true",
                       help="Run the pipeline with the dynamic scheduler (forward_backward_dpp) instead "
                            "of Megatron's fixed 1F1B / interleaved order.")
    group.add_argument("--dpp-policy", type=str, default=DEFAULT_POLICY,
                       choices=SCHEDULE_NAMES + V_PLACEMENT_SCHEDULES,
                       help="Scheduling policy of --use-dpp (the static orders run through the same "
                            "runtime, for comparison; zb-v is the Zero Bubble paper's ZB-V order, "
                            "torch's ScheduleZBVZeroBubble, on --dpp-stage-placement v).")
    group.add_argument("--dpp-stage-placement", type=str, default=INTERLEAVED,
                       choices=PLACEMENT_NAMES,
                       help="Which pipeline rank holds each model chunk under --use-dpp. "
                            "'interleaved' (default): Megatron-Core's, chunk c of rank r is stage "
                            "c*P+r (torch's 'loop' style). 'v': ZB-V's and DualPipeV's (torch's "
                            "'v' style), two chunks a rank, chunk 0 on ranks 0..P-1 and chunk 1 "
                            "back on ranks P-1..0, so the last stage's backward starts on the rank "
                            "that ran its forward and rank 0 holds the embedding and the loss; "
                            "needs two virtual stages a rank (--num-virtual-stages-per-pipeline-"
                            "rank 2).")
    group.add_argument("--dpp-schedule", type=str, default=None, metavar="FILE",
                       help="Run the per-rank orders of FILE, a schedule in torch's CSV action "
                            "format (torch.distributed.pipelining's _dump_csv, compute-only: one "
                            "row per pipeline rank, cells such as 0F0, 3I1, 3W1, 5B2 with global "
                            "stage ids; profiling/aggregate.py --order-csv writes a traced run's), "
                            "in place of --dpp-policy's order, in training; evaluation runs each "
                            "forward when it is ready. The file must fit the run: its rows are "
                            "the pipeline ranks, its stages' rows the --dpp-stage-placement, I/W "
                            "cells --dpp-split-backward, and it covers the iteration's "
                            "microbatches (global batch / micro-batch x data-parallel size).")
    group.add_argument("--dpp-memory-budget", type=str, default=AUTO_BUDGET,
                       help=f"Activation bytes a pipeline rank may hold, counted for full-length "
                            f"microbatches. '{AUTO_BUDGET}' (default): as many microbatches as Megatron's "
                            "1F1B (interleaved for virtual stages) holds at most on that rank. "
                            f"'{PROVISIONED_BUDGET}': as many as it holds on its fullest rank, the "
                            "first (P under 1F1B; 2(P-1)+(V-1)*G+1 chunk activations interleaved, "
                            "G the group size, default P), on every rank: the devices of a pipeline "
                            "have the same memory, so the later ranks' headroom is free and a "
                            "policy may run further ahead there; use it when the first rank's "
                            "memory is what you provision anyway. A multiple such as 1.25x: "
                            "that many times 'provisioned' on every rank (at least 1x; for less "
                            "memory than 1F1B's fullest rank give bytes). Or a byte count such as "
                            "2147483648 or 2GiB, on every rank. With --dpp-split-backward each "
                            "microbatch also counts what its W keeps from B to W.")
    group.add_argument("--dpp-timeout", type=float, default=DPPConfig.timeout_s,
                       help="Seconds without progress after which every DPP rank prints its state "
                            "(ready tasks, awaited tags, memory held) and the job exits non-zero.")
    group.add_argument("--dpp-split-backward", action="store_true",
                       help="Split every backward of --use-dpp into B (the input gradient, sent "
                            "upstream at once) and W (the weight gradients, run later by the "
                            "policy). The model is built from Megatron-Core's local layers with "
                            "deferrable weight gradients; a microbatch's W keeps its layer inputs "
                            "and output gradients until it runs, which the memory budget counts. "
                            "Not with Transformer Engine layers, --sequence-parallel or "
                            "--attention-backend flash/fused/unfused (core attention is "
                            "--attention-backend's sdpa or local, or --use-flash-attn's flash-attn).")


def validate_dpp_args(args: argparse.Namespace, minimum_budget_bytes: Optional[int]) -> None:
    """The DPP flags. args.parallel: the derived layout (parallel/layout.py). minimum_budget_bytes:
    the least byte count the dynamic policies run with on these flags (megatron_dpp.arguments'
    dpp_minimum_budget_bytes, from the model's activation bytes); None where it is not known (an
    invalid micro-batch size, which the training flags refuse)."""
    from megatron_dpp.pipeline import check_policy_layout, parse_memory_budget

    try:
        args.dpp_memory_budget_bytes = parse_memory_budget(args.dpp_memory_budget,
                                                           what="--dpp-memory-budget")
    except ValueError as error:
        raise ArgsError(str(error)) from None
    require(args.dpp_timeout > 0, f"--dpp-timeout must be positive seconds, got {args.dpp_timeout}")
    if not args.use_dpp:
        require(not getattr(args, "dpp_split_backward", False),
                "--dpp-split-backward splits the backward of the DPP runtime; add --use-dpp or "
                "drop --dpp-split-backward")
        require(args.dpp_stage_placement == INTERLEAVED,
                f"--dpp-stage-placement {args.dpp_stage_placement} is run by the DPP runtime "
                f"(Megatron's schedules run its interleaved placement); add --use-dpp or drop "
                f"--dpp-stage-placement")
        require(args.dpp_schedule is None,
                "--dpp-schedule runs a schedule in the DPP runtime; add --use-dpp or drop "
                "--dpp-schedule")
        return
    require(args.pipeline_model_parallel_size >= 2,
            "--use-dpp schedules a pipeline; set --pipeline-model-parallel-size 2 or more, or drop "
            "--use-dpp")
    try:
        check_policy_layout(args.dpp_policy, args.parallel.chunks_per_rank)
    except ValueError as error:
        raise ArgsError(f"--dpp-policy {error}") from None
    _validate_placement(args)
    _validate_schedule_file(args)
    _validate_split_backward(args)
    _validate_budget_minimum(args, minimum_budget_bytes)


def _validate_budget_minimum(args: argparse.Namespace, minimum: Optional[int]) -> None:
    """A byte count below what a dynamic policy needs fails in every rank's first iteration
    (make_scheduler: "below the minimum"); refused here, before launch. The static orders only
    report the budget."""
    from megatron_dpp.pipeline import DYNAMIC_SCHEDULES
    from megatron_dpp.pipeline.budget import is_explicit_budget

    budget = args.dpp_memory_budget_bytes
    if args.dpp_policy not in DYNAMIC_SCHEDULES or not is_explicit_budget(budget):
        return
    if minimum is None:
        return  # not known before launch: the schedulers check it in the first iteration
    stash = (", plus what --dpp-split-backward's W keeps" if getattr(args, "dpp_split_backward", False)
             else "")
    require(budget >= minimum,
            f"--dpp-memory-budget {args.dpp_memory_budget} ({budget} bytes) is below the minimum "
            f"{minimum} bytes of --dpp-policy {args.dpp_policy} on these flags (one full-length "
            f"microbatch, --seq-length x --micro-batch-size, on each of the "
            f"{args.parallel.chunks_per_rank} model chunks of a rank{stash}); "
            f"give at least {minimum}, 'auto', 'provisioned' or a multiple such as 1.25x")


def _validate_placement(args: argparse.Namespace) -> None:
    """--dpp-stage-placement (with --use-dpp): the v placement's two chunks a rank, a policy with
    an order on it, and the tied embedding's two copies summed on rank 0 before the
    data-parallel reduction (finalize_model_grads), which --overlap-grad-reduce starts earlier."""
    from megatron_dpp.pipeline import check_policy_placement
    from megatron_dpp.pipeline.placement import V_SHAPE, named_placement

    chunks = args.parallel.chunks_per_rank
    if args.dpp_stage_placement == V_SHAPE:
        require(chunks == 2,
                f"--dpp-stage-placement v holds two model chunks per rank, got {chunks}; add "
                f"--num-virtual-stages-per-pipeline-rank 2")
        require(not (args.overlap_grad_reduce and args.parallel.data_parallel_size > 1
                     and not getattr(args, "untie_embeddings_and_output_weights", False)),
                "--dpp-stage-placement v sums the tied embedding's two copies on rank 0 before the "
                "data-parallel reduction, which --overlap-grad-reduce starts during the backward; "
                "drop --overlap-grad-reduce or add --untie-embeddings-and-output-weights")
        require(not getattr(args, "calculate_per_token_loss", False),
                "--dpp-stage-placement v computes the loss on pipeline rank 0, and "
                "--calculate-per-token-loss takes the token count from the last pipeline rank "
                "(Megatron-Core's finalize_model_grads); drop one of them")
    try:
        check_policy_placement(args.dpp_policy,
                               named_placement(args.dpp_stage_placement,
                                               args.pipeline_model_parallel_size, chunks))
    except ValueError as error:
        raise ArgsError(f"--dpp-policy {error}") from None


def schedule_file_problem(args: argparse.Namespace) -> Optional[str]:
    """--dpp-schedule FILE against the run: the file's one-line problem, or None where it reads
    and fits (the rows its ranks, the placement, split backwards, the microbatches)."""
    from megatron_dpp.pipeline.placement import named_placement
    from megatron_dpp.pipeline.schedule_csv import read_schedule_csv

    try:
        schedule = read_schedule_csv(args.dpp_schedule)
    except OSError as error:
        return f"cannot read it: {error.strerror or error}"
    except (ValueError, UnicodeDecodeError) as error:
        return str(error)
    chunks = args.parallel.chunks_per_rank
    return schedule.mismatch(args.pipeline_model_parallel_size, chunks, args.num_microbatches,
                             bool(getattr(args, "dpp_split_backward", False)),
                             named_placement(args.dpp_stage_placement,
                                             args.pipeline_model_parallel_size, chunks))


def _validate_schedule_file(args: argparse.Namespace) -> None:
    """--dpp-schedule (with --use-dpp): the file reads and fits; a batch ramp-up would change the
    microbatch count the file covers."""
    if args.dpp_schedule is None:
        return
    require(getattr(args, "rampup_batch_size", None) is None,
            "--dpp-schedule fixes the microbatches of an iteration, which --rampup-batch-size "
            "changes; drop one of them")
    problem = schedule_file_problem(args)
    require(problem is None, f"--dpp-schedule {args.dpp_schedule}: {problem}")


def _validate_split_backward(args: argparse.Namespace) -> None:
    """--dpp-split-backward (with --use-dpp; checked above): what the deferred layers (megatron_dpp.models.weight_grad) cover.
    Transformer Engine needs no check: with the flag the model is built from Megatron-Core's local
    layers even where Transformer Engine is installed (with our SDPA or flash-attn core attention
    on a GPU, megatron_dpp.kernels); gradient-accumulation fusion, RMSNorm and
    multi-token prediction have no flag here (always off)."""
    if not getattr(args, "dpp_split_backward", False):
        return
    require(not args.parallel.sequence_parallel,
            "--dpp-split-backward does not support --sequence-parallel (deferred weight gradients "
            "cover Megatron-Core's local layers without it); drop one of them")
    require(args.attention_backend not in TRANSFORMER_ENGINE_BACKENDS,
            f"--dpp-split-backward builds Megatron-Core's local layers, not Transformer Engine's "
            f"attention; drop --attention-backend {args.attention_backend} or "
            f"--dpp-split-backward")
