"""start-search.sh: search the parallel layout and schedule of one model on one cluster.

    python -m megatron_dpp.search.cli --num-layers 96 --hidden-size 12288 --num-attention-heads 96 \\
        --seq-length 2048 --global-batch-size 1536 --num-nodes 128 --num-gpus-per-node 8 \\
        --hardware 8xH100-nvlink-ib400 --memory-budget-gb 80 --bf16 --output-strategy runs/s.json

Prints (stdout) where the hardware and model figures come from, what the search pruned, a table of
the K fastest layouts, the winner as a Megatron command line and its strategy JSON; the progress
goes to stderr. Bad flags or input: one line on stderr, exit 2. No layout fits the memory budget:
one line with the least memory any layout needs, exit 2.

`--galvatron-config FILE` prices a Galvatron strategy converted to our layout instead of searching
(galvatron_strategy.py says what converts); `--output-format galvatron` also writes the winner in
Galvatron's strategy format, besides ours (docs/search.md, "Galvatron's files").
"""
from __future__ import annotations

import json
import pathlib
import sys
from typing import Optional, Sequence

from megatron_dpp.search import memory_model
from megatron_dpp.search import galvatron_strategy
from megatron_dpp.search.cost import LayoutCost, Pricer, Problem
from megatron_dpp.search.engine import Progress, SearchResult, search, space_inputs
from megatron_dpp.search.errors import SearchInputError
from megatron_dpp.search.hardware import PRESETS, load_hardware, with_matmul_rates
from megatron_dpp.search.lengths import PACKED_FLAG, parse_distribution
from megatron_dpp.search.model_profile import read_model_profile_dir
from megatron_dpp.exit_codes import BAD_INPUT
from megatron_dpp.models.families import (DEFAULT_MODEL, MODEL_FAMILIES, add_architecture_shape_args,
                                         default_ffn_hidden_size)
from megatron_dpp.one_line_errors import OneLineErrorParser
from megatron_dpp.search.strategy import build_strategy, megatron_flags, write_strategy

PROG = "start-search.sh"
GB = 10**9  # --memory-budget-gb's unit
ANALYTICAL_SOURCE = ("analytical: memory_model.layer_forward_flops at the hardware's matmul "
                     "TFLOP/s, backward 2x forward")


def build_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(prog=PROG, allow_abbrev=False, description=__doc__.split("\n\n")[0])
    model = parser.add_argument_group("model (Megatron's flag names)")
    model.add_argument("--model", choices=sorted(MODEL_FAMILIES), default=DEFAULT_MODEL,
                       help="The model: " + "; ".join(f.summary for f in MODEL_FAMILIES.values())
                            + f" (default {DEFAULT_MODEL}).")
    model.add_argument("--num-layers", type=int, required=True, help="Transformer layers.")
    model.add_argument("--hidden-size", type=int, required=True, help="Hidden size.")
    model.add_argument("--num-attention-heads", type=int, required=True, help="Attention heads.")
    model.add_argument("--ffn-hidden-size", type=int, default=None,
                       help="MLP hidden size (default 4 x --hidden-size).")
    model.add_argument("--seq-length", type=int, required=True,
                       help="Sequence length (the longest, with --variable-seq-lengths).")
    model.add_argument("--max-position-embeddings", type=int, default=None,
                       help="Position embeddings (default --seq-length).")
    model.add_argument("--vocab-size", type=int, default=None,
                       help="Tokenizer vocabulary before padding (default: the model's tokenizer's, "
                            + ", ".join(f"{f.default_vocab_size} for {f.name}"
                                        for f in MODEL_FAMILIES.values()) + ").")
    model.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                       help="Pad the vocabulary up to a multiple of this (Megatron's default 128).")
    model.add_argument("--hidden-dropout", type=float, default=memory_model.ModelShape.hidden_dropout,
                       help="Hidden dropout (0 keeps no dropout masks: less activation memory).")
    model.add_argument("--attention-dropout", type=float,
                       default=memory_model.ModelShape.attention_dropout,
                       help="Attention dropout (0 keeps no attention dropout mask).")
    model.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                       help="Separate output-layer weights (default: tied to the embedding).")
    add_architecture_shape_args(model)  # Megatron-LM's architecture flags (gpt takes them all)
    for family in MODEL_FAMILIES.values():  # each model's own shape flags
        family.add_shape_args(model)
    precision = model.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true", help="bf16 mixed precision.")
    precision.add_argument("--fp16", action="store_true", help="fp16 mixed precision.")
    model.add_argument("--global-batch-size", type=int, required=True,
                       help="Sequences per iteration (optimizer step).")
    model.add_argument("--variable-seq-lengths", action="store_true",
                       help="Sequences have different lengths (Megatron pads each microbatch to its "
                            "longest); needs --seq-length-distribution.")
    model.add_argument("--seq-length-distribution", type=str, default=None, metavar="SPEC",
                       help="With --variable-seq-lengths: uniform:MIN:MAX, lognormal:MEAN:CV or "
                            "file:PATH (whitespace-separated lengths measured on the data); lengths "
                            "are clipped to --seq-length.")
    model.add_argument(PACKED_FLAG, type=str, default=None, metavar="SPEC",
                       help="Packed data with per-document attention, as the trainer runs it "
                            "with --dataloader-inter-document-masking (this search's own flag; "
                            "Megatron-LM has none for it): every microbatch is full --seq-length windows cut from a stream "
                            "of documents of this length distribution (the grammar of "
                            "--seq-length-distribution; a document runs on over window "
                            "boundaries), attention inside each document, so a window of long "
                            "documents costs more than one of short ones. Not with "
                            "--variable-seq-lengths; GPT and Llama.")
    cluster = parser.add_argument_group("cluster and search")
    cluster.add_argument("--num-nodes", type=int, required=True, help="Nodes of the job.")
    cluster.add_argument("--num-gpus-per-node", type=int, required=True,
                         help="GPUs (processes) per node; tensor parallelism stays inside a node.")
    cluster.add_argument("--cpu", action="store_true",
                         help="The job runs on CPU processes (as on this machine): layouts with "
                              "--sequence-parallel (which needs CUDA GPUs) or "
                              "--use-distributed-optimizer (slower over gloo than priced) are left "
                              "out; fp32 only.")
    cluster.add_argument("--memory-budget-gb", type=float, required=True,
                         help="Memory per GPU a layout may use, in GB (10^9 bytes).")
    cluster.add_argument("--hardware", type=str, required=True, metavar="PRESET|DIR",
                         help=f"The cluster's figures: a preset ({', '.join(PRESETS)}) or a directory "
                              "of Galvatron hardware files (profile_hardware.sh).")
    cluster.add_argument("--model-profile", type=str, default=None, metavar="DIR",
                         help="Measured layer times: profile_model.sh's directory, or one "
                              "Galvatron's profiler wrote (its computation_profiling_* and "
                              "memory_profiling_* files); default: analytical FLOPs at the "
                              "hardware's matmul rate.")
    cluster.add_argument("--model-profile-name", type=str, default=None, metavar="NAME",
                         help="Which profile of --model-profile to read when it holds several: "
                              "the file names' part after computation_profiling_{dtype}_ (e.g. "
                              "llama2-7b_all, hidden4096_head32_seqlen2048).")
    cluster.add_argument("--matmul-preset", type=str, default=None, choices=sorted(PRESETS),
                         help="Take the dense matmul TFLOP/s from this preset's datasheet. "
                              "Default: the hardware profile's; a directory without them "
                              "(Galvatron's) gets a quick matmul measured on this machine. One "
                              "output line says which.")
    cluster.add_argument("--galvatron-config", type=str, default=None, metavar="FILE",
                         help="Instead of searching, convert this Galvatron strategy "
                              "(galvatron_config_*.json) to our layout and price it; a strategy "
                              "ours cannot express (per-layer TP, recompute or DP type, uneven "
                              "stages, ZeRO-3, Ulysses, GPipe) is one line, exit 2.")
    cluster.add_argument("--output-format", choices=("ours", "galvatron"), default="ours",
                         help="galvatron: besides our strategy JSON, write the winner (the best "
                              "of the top K that Galvatron's format expresses: no virtual stages, "
                              "dynamic schedules or selective recompute) as Galvatron's "
                              "galvatron_config_*.json, next to --output-strategy (default ours).")
    cluster.add_argument("--simulate-every-microbatch", action="store_true",
                         help="Simulate all microbatches of each layout instead of extrapolating long "
                              "pipelines from two shorter runs (slower; the extrapolation's error is "
                              "in docs/search.md).")
    cluster.add_argument("--top", type=int, default=5, metavar="K", help="Layouts to list (default 5).")
    cluster.add_argument("--output-strategy", type=str, default=None, metavar="FILE",
                         help="Write the winner's strategy JSON here (the run scripts' --strategy).")
    return parser


def _check(args) -> None:
    """Flag checks argparse cannot express; SearchInputError (one line)."""
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "global_batch_size",
                 "num_nodes", "num_gpus_per_node", "top", "make_vocab_size_divisible_by"):
        if getattr(args, flag) < 1:
            raise SearchInputError(f"--{flag.replace('_', '-')} must be at least 1")
    for flag in ("ffn_hidden_size", "vocab_size", "max_position_embeddings"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise SearchInputError(f"--{flag.replace('_', '-')} must be at least 1")
    if args.hidden_size % args.num_attention_heads and args.kv_channels is None:
        raise SearchInputError(f"--hidden-size {args.hidden_size} is not divisible by "
                               f"--num-attention-heads {args.num_attention_heads}")
    if args.max_position_embeddings is not None and args.max_position_embeddings < args.seq_length:
        raise SearchInputError(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
                               f"{args.max_position_embeddings}")
    for flag in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(args, flag) < 1.0:
            raise SearchInputError(f"--{flag.replace('_', '-')} must be in [0, 1)")
    if not args.memory_budget_gb > 0:
        raise SearchInputError("--memory-budget-gb must be positive")
    if args.cpu and (args.bf16 or args.fp16):
        raise SearchInputError(f"--{'bf16' if args.bf16 else 'fp16'} with --cpu: the search prices "
                               f"CPU runs in fp32 only; drop one")
    if args.packed_document_distribution is not None:
        if args.variable_seq_lengths or args.seq_length_distribution is not None:
            given = "--variable-seq-lengths" if args.variable_seq_lengths else "--seq-length-distribution"
            raise SearchInputError(f"{PACKED_FLAG} and {given} exclude each other: packed microbatches "
                                   f"are full --seq-length windows; give one")
        if not MODEL_FAMILIES[args.model].document_masking:
            masked = ", ".join(name for name, f in sorted(MODEL_FAMILIES.items()) if f.document_masking)
            raise SearchInputError(f"{PACKED_FLAG} with --model {args.model}: its samples have no "
                                   f"per-document attention (models that have it: {masked})")
    if args.variable_seq_lengths != (args.seq_length_distribution is not None):
        raise SearchInputError("--variable-seq-lengths and --seq-length-distribution go together: "
                               "give both or neither")


def problem_from_args(args) -> tuple[Problem, str]:
    """The Problem and the model figures' source."""
    problem, source, _rates = load_problem(args)
    return problem, source


def load_problem(args) -> tuple[Problem, str, str]:
    """The Problem, the model figures' source and the line that says where the matmul rates
    come from (`hardware.with_matmul_rates`)."""
    _check(args)
    dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    family = MODEL_FAMILIES[args.model]
    vocab = args.vocab_size or family.default_vocab_size
    divisor = args.make_vocab_size_divisible_by
    shape = memory_model.ModelShape(
        model=args.model, num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size or default_ffn_hidden_size(args),
        seq_length=args.seq_length,
        padded_vocab_size=-(-vocab // divisor) * divisor,
        max_position_embeddings=args.max_position_embeddings or args.seq_length,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights, dtype=dtype,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        **family.shape_fields(args))
    hardware = load_hardware(args.hardware, args.num_nodes, args.num_gpus_per_node)
    # Analytical times, and the output layer without a measured one, need this dtype's rate.
    hardware, rates = with_matmul_rates(hardware, dtype, args.matmul_preset)
    profile, source = None, ANALYTICAL_SOURCE
    if args.model_profile is not None:
        profile = read_model_profile_dir(args.model_profile, args.hidden_size, args.num_attention_heads,
                                         dtype, seq_length=args.seq_length, name=args.model_profile_name)
        if profile.model not in (args.model, "unknown"):  # "unknown": Galvatron's files alone
            raise SearchInputError(f"--model-profile {args.model_profile} profiles {profile.model} "
                                   f"layers, not --model {args.model}")
        source = profile.source
    lengths = parse_distribution(args.seq_length_distribution) if args.variable_seq_lengths else None
    packed = (parse_distribution(args.packed_document_distribution, PACKED_FLAG)
              if args.packed_document_distribution is not None else None)
    return Problem(shape=shape, global_batch_size=args.global_batch_size, hardware=hardware,
                   memory_budget_bytes=int(args.memory_budget_gb * GB), model_profile=profile,
                   lengths=lengths, packed=packed, on_gpus=not args.cpu), source, rates


def packed_line(problem: Problem) -> str:
    """What the report says of packed data (--packed-document-distribution)."""
    return (f"packed documents: {problem.packed.spec}, in full windows of {problem.shape.seq_length} "
            f"tokens, attention per document (--dataloader-inter-document-masking; one sampled "
            f"batch per micro-batch size)")


def format_table(result: SearchResult, num_layers: int) -> str:
    """The best layouts, one row each (a Markdown table); PP shows an uneven split's layers per
    stage, as Galvatron's pp_division lists them: 2 (6,2)."""
    header = ("| # | TP | PP | VPP | DP | mbs | recompute | dist-opt | SP | schedule | ms/iteration "
              "| GB/rank | bubble |")
    rows = [header, "|" + "---|" * 13]
    for index, cost in enumerate(result.best, 1):
        layout = cost.layout
        schedule = layout.schedule_label()
        stages = str(layout.pp)
        if layout.last_stage_layers:
            stages += f" ({','.join(str(count) for count in layout.rank_layers(num_layers))})"
        rows.append(f"| {index} | {layout.tp} | {stages} | {layout.vpp} | {layout.dp} | "
                    f"{layout.micro_batch_size} | {layout.recompute} | "
                    f"{'on' if layout.distributed_optimizer else 'off'} | "
                    f"{'on' if layout.sequence_parallel else 'off'} | {schedule} | {cost.time_ms:.1f} | "
                    f"{cost.memory_bytes / GB:.2f} | {cost.bubble_fraction:.3f} |")
    return "\n".join(rows)


def command_line(problem: Problem, flags: list[str]) -> str:
    hardware = problem.hardware
    return (f"torchrun --nnodes {hardware.num_nodes} --nproc-per-node {hardware.gpus_per_node} "
            f"-m megatron_dpp.pretrain --model {problem.shape.model} " + " ".join(flags))


def _error(message) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    return BAD_INPUT


def _from_galvatron(args, problem: Problem) -> LayoutCost:
    """The Galvatron strategy of --galvatron-config as our layout, priced."""
    config = galvatron_strategy.read_galvatron_config(args.galvatron_config)
    layout = galvatron_strategy.layout_from_galvatron(
        config, f"--galvatron-config {args.galvatron_config}", space_inputs(problem))
    pricer = Pricer(problem, extrapolate=not args.simulate_every_microbatch)
    return pricer.price(layout, pricer.estimate(layout))


def _galvatron_output(args, problem: Problem, best: Sequence[LayoutCost]) -> tuple[dict, str]:
    """Galvatron's strategy of the best layout it expresses, and the line that says which."""
    for rank, cost in enumerate(best, 1):
        if galvatron_strategy.inexpressible(cost.layout):
            continue
        config = galvatron_strategy.galvatron_config_from_layout(
            cost.layout, problem.shape.num_layers, problem.global_batch_size)
        line = (f"Galvatron's strategy format: layout #{rank}" +
                ("" if rank == 1 else f" (#1 has {', '.join(galvatron_strategy.inexpressible(best[0].layout))},"
                                      f" which the format cannot hold)"))
        note = galvatron_strategy.sequence_parallel_note(cost.layout)
        return config, line + (f"; {note}" if note else "")
    raise SearchInputError(f"none of the top {len(best)} layouts is expressible in Galvatron's "
                           f"strategy format (#1 has "
                           f"{', '.join(galvatron_strategy.inexpressible(best[0].layout))}); "
                           f"raise --top")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        problem, model_source, rates = load_problem(args)
        converted = _from_galvatron(args, problem) if args.galvatron_config else None
    except SearchInputError as error:
        return _error(error)
    if converted is not None:
        return _print_converted(args, problem, model_source, rates, converted)
    result = search(problem, args.top, Progress(sys.stderr),
                    extrapolate=not args.simulate_every_microbatch)
    if not result.best:
        print(f"{PROG}: error: no layout fits --memory-budget-gb {args.memory_budget_gb:g}: the "
              f"smallest needs {result.smallest_memory_bytes / GB:.2f} GB per GPU", file=sys.stderr,
              flush=True)
        return BAD_INPUT
    winner = result.best[0]
    strategy = build_strategy(problem, winner, model_source)
    galvatron = None
    if args.output_format == "galvatron":
        try:
            galvatron = _galvatron_output(args, problem, result.best)
        except SearchInputError as error:
            return _error(error)
    print(f"hardware figures: {problem.hardware.source}")
    print(f"model figures: {model_source}")
    print(rates)
    if problem.lengths is not None:
        print(f"sequence lengths: {problem.lengths.spec} (one sampled batch per micro-batch size)")
    if problem.packed is not None:
        print(packed_line(problem))
    print(f"searched {result.layouts} layouts in {result.seconds:.2f} s: {result.dominated} dominated "
          f"(sequence parallelism off), {result.over_memory} over the memory budget, "
          f"{result.recompute_dominated} beaten by less recompute, {result.bound_pruned} pruned by the "
          f"time bound, {result.simulated} simulated ({result.simulations} simulator runs)")
    print()
    print(format_table(result, problem.shape.num_layers))
    print()
    print("winner as a Megatron command line:")
    print("  " + command_line(problem, megatron_flags(problem, winner)))
    print()
    _write_outputs(args, problem, strategy, galvatron)
    return 0


def _write_outputs(args, problem: Problem, strategy: dict, galvatron: Optional[tuple[dict, str]]) -> None:
    """Our strategy JSON (written to --output-strategy when given), then with --output-format
    galvatron Galvatron's, written next to it under Galvatron's own file name."""
    if args.output_strategy is not None:
        path = write_strategy(strategy, args.output_strategy)
        print(f"strategy written to {path}:")
    print(json.dumps(strategy, indent=2))
    if galvatron is None:
        return
    config, line = galvatron
    print(line)
    if args.output_strategy is not None:
        name = galvatron_strategy.galvatron_config_file_name(
            problem.shape.model, problem.hardware.num_nodes, problem.hardware.gpus_per_node,
            args.memory_budget_gb, problem.shape.dtype)
        path = galvatron_strategy.write_galvatron_config(
            config, pathlib.Path(args.output_strategy).parent / name)
        print(f"Galvatron's strategy written to {path}:")
    print(json.dumps(config, indent=4))


def _print_converted(args, problem: Problem, model_source: str, rates: str, cost: LayoutCost) -> int:
    """--galvatron-config: the converted layout, priced, as the search prints its winner."""
    galvatron = None
    if args.output_format == "galvatron":
        galvatron = (galvatron_strategy.galvatron_config_from_layout(
            cost.layout, problem.shape.num_layers, problem.global_batch_size),
            "Galvatron's strategy format: the converted layout")
    print(f"hardware figures: {problem.hardware.source}")
    print(f"model figures: {model_source}")
    print(rates)
    if problem.packed is not None:
        print(packed_line(problem))
    fits = "fits" if cost.memory_bytes <= problem.memory_budget_bytes else "does NOT fit"
    print(f"converted from Galvatron's strategy {args.galvatron_config}: {cost.layout.describe()}; "
          f"{cost.time_ms:.1f} ms per iteration, {cost.memory_bytes / GB:.2f} GB per GPU ({fits} "
          f"--memory-budget-gb {args.memory_budget_gb:g})")
    print()
    print("as a Megatron command line:")
    print("  " + command_line(problem, megatron_flags(problem, cost)))
    print()
    _write_outputs(args, problem, build_strategy(problem, cost, model_source), galvatron)
    return 0


if __name__ == "__main__":
    sys.exit(main())
