"""The real GPT at pp=2: Megatron-Core's 1F1B against the DPP runtime's policies, paired batch by
batch, on one corpus (--corpus: the sample corpus, or long-tailed, a synthetic corpus of lognormal
document lengths, benchmarks/long_tailed_corpus.py) laid out as --data says: variable-length
samples, one document each (varlen, --variable-seq-lengths); Megatron's packed windows (packed,
attention crosses documents); the same windows with per-document attention (masked,
--dataloader-inter-document-masking); or whole documents packed without a cut, per-document
attention (whole-masked, + --use-sequence-packing).

Variants: Megatron's 1F1B (the reference, over the same shm_tensor transport), 1f1b-sorted and
dpp:adaptive (the runtime with fused backwards) and dpp:adaptive+W (the same with
--dpp-split-backward), each also under --dpp-memory-budget 1.25x (ending in @1.25x); on the v
placement (--dpp-stage-placement v, two chunks a rank, ending in /v) zb-v (ZB-V's order) and
dpp:adaptive, fused and split; on Megatron's interleaved placement with two chunks a rank (ending
in /vpp2) Megatron's interleaved 1F1B and dpp:adaptive, fused and split; and the same documents
unpacked (one a microbatch, ending in /unpacked: Megatron's 1F1B, dpp:adaptive fused and split),
to set what packing gains beside what the schedules gain (tokens/s; part 2 only); with --data
masked, Megatron's 1F1B on the same windows with attention across documents
(megatron-1f1b/unmasked): what the masking gains. Every rank runs on a core of its own
(benchmarks/pinned_rank.py; OMP_NUM_THREADS=1). Two parts:

1. One process per rank (benchmarks/schedules_in_one_process.py): every variant's forward-backward
   runs on the same batch, one after the other (order rotating from batch to batch), for --batches
   batches, with the same weights (no optimizer step). Reported per variant: its time / the
   reference's on the same batch, the median with its 95% interval over batches; the same for
   dpp:adaptive / 1f1b-sorted; and for the runtime's variants the compute time both ranks spent in
   their tasks, so dpp:adaptive+W / dpp:adaptive of it is what the split itself costs. The variants
   of one batch run seconds apart, so the machine's changes of speed (on shared cores they last
   longer than a training run) fall on all of them alike: this is the figure to quote. The v
   and vpp2 variants build other model chunks (two a rank) and so run in part 2 only.
2. Training runs (--training-rounds, 0 to skip): every variant trains the same model with the same
   seed and data, so iteration i of every run sees the same samples; one run of each per round,
   order rotating; each run's time / the reference's for the same round and iteration (pairs of
   separate runs are only as close as the machine's speed from one run to the next, see
   docs/tracing.md, Overhead). Every run is traced (--trace costs under 1%, docs/tracing.md), and
   every run's tokens/s (the tokens its loss counts: padding excluded, as the log's tokens/s) gives the tokens/s
ratio to the reference per round; from the traces it also reports per variant: the median forward time per rank (the default model is
sized so that a microbatch's forward takes about 20 ms or more on one core: the benchmark then
measures schedules, not Python overhead), the runtime's per-task overhead (the time between a
rank's first and last task that is neither compute nor a wait for a reason outside the runtime:
the transport's send posting and the loop between tasks, per task; a rank's fill and drain are
bubble), and measured time / critical path.
This script reports; it does not judge.

    python benchmarks/real_model_bench.py --json runs/real_model.json   # about 15 minutes here
    python benchmarks/real_model_bench.py --training-rounds 0           # part 1 only, ~5 minutes
    python benchmarks/real_model_bench.py --quick                       # smoke run, five launches
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import long_tailed_corpus
from paired import (PINNED_ENTRY, REPO, describe, ensure_sample_data, median_interval, paired_ratios,
                    run_gpt_with_output, sample_data_args, tokens_per_s)
from schedules_in_one_process import RESULT_PREFIX

sys.path.insert(0, REPO)  # trace_analysis/ (megatron_dpp is installed)

from trace_analysis.analysis import OTHER, POSTING, iteration_time, rank_time, window  # noqa: E402
from trace_analysis.critical_path import critical_path  # noqa: E402
from trace_analysis.load import find_run_directory, load_run  # noqa: E402
from trace_analysis.timeline import run_timeline  # noqa: E402

REFERENCE = "megatron-1f1b"
V_PLACEMENT = ["--use-dpp", "--num-virtual-stages-per-pipeline-rank", "2",
               "--dpp-stage-placement", "v"]
INTERLEAVED = ["--num-virtual-stages-per-pipeline-rank", "2"]
# name -> extra flags. Megatron's 1F1B goes over the same transport as DPP (--p2p-transport auto:
# shm_tensor between the two ranks), so the variants differ in the schedule alone.
VARIANTS: Dict[str, List[str]] = {
    REFERENCE: [],
    "1f1b-sorted": ["--use-dpp", "--dpp-policy", "1f1b-sorted"],
    "dpp:adaptive": ["--use-dpp", "--dpp-policy", "dpp:adaptive"],
    # Every backward split into B and W (docs/dpp_runtime.md, "Split backwards").
    "dpp:adaptive+W": ["--use-dpp", "--dpp-policy", "dpp:adaptive", "--dpp-split-backward"],
    # The same under a memory budget of 1.25 x 1F1B's fullest rank on every rank
    # (--dpp-memory-budget 1.25x): what memory headroom itself gains.
    "dpp:adaptive@1.25x": ["--use-dpp", "--dpp-policy", "dpp:adaptive", "--dpp-memory-budget",
                           "1.25x"],
    "dpp:adaptive+W@1.25x": ["--use-dpp", "--dpp-policy", "dpp:adaptive", "--dpp-split-backward",
                             "--dpp-memory-budget", "1.25x"],
    # The v placement (docs/scheduling.md, "Running the v placement"): 4 stages of one layer each.
    "zb-v/v": [*V_PLACEMENT, "--dpp-policy", "zb-v"],
    "zb-v+W/v": [*V_PLACEMENT, "--dpp-policy", "zb-v", "--dpp-split-backward"],
    "dpp:adaptive/v": [*V_PLACEMENT, "--dpp-policy", "dpp:adaptive"],
    "dpp:adaptive+W/v": [*V_PLACEMENT, "--dpp-policy", "dpp:adaptive", "--dpp-split-backward"],
    # Megatron's interleaved placement, two chunks a rank (stage = chunk * 2 + rank): Megatron's
    # interleaved 1F1B, a user's other choice, and dpp:adaptive on it, fused and split.
    "interleaved-1f1b/vpp2": [*INTERLEAVED],
    "dpp:adaptive/vpp2": [*INTERLEAVED, "--use-dpp", "--dpp-policy", "dpp:adaptive"],
    "dpp:adaptive+W/vpp2": [*INTERLEAVED, "--use-dpp", "--dpp-policy", "dpp:adaptive",
                            "--dpp-split-backward"],
    # The same documents unpacked, one a microbatch (--variable-seq-lengths), whatever --data is:
    # what packing itself gains, beside the schedules (tokens/s).
    "megatron-1f1b/unpacked": [],
    "dpp:adaptive/unpacked": ["--use-dpp", "--dpp-policy", "dpp:adaptive"],
    "dpp:adaptive+W/unpacked": ["--use-dpp", "--dpp-policy", "dpp:adaptive", "--dpp-split-backward"],
    # The same windows with attention across documents (--data masked only): what the masking
    # itself gains.
    "megatron-1f1b/unmasked": [],
}
UNPACKED_SUFFIX = "/unpacked"
UNMASKED_SUFFIX = "/unmasked"
# A variant ending in one of these runs this --data whatever --data is.
SUFFIX_DATA = {UNPACKED_SUFFIX: "varlen", UNMASKED_SUFFIX: "packed"}
# --data: how documents become samples. Megatron's windows cut documents at window boundaries;
# whole-document packing (--use-sequence-packing) keeps each whole and pads the window.
DATA_FLAGS: Dict[str, List[str]] = {
    "varlen": ["--variable-seq-lengths"],
    "packed": [],
    "masked": ["--dataloader-inter-document-masking"],
    "whole-masked": ["--use-sequence-packing", "--dataloader-inter-document-masking"],
}
DATA_WORDS = {"varlen": "variable lengths", "packed": "packed windows",
              "masked": "packed windows, per-document attention",
              "whole-masked": "whole documents packed, per-document attention"}
CORPORA = ("sample", "long-tailed")
DEFAULT_VARIANTS = [REFERENCE, "1f1b-sorted", "dpp:adaptive", "dpp:adaptive+W", "zb-v+W/v",
                    "dpp:adaptive+W/v"]
# Part 1 shares one model between its variants: those that build other chunks run in part 2 only.
OTHER_CHUNKS_FLAG = "--num-virtual-stages-per-pipeline-rank"


def one_process_variants(variants: List[str]) -> List[str]:
    """Those that share part 1's model and batches: not the v ones (other chunks), not the
    unpacked or unmasked ones (other batches)."""
    return [name for name in variants
            if OTHER_CHUNKS_FLAG not in VARIANTS[name] and variant_data(name) is None]


def variant_data(name: str) -> Optional[str]:
    """The --data a variant runs whatever --data is (its suffix's), or None."""
    return next((data for suffix, data in SUFFIX_DATA.items() if name.endswith(suffix)), None)


ONE_PROCESS_ENTRY = (os.path.join(REPO, "benchmarks", "schedules_in_one_process.py"),)
FUSED, SPLIT = "dpp:adaptive", "dpp:adaptive+W"  # the split's own cost: SPLIT's compute / FUSED's
SORTED = "1f1b-sorted"


def gpt_flags(args: argparse.Namespace, trace_dir: Optional[str] = None,
              train_iters: Optional[int] = None, variant: Optional[str] = None) -> List[str]:
    """pretrain_gpt's flags for `variant` (its data: --data's, or its suffix's: unpacked for the
    /unpacked ones, attention across documents for the /unmasked ones); traced into `trace_dir`
    if given; --train-iters: `train_iters`, else --iters (it also
    sizes the data loader: one batch per iteration)."""
    data = (variant_data(variant) if variant else None) or args.data
    return [*sample_data_args(args.data_prefix),
            "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", str(args.attention_heads),
            "--ffn-hidden-size", str(4 * args.hidden_size),
            "--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length),
            "--micro-batch-size", "1", "--global-batch-size", str(args.microbatches),
            "--train-iters", str(train_iters or args.iters), "--lr", "1e-3", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--seed", "1234", "--log-interval", "1", "--eval-iters", "0",
            "--pipeline-model-parallel-size", "2",
            *DATA_FLAGS[data],
            *layout_flags(args, variant),
            *(["--trace", "--trace-dir", trace_dir] if trace_dir else []),
            *(variant_flags(args, variant) if variant else [])]


def layout_flags(args: argparse.Namespace, variant: Optional[str]) -> List[str]:
    """--pipeline-model-parallel-layout for `variant` (part 1's variants: one chunk a rank):
    --chunked-layout for those with two chunks a rank, --layout for the rest."""
    chunked = variant is not None and OTHER_CHUNKS_FLAG in VARIANTS[variant]
    layout = args.chunked_layout if chunked else args.layout
    return ["--pipeline-model-parallel-layout", layout] if layout else []


def variant_flags(args: argparse.Namespace, variant: str) -> List[str]:
    """VARIANTS[variant]; under --chunked-layout without the virtual-stage count, which the
    layout string gives (Megatron-LM refuses both)."""
    flags = VARIANTS[variant]
    if args.chunked_layout and OTHER_CHUNKS_FLAG in flags:
        at = flags.index(OTHER_CHUNKS_FLAG)
        flags = flags[:at] + flags[at + 2:]
    return list(flags)


def ratio_summary(mine: List[float], theirs: List[float]) -> dict:
    """mine[i] / theirs[i] over paired batches: median, quartiles and the median's 95% interval."""
    ratios = [a / b for a, b in zip(mine, theirs)]
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    low, high = median_interval(ratios)
    return {"median": statistics.median(ratios), "q1": quartiles[0], "q3": quartiles[2],
            "interval_95": [low, high], "pairs": len(ratios), "ratios": ratios}


def describe_ratio(summary: dict) -> str:
    low, high = summary["interval_95"]
    return (f"median {summary['median']:.3f} (95% interval {low:.3f}-{high:.3f}, quartiles "
            f"{summary['q1']:.3f}-{summary['q3']:.3f}, {summary['pairs']} batches)")


def run_one_process(args: argparse.Namespace) -> dict:
    """Part 1: every variant on the same batches in one process per rank; the raw result of
    schedules_in_one_process.py."""
    flags = gpt_flags(args, train_iters=args.batches)
    variants = {name: VARIANTS[name] for name in one_process_variants(args.variants)}
    _times, output = run_gpt_with_output(
        flags, 0, args.timeout * 2, "one-process", entry=ONE_PROCESS_ENTRY,
        extra_env={"VARIANTS": json.dumps(variants), "BATCHES": str(args.batches)})
    lines = [line for line in output.splitlines() if line.startswith(RESULT_PREFIX)]
    if len(lines) != 1:
        raise RuntimeError(f"the one-process run printed no result:\n{output[-3000:]}")
    return json.loads(lines[0][len(RESULT_PREFIX):])


def summarize_one_process(result: dict, skip: int) -> dict:
    times = {name: values[skip:] for name, values in result["times_ms"].items()}
    summary = {name: {"median_ms": statistics.median(values),
                      "ratio_to_reference": ratio_summary(values, times[REFERENCE])}
               for name, values in times.items()}
    if FUSED in times and SORTED in times:
        summary[FUSED]["ratio_to_sorted"] = ratio_summary(times[FUSED], times[SORTED])
    busy = {name: [sum(sum(kinds.values()) for kinds in per_rank) for per_rank in values[skip:]]
            for name, values in result["busy_ms"].items() if values[0] is not None}
    for name, values in busy.items():
        summary[name]["compute_ms"] = statistics.median(values)
        # Per task kind, summed over both ranks (median over batches).
        kinds = sorted({kind for per_rank in result["busy_ms"][name] for rank in per_rank
                        for kind in rank})
        summary[name]["compute_ms_by_kind"] = {
            kind: statistics.median(sum(rank.get(kind, 0.0) for rank in per_rank)
                                    for per_rank in result["busy_ms"][name][skip:])
            for kind in kinds}
    if FUSED in busy and SPLIT in busy:
        summary[SPLIT]["compute_ratio_to_fused"] = ratio_summary(busy[SPLIT], busy[FUSED])
    return summary


def run_tokens_per_s(run_ms: List[float], run_rates: List[float], skip: int) -> float:
    """A run's tokens/s over its iterations after the first `skip`: their tokens / their time."""
    tokens = sum(ms * rate / 1000.0 for ms, rate in zip(run_ms[skip:], run_rates[skip:]))
    return tokens / (sum(run_ms[skip:]) / 1000.0)


def tokens_summary(times: List[List[float]], rates: List[List[float]], reference_times,
                   reference_rates, skip: int) -> dict:
    """Tokens/s (the loss's tokens: padding left out): the median over runs, and each round's
    ratio to the reference's run of that round (runs of other data are paired by round, not by
    iteration: their iterations hold other tokens)."""
    mine = [run_tokens_per_s(t, r, skip) for t, r in zip(times, rates)]
    theirs = [run_tokens_per_s(t, r, skip) for t, r in zip(reference_times, reference_rates)]
    ratios = [a / b for a, b in zip(mine, theirs)]
    return {"tokens_per_s": statistics.median(mine), "tokens_ratio": statistics.median(ratios),
            "tokens_ratio_range": [min(ratios), max(ratios)], "tokens_ratios": ratios}


def trace_stats(trace_dir: str, skip: int) -> dict:
    """From one run's traces, over its iterations after the first `skip`: the median forward per
    rank, the per-task overhead and measured time / critical path."""
    run_directory, _ = find_run_directory(Path(trace_dir))
    run = run_timeline(load_run(run_directory))
    chosen = [i for i in run.training_iterations if i >= skip]
    times = [iteration_time(run, i) for i in chosen]
    paths = [critical_path(run, i) for i in chosen]
    tasks = sum(len(rank.tasks_of(i)) for rank in run.ranks for i in chosen)
    # Per task, over each rank's own span (its first task's start to its last task's end): before
    # and after it a rank is in the pipeline's fill or drain, or already in the step's collectives,
    # outside the runtime's loop: bubble, not a cost of its tasks.
    own = [rank_time(rank, i, *window(run, i, [rank])) for rank in run.ranks for i in chosen]
    overhead_us = sum(r.idle[POSTING] + r.idle[OTHER] for r in own)
    posting_us = sum(r.idle[POSTING] for r in own)
    return {
        "forward_ms": [statistics.median(t.duration for t in rank.tasks if t.phase == "F"
                                         and t.iteration in chosen) / 1000.0 for rank in run.ranks],
        "per_task_overhead_ms": overhead_us / tasks / 1000.0,
        "per_task_send_posting_ms": posting_us / tasks / 1000.0,
        "time_over_critical_path": statistics.mean(it.duration / p.length for it, p in zip(times, paths)),
        "bubble": statistics.mean(it.bubble for it in times),
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS),
                        help=f"Variants to run (default {' '.join(DEFAULT_VARIANTS)}); {REFERENCE} "
                             f"(the reference) is always among them.")
    parser.add_argument("--data", choices=list(DATA_FLAGS), default="varlen",
                        help="varlen (default): one document per sample, up to --seq-length tokens "
                             "(--variable-seq-lengths); packed: Megatron's GPT dataset, windows of "
                             "exactly --seq-length tokens, attention across documents; masked: the "
                             "same windows with --dataloader-inter-document-masking (attention inside "
                             "each document); whole-masked: --use-sequence-packing (whole documents, "
                             "padded windows) with the masking. The /unpacked variants run varlen, "
                             "the /unmasked one packed, "
                             "whatever this is.")
    parser.add_argument("--corpus", choices=CORPORA, default="sample",
                        help="sample (default): the sample corpus (short documents: median 51 "
                             "tokens); long-tailed: benchmarks/long_tailed_corpus.py's (lognormal "
                             "lengths, mean 512, cv 1.5, same tokenizer), made on first use.")
    parser.add_argument("--batches", type=int, default=30,
                        help="Part 1: batches every variant runs on, in one process (default 30).")
    parser.add_argument("--batch-skip", type=int, default=2,
                        help="Part 1: first batches left out as warm-up (default 2).")
    parser.add_argument("--training-rounds", "--rounds", dest="rounds", type=int, default=5,
                        help="Part 2: rounds of training runs, each runs every variant once "
                             "(default 5; 0 skips part 2).")
    parser.add_argument("--iters", type=int, default=12,
                        help="Part 2: iterations per training run (default 12).")
    parser.add_argument("--skip", type=int, default=2,
                        help="Part 2: first iterations of every run left out as warm-up (default 2).")
    parser.add_argument("--microbatches", type=int, default=8,
                        help="Microbatches per iteration, one sample each (default 8).")
    parser.add_argument("--seq-length", type=int, default=512, help="Longest sample (default 512).")
    parser.add_argument("--hidden-size", type=int, default=768, help="Hidden size (default 768).")
    parser.add_argument("--attention-heads", type=int, default=12, help="Attention heads (default 12).")
    parser.add_argument("--num-layers", type=int, default=4,
                        help="Transformer layers, split evenly over the 2 stages (default 4).")
    parser.add_argument("--layout", default=None,
                        help="Megatron-LM's --pipeline-model-parallel-layout for the variants with "
                             "one chunk a rank (2 stages, e.g. 'Ettt|tL': 3 layers and the "
                             "embedding on rank 0, 1 and the output layer on rank 1); default: "
                             "the even split.")
    parser.add_argument("--chunked-layout", default=None,
                        help="The same for the variants with two chunks a rank (/v, /vpp2): 4 "
                             "stages in pipeline order, e.g. 'Et|tt|t|L' (on the v, stages 0 and "
                             "3 are rank 0's); default: one layer a stage.")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="Seconds one run may take before it is killed (default 900).")
    parser.add_argument("--quick", action="store_true",
                        help="Smoke run: 3 batches (skip 1) in one process, 1 round of 3 training "
                             "iterations (skip 1), 4 microbatches of up to 64 tokens, hidden size "
                             "64, 4 layers.")
    parser.add_argument("--json", type=str, default=None,
                        help="Write the settings, every run's iteration times and trace figures, and "
                             "the summary here.")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.iters, args.skip, args.microbatches = min(args.rounds, 1), 3, 1, 4
        args.batches, args.batch_skip = 3, 1
        args.seq_length, args.hidden_size, args.attention_heads, args.num_layers = 64, 64, 4, 4
    if REFERENCE not in args.variants:
        args.variants = [REFERENCE, *args.variants]
    if min(args.iters, args.microbatches, args.batches) < 1 or args.rounds < 0 or args.seq_length < 8:
        parser.error("--batches, --iters and --microbatches must be positive, --training-rounds "
                     ">= 0, --seq-length >= 8")
    if not 0 <= args.batch_skip < args.batches:
        parser.error(f"--batch-skip must be in [0, --batches {args.batches})")
    if not 0 <= args.skip < args.iters:
        parser.error(f"--skip must be in [0, --iters {args.iters})")
    if (any(OTHER_CHUNKS_FLAG in VARIANTS[name] for name in args.variants) and args.num_layers % 4
            and not args.chunked_layout):
        parser.error("the /v and /vpp2 variants split --num-layers over 4 stages (2 ranks x 2 "
                     "chunks): give a multiple of 4, or --chunked-layout")
    if args.data == "varlen" and any(name.endswith(UNPACKED_SUFFIX) for name in args.variants):
        parser.error("the /unpacked variants are there to compare with packed data: give --data "
                     "packed, masked or whole-masked")
    if args.data != "masked" and any(name.endswith(UNMASKED_SUFFIX) for name in args.variants):
        parser.error("the /unmasked variants are --data masked's windows without the masking: "
                     "give --data masked")
    if args.hidden_size % args.attention_heads:
        parser.error("--hidden-size must be divisible by --attention-heads")
    for flag, layout, stages in (("--layout", args.layout, 2),
                                 ("--chunked-layout", args.chunked_layout, 4)):
        problem = layout_problem(layout, stages, args.num_layers) if layout else None
        if problem:
            parser.error(f"{flag} {layout!r}: {problem}")
    if args.num_layers % 2 and not args.layout:
        parser.error("--num-layers must be even (2 stages), or give --layout")
    return args


def layout_problem(layout: str, stages: int, num_layers: int) -> Optional[str]:
    """Why `layout` (Megatron-LM's layout string) cannot split num_layers over `stages`, or None."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    try:
        parsed = PipelineParallelLayerLayout.parse_str_to_list(layout)
    except Exception as error:  # Megatron's parser raises several kinds on a malformed string
        return f"not a layout string ({error})"
    if len(parsed) != stages:
        return f"{len(parsed)} stages, these variants have {stages}"
    layers = sum(stage.count(LayerType.decoder) for stage in parsed)
    if layers != num_layers:
        return f"{layers} transformer layers, --num-layers is {num_layers}"
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    ensure_sample_data(args.timeout)
    args.data_prefix = (long_tailed_corpus.write_corpus(long_tailed_corpus.DEFAULT_OUTPUT_DIR,
                                                       **long_tailed_corpus.DEFAULTS)
                        if args.corpus == "long-tailed" else None)
    times: Dict[str, List[List[float]]] = {name: [] for name in args.variants}
    rates: Dict[str, List[List[float]]] = {name: [] for name in args.variants}
    stats: Dict[str, List[dict]] = {name: [] for name in args.variants}
    started = time.time()
    print(f"real GPT pp=2, {DATA_WORDS[args.data]} of the {args.corpus} corpus (hidden "
          f"{args.hidden_size}, {args.num_layers} layers, {args.microbatches} microbatches of up to "
          f"{args.seq_length} tokens), one core per rank")
    for flag, layout in (("layout", args.layout), ("chunked layout", args.chunked_layout)):
        if layout:
            print(f"{flag} {layout}")
    one_process = run_one_process(args)
    one_summary = summarize_one_process(one_process, args.batch_skip)
    print(f"part 1, one process: every variant on the same {args.batches} batches (first "
          f"{args.batch_skip} left out), same weights")
    for name in one_process_variants(args.variants):
        row = one_summary[name]
        compute = ""
        if "compute_ms" in row:
            by_kind = ", ".join(f"{kind} {ms:.1f}" for kind, ms in row["compute_ms_by_kind"].items())
            compute = f"; compute {row['compute_ms']:.1f} ms (both ranks: {by_kind})"
        print(f"  {name:14s} median {row['median_ms']:.1f} ms per forward-backward{compute}")
        if name != REFERENCE:
            print(f"  {'':14s} / {REFERENCE}: {describe_ratio(row['ratio_to_reference'])}")
        if "ratio_to_sorted" in row:
            print(f"  {'':14s} / {SORTED}: {describe_ratio(row['ratio_to_sorted'])}")
        if "compute_ratio_to_fused" in row:
            print(f"  {'':14s} compute / {FUSED}'s: {describe_ratio(row['compute_ratio_to_fused'])}")
    scratch = tempfile.mkdtemp(prefix="real_model_bench-")
    try:
        for round_index in range(args.rounds):
            shift = round_index % len(args.variants)
            order = args.variants[shift:] + args.variants[:shift]
            for name in order:
                trace_dir = os.path.join(scratch, f"{name.replace(':', '-')}-round{round_index}")
                run_times, output = run_gpt_with_output(gpt_flags(args, trace_dir, variant=name),
                                                        args.iters, args.timeout, name,
                                                        entry=PINNED_ENTRY)
                times[name].append(run_times)
                rates[name].append(tokens_per_s(output, args.iters))
                stats[name].append(trace_stats(trace_dir, args.skip))
            print(f"round {round_index + 1}/{args.rounds} ({', '.join(order)}): median ms "
                  + ", ".join(f"{name} {statistics.median(times[name][-1][args.skip:]):.1f}"
                              for name in args.variants), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    summary = {}
    if args.rounds:
        print(f"part 2, training runs: {args.rounds} rounds x {args.iters} iterations, the first "
              f"{args.skip} of each run left out")
    for name in (args.variants if args.rounds else []):
        runs = stats[name]
        summary[name] = {
            "median_ms": statistics.median(t for run in times[name] for t in run[args.skip:]),
            "ratio_to_reference": paired_ratios(times[name], times[REFERENCE], args.skip),
            "forward_ms": [statistics.median(run["forward_ms"][rank] for run in runs) for rank in range(2)],
            "per_task_overhead_ms": statistics.median(run["per_task_overhead_ms"] for run in runs),
            "per_task_send_posting_ms": statistics.median(run["per_task_send_posting_ms"] for run in runs),
            "time_over_critical_path": statistics.median(run["time_over_critical_path"] for run in runs),
            "bubble": statistics.median(run["bubble"] for run in runs),
            **tokens_summary(times[name], rates[name], times[REFERENCE], rates[REFERENCE], args.skip),
        }
        row = summary[name]
        print(f"  {name:14s} median {row['median_ms']:.1f} ms/iteration; forward (median) rank 0 "
              f"{row['forward_ms'][0]:.1f} ms, rank 1 {row['forward_ms'][1]:.1f} ms; per-task overhead "
              f"{row['per_task_overhead_ms']:.2f} ms (send posting {row['per_task_send_posting_ms']:.2f}); "
              f"time / critical path {row['time_over_critical_path']:.2f}; bubble {100 * row['bubble']:.1f}%")
        low, high = row["tokens_ratio_range"]
        print(f"  {'':14s} {row['tokens_per_s']:.1f} tokens/s; / {REFERENCE}'s: "
              f"{row['tokens_ratio']:.3f} (rounds {low:.3f}-{high:.3f})")
        if name != REFERENCE and not name.endswith(UNPACKED_SUFFIX):
            print(f"  {'':14s} / {REFERENCE}: {describe(row['ratio_to_reference'])}")
    print(f"({time.time() - started:.0f} s)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        settings = {key: getattr(args, key) for key in
                    ("variants", "data", "corpus", "batches", "batch_skip", "rounds", "iters", "skip",
                     "microbatches",
                     "seq_length", "hidden_size", "attention_heads", "num_layers", "layout",
                     "chunked_layout", "quick")}
        with open(args.json, "w") as f:
            json.dump({"settings": settings, "reference": REFERENCE,
                       "one_process": {"summary": one_summary, **one_process},
                       "summary": summary, "times_ms": times, "tokens_per_s": rates,
                       "trace_stats": stats}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
