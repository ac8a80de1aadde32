"""At scale, by simulation: Megatron's pipeline schedules against dpp:adaptive (with and without
split backwards, W), and on ZB-V's v placement zb-v and dpp:adaptive, for GPT-3 13B and 175B on the
8xH100-nvlink-ib400 preset, priced by the strategy search's cost model
(megatron_dpp/search/cost.py) and run through the simulator (megatron_dpp/sim), the same schedulers
the runtime runs.

Per row group (model, pp, vpp, length distribution), one layout: micro-batch 1, M = 4 x pp
microbatches per iteration (--microbatches-per-stage), DP 1, the model's TP (below), selective
recompute, sequence parallelism off (--dpp-split-backward refuses it, so every schedule of a group
runs the same layout). Schedules: Megatron's order (1f1b; interleaved-1f1b where vpp > 1),
dpp:adaptive, dpp:adaptive+W, all at the 'auto' memory budget (rank r holds at most what Megatron's
order holds there, counted at full-length microbatches; with W each microbatch also counts what its
W keeps from B to W). Where vpp is 2 (two chunks a rank divide the layers) the group also runs the
same layout on the v placement (--dpp-stage-placement v): zb-v, zb-v+W (ZB-V's order, fused or
split backwards), dpp:adaptive/v and dpp:adaptive+W/v, at the 'auto' budget of the v (what ZB-V's
order holds on the rank); their ratios are to the group's Megatron row (interleaved-1f1b). On the
v rank 0 holds the embedding, the output layer and the loss (no tied-embedding all-reduce between
stages), and the turn at rank pp-1 sends no message.

Task times: the cost model without a model profile: each layer's forward FLOPs
(memory_model.layer_forward_flops, the attention's s^2 term included) at the preset's nominal bf16
rate, backward 2x plus the recomputed attention, two tensor-parallel all-reduces each way; the last
stage's output layer (2 x tokens x hidden x vocab, 3x with its backward) as its rank speed; a
split backward's W is half the backward compute. A microbatch of length l takes its own layer
time at l. Messages: one per microbatch and hop, micro-batch x length x hidden bf16 values per
tensor-parallel rank, at the slowest hop of the pipeline (the simulator prices every hop alike; the
v's hops, r to r+1 and back, cross the same links as the interleaved's, so it has the same slowest):
on one node the CUDA IPC figures measured for shm_tensor on one H100 (../shared/gpu/README.md),
between nodes the preset's InfiniBand figures.

Length distributions: uniform (every sample full length), sample (the sample corpus's document
lengths as the runtime cuts them at --seq-length 512, the pp=2 CPU benchmark's setting, scaled by
seq/512: the same distribution relative to the longest sample), longtail (lognormal, mean 512,
CV 1.0, clipped to 1..2048). Packed long context (issue 60): packed8k and packed32k, windows of
8192 and 32768 tokens (the layout's --seq-length, messages and memory at that length) cut from one
stream of lognormal documents, mean 2048, CV 1.5 (megatron_dpp/sim/workloads.py's DOCUMENT_MEAN,
DOCUMENT_CV), attention per document: the search's --packed-document-distribution pricing
(cost.py: each window's size is its forward, the linear part plus the attention of its documents'
sum of s_i^2, over a full window's; act_bytes the window's). Their memory is the fullest rank's at
the window; a layout over 80 GB is priced and its row says so (GB column "no", "fits_memory":
false). Variable distributions run --batches sampled batches, packed ones --packed-batches (seeds
0..N-1); every schedule of one batch sees the same lengths; ratios are per batch, then averaged.

The pp=2 overlap: the same projection of the CPU model of benchmarks/real_model_bench.py (hidden
768, 4 layers, 12 heads, FFN 3072, fp32, the sample tokenizer's vocabulary, samples of up to 512
tokens, micro-batch 1, global batch 8), beside the ratios that benchmark measured (quoted from
docs/results.md, "The real model").

    python benchmarks/scale_projection.py                       # the full table, ~95 s here (2 cores)
    python benchmarks/scale_projection.py --json runs/scale_projection.json
    python benchmarks/scale_projection.py --quick --json        # seconds; JSON on stdout
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import struct
import subprocess
import sys
import time

import numpy as np

from megatron_dpp.pipeline.placement import INTERLEAVED, V_SHAPE
from megatron_dpp.search import cost, memory_model
from megatron_dpp.search.hardware import GB, H100_NODE, HardwareProfile, load_hardware
from megatron_dpp.search.lengths import LengthDistribution, microbatch_documents, parse_distribution
from megatron_dpp.search.space import Layout, megatron_schedule
from megatron_dpp.sim import CommModel
from megatron_dpp.sim.workloads import DOCUMENT_CV, DOCUMENT_MEAN

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE_PREFIX = os.path.join(REPO, "data", "sample", "sample_text_document")

PRESET = "8xH100-nvlink-ib400"
GPUS_PER_NODE = H100_NODE.max_gpus_per_node  # the preset's node: 8 GPUs
# H100 SXM5 80 GB (NVIDIA H100 datasheet), the memory the search's 175B case budgets
# (benchmarks/strategy_search_bench.py: --memory-budget-gb 80).
GPU_MEMORY_BYTES = 80 * GB
SEQ_LENGTH = 2048
# GPT-2's BPE (50257) padded as Megatron pads it; the vocabulary of the search's 175B case
# (benchmarks/strategy_search_bench.py).
VOCAB = 51200
# Selective recompute (Korthikanti et al. 2022; Megatron-LM's --recompute-activations): core
# attention is recomputed, so no s^2 activations are kept.
RECOMPUTE = "selective"


@dataclasses.dataclass(frozen=True)
class ModelCase:
    name: str
    num_layers: int
    hidden_size: int
    heads: int
    tp: int  # tensor parallel size, inside one node
    tp_reason: str


# GPT-3 shapes (Brown et al. 2020, Table 2.1). TP: the reasons are checked by the assumptions'
# memory table (`memory_by_tp`), which prices the fullest rank at every TP inside a node.
MODELS = {
    "13B": ModelCase("13B", 40, 5120, 40, 2, "the smallest TP at which every schedule fits 80 GB "
                                            "at pp 4 and 8"),
    "175B": ModelCase("175B", 96, 12288, 96, 8, "a node per stage, the only TP at which any of "
                                              "these layouts fits 80 GB"),
}
TP_CHOICES = (1, 2, 4, 8)  # tensor parallelism stays inside a node of 8
PIPELINE_SIZES = (4, 8, 16)
DISTRIBUTIONS = ("uniform", "sample", "longtail", "packed8k", "packed32k")
LONGTAIL_SPEC = "lognormal:512:1.0"
# Packed long context: name -> window (the layout's --seq-length); documents lognormal with the
# simulator's packed-workload defaults (sim/workloads.py), attention per document.
PACKED_WINDOWS = {"packed8k": 8192, "packed32k": 32768}
PACKED_SPEC = f"lognormal:{DOCUMENT_MEAN:g}:{DOCUMENT_CV:g}"
SAMPLE_CUT = 512  # the pp=2 CPU benchmark's --seq-length (benchmarks/real_model_bench.py)

# shm_tensor's CUDA IPC one-way times on one H100 (../shared/gpu/README.md): 260-356 us from 4 KiB
# to 16 MiB (one run 705 us at 4 KiB), 477-502 us at 64 MiB. Priced as latency + bytes / bandwidth
# through the smallest measured time (260 us) and the slower 64 MiB figure (502 us).
IPC_LATENCY_US = 260.0
IPC_64MIB_US = 502.0
MIB = 1 << 20

# Schedules of a row group: (name shown, registry policy or None for Megatron's, split backward,
# stage placement).
SCHEDULES = (("megatron", None, False, INTERLEAVED), ("dpp:adaptive", "dpp:adaptive", False, INTERLEAVED),
             ("dpp:adaptive+W", "dpp:adaptive", True, INTERLEAVED))
# With two chunks a rank: the same layout on the v placement (named so that the placement shows).
V_SCHEDULES = (("zb-v", "zb-v", False, V_SHAPE), ("zb-v+W", "zb-v", True, V_SHAPE),
               ("dpp:adaptive/v", "dpp:adaptive", False, V_SHAPE),
               ("dpp:adaptive+W/v", "dpp:adaptive", True, V_SHAPE))

# --- the pp=2 CPU overlap: benchmarks/real_model_bench.py's model --------------------------------
CPU_SHAPE = dict(num_layers=4, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072,
                 seq_length=512, padded_vocab_size=4096, dtype="fp32",
                 hidden_dropout=0.0, attention_dropout=0.0)  # sample tokenizer: 4096 tokens
CPU_MICROBATCHES = 8
# docs/results.md, "The real model", part 1, run 2: compute of both ranks per batch (median over
# 28 batches): forwards 538 ms. The CPU matmul rate below is fitted to it (see cpu_matmul_gflops).
CPU_FORWARD_COMPUTE_MS = 538.0
# docs/search.md ("Predictions against measured runs"): p2p (shm_tensor) latency 0.027 ms;
# README.md: shm_tensor 1 MiB messages 18.0 GB/s.
CPU_P2P_LATENCY_MS, CPU_P2P_GBPS = 0.027, 18.0
CPU_SCHEDULES = (("1f1b", "1f1b", False, INTERLEAVED), ("1f1b-sorted", "1f1b-sorted", False, INTERLEAVED),
                 ("dpp:adaptive", "dpp:adaptive", False, INTERLEAVED),
                 ("dpp:adaptive+W", "dpp:adaptive", True, INTERLEAVED))
# Measured, docs/results.md "The real model" (commands there): part 1 (one process, paired by
# batch, median time / Megatron 1F1B, runs 1 and 2) and part 2 (training runs: median ratio, bubble).
CPU_MEASURED = {
    "command_part1": "python benchmarks/real_model_bench.py --training-rounds 0",
    "command_part2": "python benchmarks/real_model_bench.py --json runs/real_model.json",
    "1f1b": {"part1": [1.0, 1.0], "part2": 1.0, "bubble": 0.273},
    "1f1b-sorted": {"part1": [0.886, 0.884], "part2": 0.914, "bubble": 0.190},
    "dpp:adaptive": {"part1": [0.846, 0.855], "part2": 0.842, "bubble": 0.125},
    "dpp:adaptive+W": {"part1": [0.806, 0.838], "part2": 0.793, "bubble": 0.096},
}


# --------------------------------------------------------------------------------------------
# length distributions
# --------------------------------------------------------------------------------------------
def read_document_lengths(prefix: str) -> np.ndarray:
    """Token count of every document of a Megatron indexed dataset (its .idx: a 9-byte header,
    version, dtype code, sequence and document counts, then int32 sequence lengths)."""
    with open(prefix + ".idx", "rb") as stream:
        if stream.read(9) != b"MMIDIDX\x00\x00":
            raise SystemExit(f"{prefix}.idx is not a Megatron indexed dataset")
        stream.read(8 + 1)  # version, dtype code
        count = struct.unpack("<Q", stream.read(8))[0]
        stream.read(8)  # document count
        return np.frombuffer(stream.read(4 * count), dtype=np.int32).astype(int)


def ensure_sample_data(prefix: str) -> None:
    """Make the sample data (offline, ~10 s) when the default prefix is missing."""
    if os.path.isfile(prefix + ".idx"):
        return
    if prefix != SAMPLE_PREFIX:
        raise SystemExit(f"--sample-data {prefix}: no {prefix}.idx")
    subprocess.run([sys.executable, "-m", "megatron_dpp.data.prepare_sample", "--output-dir",
                    os.path.dirname(prefix), "--no-progress"], check=True, cwd=REPO,
                   stdout=subprocess.DEVNULL)


def sample_lengths(prefix: str, cut: int, seq_length: int) -> tuple[int, ...]:
    """Sample lengths as the runtime gives them at --seq-length `cut` (one document per sample,
    tokens = min(document - 1, cut): one token is the last label), scaled to `seq_length`."""
    tokens = np.minimum(read_document_lengths(prefix) - 1, cut)
    tokens = tokens[tokens >= 1]
    return tuple(int(round(t * seq_length / cut)) for t in tokens)


@dataclasses.dataclass(frozen=True)
class PackedData:
    """Full windows of `window` tokens packed from `documents`, attention per document."""

    window: int
    documents: LengthDistribution


def make_distributions(names, sample_prefix: str, seq_length: int) -> dict:
    """name -> (LengthDistribution, PackedData, or None for uniform; one line describing it)."""
    made = {}
    for name in names:
        if name in PACKED_WINDOWS:
            window = PACKED_WINDOWS[name]
            made[name] = (PackedData(window, parse_distribution(PACKED_SPEC)),
                          f"windows of {window} tokens cut from one stream of {PACKED_SPEC} documents "
                          f"(mean {DOCUMENT_MEAN:g}, CV {DOCUMENT_CV:g}: sim/workloads.py's "
                          f"DOCUMENT_MEAN, DOCUMENT_CV), attention per document (the search's "
                          f"--packed-document-distribution); --seq-length, messages and memory at "
                          f"{window}")
        elif name == "uniform":
            made[name] = (None, f"every sample {seq_length} tokens")
        elif name == "sample":
            ensure_sample_data(sample_prefix)
            values = sample_lengths(sample_prefix, SAMPLE_CUT, seq_length)
            scale = seq_length // SAMPLE_CUT
            made[name] = (LengthDistribution("sample", "file", values=values),
                          f"sample corpus documents cut at {SAMPLE_CUT} tokens, x{scale}: "
                          f"{len(values)} lengths, mean {statistics.fmean(values):.0f}, median "
                          f"{statistics.median(values):.0f}, CV "
                          f"{statistics.pstdev(values) / statistics.fmean(values):.2f}, "
                          f"{sum(v == seq_length for v in values) / len(values):.1%} at {seq_length}")
        else:
            distribution = parse_distribution(LONGTAIL_SPEC)
            made[name] = (distribution, f"{LONGTAIL_SPEC}: lognormal, mean 512, CV 1.0 (sigma "
                                        f"{math.sqrt(math.log(2.0)):.3f}), clipped to 1..{seq_length}")
    return made


# --------------------------------------------------------------------------------------------
# messages
# --------------------------------------------------------------------------------------------
def ipc_hop(latency_us: float, at_64mib_us: float) -> tuple[float, float]:
    """(latency ms, GB/s) of shm_tensor's CUDA IPC path: a line through (0, latency) and
    (64 MiB, at_64mib_us)."""
    return latency_us / 1e3, 64 * MIB / ((at_64mib_us - latency_us) * 1e-6) / GB


def pipeline_hops(pp: int, vpp: int, tp: int) -> list[bool]:
    """For each hop between neighbouring stages (and last -> first with vpp > 1): does it cross
    nodes? Stage r holds GPUs r*tp .. r*tp + tp - 1 (DP 1; Megatron's order, TP innermost)."""
    pairs = [(r, r + 1) for r in range(pp - 1)] + ([(pp - 1, 0)] if vpp > 1 else [])
    return [(a * tp) // GPUS_PER_NODE != (b * tp) // GPUS_PER_NODE for a, b in pairs]


def slowest_hop(message_bytes: int, crossings: list[bool], ipc: tuple[float, float],
                network: tuple[float, float]) -> dict:
    """The pipeline's slowest hop for one message: kind, latency ms, GB/s, ms."""
    kinds = {"CUDA IPC (on node)": ipc} if not all(crossings) else {}
    if any(crossings):
        kinds["InfiniBand (preset)"] = network
    priced = {kind: latency + message_bytes / (gbps * GB) * 1e3 for kind, (latency, gbps) in kinds.items()}
    kind = max(priced, key=priced.get)
    return {"kind": kind, "latency_ms": kinds[kind][0], "gbps": kinds[kind][1], "ms": priced[kind],
            "hops": len(crossings), "inter_node_hops": sum(crossings)}


class ProjectionPricer(cost.Pricer):
    """The search's Pricer with this script's batch (seeded lengths) and message cost."""

    def __init__(self, problem: cost.Problem, batch_seed: int, hop: dict, embedding_sync: bool = True):
        super().__init__(problem, extrapolate=False)  # simulate every microbatch
        self.batch_seed, self.hop, self.embedding_sync = batch_seed, hop, embedding_sync

    def embedding_sync_ms(self, layout: Layout) -> float:
        """The tied embedding's all-reduce after the pipeline, or 0 where it is left out."""
        return super().embedding_sync_ms(layout) if self.embedding_sync else 0.0

    def documents(self, layout: Layout) -> list[tuple[int, ...]]:
        """Packed data: each microbatch's document pieces, drawn with this seed."""
        return microbatch_documents(self.problem.packed, layout.num_microbatches, layout.micro_batch_size,
                                    self.problem.shape.seq_length, seed=self.batch_seed)

    def lengths(self, layout: Layout) -> list[int]:
        """Padded length of each microbatch: the longest of its samples, drawn with this seed."""
        seq, M, mbs = self.problem.shape.seq_length, layout.num_microbatches, layout.micro_batch_size
        if self.problem.lengths is None:
            return [seq] * M
        drawn = self.problem.lengths.sample(M * mbs, seq, np.random.default_rng(self.batch_seed))
        return drawn.reshape(M, mbs).max(axis=1).tolist()

    def comm_model(self, layout: Layout) -> CommModel:
        """The hop's latency, and a bandwidth scaled so that a full-length microbatch's activation
        bytes (what the simulator charges a message) take as long as its message (as cost.Pricer)."""
        latency, gbps = self.hop["latency_ms"], self.hop["gbps"]
        shape = self.problem.shape
        message = layout.micro_batch_size * shape.seq_length * shape.hidden_size * self.problem.dtype_bytes
        transfer_ms = message / (gbps * GB) * 1e3
        return CommModel(latency=latency,
                         bandwidth=self.chunk_activation_bytes(layout, shape.seq_length) / transfer_ms)


# --------------------------------------------------------------------------------------------
# one row group
# --------------------------------------------------------------------------------------------
def gpt_shape(seq_length: int, **fields) -> memory_model.ModelShape:
    defaults = dict(model="gpt", seq_length=seq_length, max_position_embeddings=seq_length)
    return memory_model.ModelShape(**{**defaults, **fields})


def layout_for(tp: int, pp: int, vpp: int, microbatches: int, recompute: str, policy, split,
               placement: str = INTERLEAVED) -> Layout:
    return Layout(tp=tp, pp=pp, vpp=vpp, dp=1, micro_batch_size=1, num_microbatches=microbatches,
                  recompute=recompute, distributed_optimizer=False, sequence_parallel=False,
                  schedule=policy or megatron_schedule(vpp), split_backward=split, placement=placement)


def price_batch(problem, seed, hop, layouts: dict, embedding_sync: bool) -> dict:
    """name -> (LayoutCost, SimResult) of one sampled batch."""
    pricer = ProjectionPricer(problem, seed, hop, embedding_sync)
    return {name: (pricer.price(layout, pricer.estimate(layout)),
                   pricer.simulate(layout, layout.num_microbatches)) for name, layout in layouts.items()}


def price_group(problem, tp, pp, vpp, microbatches, recompute, hop, seeds, schedules,
                embedding_sync: bool = True) -> list[dict]:
    """One row per schedule: time, ratio to the first schedule (Megatron's), bubble, memory,
    averaged over the sampled batches (ratios per batch, then averaged)."""
    layouts = {name: layout_for(tp, pp, vpp, microbatches, recompute, policy, split, placement)
               for name, policy, split, placement in schedules}
    batches = [price_batch(problem, seed, hop, layouts, embedding_sync) for seed in seeds]
    reference = schedules[0][0]
    rows = []
    for name, *_ in schedules:
        times = [batch[name][0].time_ms for batch in batches]
        pipelines = [batch[name][0].pipeline_ms for batch in batches]
        ratios = [batch[name][0].time_ms / batch[reference][0].time_ms for batch in batches]
        bounds = [batch[name][1].pipeline_bound / batch[reference][0].pipeline_ms for batch in batches]
        priced, simulated = batches[0][name]
        rows.append({
            "schedule": name, "placement": priced.layout.placement, "layout": priced.layout.describe(),
            "time_ms": statistics.fmean(times), "pipeline_ms": statistics.fmean(pipelines),
            "pipeline_bound_ms": statistics.fmean(batch[name][1].pipeline_bound for batch in batches),
            "ratio": statistics.fmean(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "bubble": statistics.fmean(batch[name][0].bubble_fraction for batch in batches),
            "pipeline_bound_ratio": statistics.fmean(bounds),
            "memory_gb": priced.memory_bytes / GB,
            "fits_memory": priced.memory_bytes <= problem.memory_budget_bytes,
            "budget_rank0_gb": simulated.budget_bytes[0] / GB,
            "budget_by_rank_gb": [budget / GB for budget in simulated.budget_bytes],
            "peak_over_budget": max(max(batch[name][1].peak_bytes[r] / batch[name][1].budget_bytes[r]
                                        for r in range(pp)) for batch in batches),
            "batches": len(batches),
        })
    return rows


def virtual_size(layers_per_stage: int) -> int | None:
    """vpp for the interleaved rows: 2 where the stage's layers are even, else the smallest
    divisor above 1 (one layer per chunk at worst); None for a single layer."""
    divisors = [v for v in range(2, layers_per_stage + 1) if layers_per_stage % v == 0]
    return 2 if 2 in divisors else (divisors[0] if divisors else None)


def task_times(problem: cost.Problem, tp: int, pp: int, recompute: str) -> dict:
    """The cost model's per-layer and per-stage figures at full length, micro-batch 1."""
    pricer = cost.Pricer(problem)
    seq = problem.shape.seq_length
    layer = pricer.layer(1, seq, tp, False, recompute)
    _first, last = pricer.stage_extras_ms(1, seq, tp)
    layers = problem.shape.num_layers // pp
    return {"layer_forward_ms": layer.forward_ms, "layer_backward_ms": layer.backward_ms,
            "layer_weight_grad_ms": layer.weight_grad_ms,
            "stage_forward_ms": layers * layer.forward_ms, "stage_backward_ms": layers * layer.backward_ms,
            "last_stage_output_layer_ms": last,
            "layer_activation_mb": layer.activation_bytes / MIB,
            "layer_weight_grad_stash_mb": layer.weight_grad_bytes / MIB}


def gpu_hardware(gpus: int, matmul_efficiency: float = 1.0) -> HardwareProfile:
    """The preset for a pipeline of `gpus` GPUs (whole nodes of 8, or part of one), its matmul
    rates times `matmul_efficiency`."""
    preset = load_hardware(PRESET, max(1, gpus // GPUS_PER_NODE), min(gpus, GPUS_PER_NODE))
    if matmul_efficiency == 1.0:
        return preset
    rates = {dtype: rate * matmul_efficiency for dtype, rate in preset.matmul_tflops.items()}
    return dataclasses.replace(preset, matmul_tflops=rates,
                               source=f"{preset.source}; matmul rates x {matmul_efficiency:g}")


def memory_by_tp(case: ModelCase, shape, pipeline_sizes) -> list[str]:
    """For each pp and TP: the fullest rank's GB under Megatron's 1F1B and dpp:adaptive+W (vpp 1),
    the figures that justify the model's TP."""
    lines = []
    for pp in pipeline_sizes:
        if case.num_layers % pp:
            continue
        figures = []
        for tp in TP_CHOICES:
            hardware = gpu_hardware(pp * tp)
            pricer = cost.Pricer(cost.Problem(shape, 4 * pp, hardware, GPU_MEMORY_BYTES))
            gb = [pricer.memory_bytes(layout_for(tp, pp, 1, 4 * pp, RECOMPUTE, policy, split)) / GB
                  for policy, split in ((None, False), ("dpp:adaptive", True))]
            figures.append(f"TP {tp} {gb[0]:.0f} / {gb[1]:.0f}")
        lines.append(f"{case.name} pp {pp}: " + ", ".join(figures))
    return lines


def project_scale(args, distributions: dict) -> tuple[list[dict], list[dict], list[str], list[str]]:
    """(rows, per-group figures, skipped layouts, memory-by-TP lines) of every model and pp."""
    ipc = ipc_hop(args.ipc_latency_us, args.ipc_64mib_us)
    # Inter-node: the preset's point-to-point figure for a hop between two nodes.
    two_nodes = load_hardware(PRESET, 2, 1)
    network = (two_nodes.p2p_latency(2), two_nodes.p2p_bandwidth(2))
    rows, groups, skipped, tp_memory = [], [], [], []
    for model_name in args.models:
        case = MODELS[model_name]
        shape = gpt_shape(SEQ_LENGTH, num_layers=case.num_layers, hidden_size=case.hidden_size,
                          num_attention_heads=case.heads, ffn_hidden_size=4 * case.hidden_size,
                          padded_vocab_size=VOCAB, dtype="bf16")
        tp_memory += memory_by_tp(case, shape, args.pp)
        for pp in args.pp:
            if case.num_layers % pp:
                skipped.append(f"{model_name} pp {pp}: {case.num_layers} layers do not split over "
                               f"{pp} stages (Megatron refuses it)")
                continue
            gpus = pp * case.tp
            hardware = gpu_hardware(gpus, args.matmul_efficiency)
            microbatches = args.microbatches_per_stage * pp
            vpps = [1] + [v for v in [virtual_size(case.num_layers // pp)] if v]
            # The sequence lengths of the groups: 2048 and each packed window asked for.
            seqs = [SEQ_LENGTH] if any(d is None or isinstance(d, LengthDistribution)
                                       for d, _line in distributions.values()) else []
            seqs += [d.window for d, _line in distributions.values() if isinstance(d, PackedData)]
            for vpp in vpps:
                hops = {}
                for seq in seqs:
                    message = seq * case.hidden_size * 2  # micro-batch 1, bf16, per TP rank (no SP)
                    hops[seq] = slowest_hop(message, pipeline_hops(pp, vpp, case.tp), ipc, network)
                    at_seq = dataclasses.replace(shape, seq_length=seq, max_position_embeddings=seq)
                    groups.append({"model": model_name, "pp": pp, "vpp": vpp, "tp": case.tp,
                                   "seq_length": seq, "gpus": gpus, "microbatches": microbatches,
                                   "message_mb": message / MIB, "hop": hops[seq], "task_times": task_times(
                                       cost.Problem(at_seq, microbatches, hardware, GPU_MEMORY_BYTES),
                                       case.tp, pp, RECOMPUTE)})
                for dist_name, (distribution, _line) in distributions.items():
                    if isinstance(distribution, PackedData):
                        seq = distribution.window
                        at_seq = dataclasses.replace(shape, seq_length=seq, max_position_embeddings=seq)
                        problem = cost.Problem(at_seq, microbatches, hardware, GPU_MEMORY_BYTES,
                                               packed=distribution.documents)
                    else:
                        seq = SEQ_LENGTH
                        problem = cost.Problem(shape, microbatches, hardware, GPU_MEMORY_BYTES,
                                               lengths=distribution)
                    count = args.packed_batches if isinstance(distribution, PackedData) else args.batches
                    seeds = [0] if distribution is None else list(range(count))
                    schedules = SCHEDULES + (V_SCHEDULES if vpp == 2 else ())
                    for row in price_group(problem, case.tp, pp, vpp, microbatches, RECOMPUTE, hops[seq],
                                           seeds, schedules):
                        rows.append({"model": model_name, "pp": pp, "vpp": vpp, "tp": case.tp,
                                     "distribution": dist_name, "seq_length": seq, **row})
                    print(f"  priced {model_name} pp {pp} vpp {vpp} {dist_name}", file=sys.stderr)
    return rows, groups, skipped, tp_memory


# --------------------------------------------------------------------------------------------
# the pp=2 CPU overlap
# --------------------------------------------------------------------------------------------
def cpu_matmul_gflops(shape: memory_model.ModelShape, lengths: tuple[int, ...]) -> float:
    """The CPU rate that makes the cost model's forward compute of a batch (8 microbatches of
    mean sample FLOPs: layers + output layer) take the measured CPU_FORWARD_COMPUTE_MS."""
    def forward_flops(length: int) -> float:
        at = dataclasses.replace(shape, seq_length=length)
        return (shape.num_layers * memory_model.layer_forward_flops(at, 1)
                + 2.0 * length * shape.hidden_size * shape.padded_vocab_size)
    mean_flops = statistics.fmean(forward_flops(length) for length in lengths)
    return CPU_MICROBATCHES * mean_flops / (CPU_FORWARD_COMPUTE_MS * 1e-3) / 1e9


def project_cpu_overlap(args) -> dict:
    ensure_sample_data(args.sample_data)
    shape = gpt_shape(**CPU_SHAPE)
    values = sample_lengths(args.sample_data, SAMPLE_CUT, SAMPLE_CUT)
    gflops = cpu_matmul_gflops(shape, values)
    hardware = HardwareProfile(
        num_nodes=1, gpus_per_node=2, allreduce_busbw_gbps={}, p2p_gbps={2: CPU_P2P_GBPS},
        overlap_coefficient=1.0, sp_time_ms={}, matmul_tflops={"fp32": gflops / 1e3},
        p2p_latency_ms={2: CPU_P2P_LATENCY_MS},
        source=f"CPU: matmul {gflops:.1f} GFLOP/s fitted to the measured forward compute; shm_tensor p2p")
    # The memory budget is not checked here (the CPU benchmark's model needs a fraction of a GB).
    problem = cost.Problem(shape, CPU_MICROBATCHES, hardware, GPU_MEMORY_BYTES,
                           lengths=LengthDistribution("sample", "file", values=values), on_gpus=False)
    hop = {"kind": "shm_tensor (CPU)", "latency_ms": CPU_P2P_LATENCY_MS, "gbps": CPU_P2P_GBPS}
    # The measured part 1 times the forward-backward alone: no embedding all-reduce, no optimizer.
    rows = price_group(problem, 1, 2, 1, CPU_MICROBATCHES, "none", hop, list(range(args.cpu_batches)),
                       CPU_SCHEDULES, embedding_sync=False)
    for row in rows:
        row["measured"] = CPU_MEASURED[row["schedule"]]
    pricer = ProjectionPricer(problem, 0, hop)
    model, _sizes = pricer.durations(layout_for(1, 2, 1, CPU_MICROBATCHES, "none", None, False))
    return {"rows": rows, "matmul_gflops": gflops, "batches": args.cpu_batches,
            "rank_speed": list(model.rank_speed),
            "measured_commands": [CPU_MEASURED["command_part1"], CPU_MEASURED["command_part2"]],
            "layer_forward_ms_at_512": pricer.layer(1, 512, 1, False, "none").forward_ms}


# --------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------
def assumptions(args, distributions: dict, groups: list[dict], skipped: list[str],
                tp_memory: list[str]) -> dict:
    ipc = ipc_hop(args.ipc_latency_us, args.ipc_64mib_us)
    two_nodes = load_hardware(PRESET, 2, 1)
    return {
        "hardware": gpu_hardware(GPUS_PER_NODE, args.matmul_efficiency).source,
        "gpu_memory_gb": GPU_MEMORY_BYTES / GB,
        "compute": f"no model profile: layer FLOPs (memory_model.layer_forward_flops, attention s^2 "
                   f"term included) at the preset's nominal bf16 {H100_NODE.matmul_tflops['bf16']} "
                   f"TFLOP/s x {args.matmul_efficiency:g}; backward 2x forward + recomputed attention "
                   f"(recompute {RECOMPUTE}); W = half the backward compute; tensor-parallel "
                   f"all-reduces at NVLink {H100_NODE.nvlink_gbps:g} GB/s; last stage + output layer "
                   f"(vocab {VOCAB}) x3; no per-task overhead; no data-parallel sync (DP 1); tied "
                   f"embedding all-reduce (first/last stage) included, exposed",
        "layout": f"micro-batch 1, M = {args.microbatches_per_stage} x pp, DP 1, sequence parallelism "
                  f"off, recompute {RECOMPUTE}, TP per model: " + "; ".join(
                      f"{c.name} TP {c.tp} ({c.tp_reason})" for c in MODELS.values()),
        "messages": {"on_node": f"shm_tensor CUDA IPC on one H100 (../shared/gpu/README.md): "
                                f"{args.ipc_latency_us:g} us + bytes at {ipc[1]:.0f} GB/s (a line through "
                                f"{args.ipc_latency_us:g} us and {args.ipc_64mib_us:g} us at 64 MiB)",
                     "inter_node": f"preset InfiniBand: {two_nodes.p2p_latency(2):g} ms + bytes at "
                                   f"{two_nodes.p2p_bandwidth(2):g} GB/s per GPU (the preset has no latency)",
                     "rule": "one message per microbatch and hop between two ranks (none at the v's "
                             "turn on rank pp-1); the simulator prices every hop at "
                             "the pipeline's slowest (it has one cost for all hops); Megatron's "
                             "schedules go over the same transport as dpp (as benchmarks/"
                             "real_model_bench.py runs them), not NCCL"},
        "memory_budget": "'auto': rank r holds at most Megatron's in-flight count at full length "
                         "(ZB-V's on the v placement; pipeline/budget.py); +W counts each "
                         "microbatch's W stash too",
        "distributions": {name: line for name, (_d, line) in distributions.items()},
        "batches": args.batches,
        "packed_batches": args.packed_batches,
        "groups": groups,
        "skipped": skipped,
        "memory_by_tp": tp_memory,
    }


def format_rows(rows: list[dict]) -> str:
    lines = ["| model | TP | pp | vpp | distribution | schedule | ms / iteration | ratio | bubble | "
             "GB (fits 80) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        varied = r["batches"] > 1 and r["ratio_min"] != r["ratio_max"]
        spread = f" ({r['ratio_min']:.3f}-{r['ratio_max']:.3f})" if varied else ""
        lines.append(f"| {r['model']} | {r['tp']} | {r['pp']} | {r['vpp']} | {r['distribution']} | "
                     f"{r['schedule']} | {r['time_ms']:.1f} | {r['ratio']:.3f}{spread} | "
                     f"{r['bubble']:.3f} | {r['memory_gb']:.0f} ({'yes' if r['fits_memory'] else 'no'}) |")
    return "\n".join(lines)


def format_wide(rows: list[dict]) -> str:
    """One line per row group: Megatron's time and bubble, each dpp variant's ratio and bubble."""
    lines = ["| model | pp | vpp | distribution | Megatron ms | Megatron bubble | adaptive | bubble | "
             "adaptive+W | bubble | pipeline bound+W | GB Megatron / +W | zb-v+W | adaptive+W/v | "
             "GB +W/v |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    keyed = {}
    for r in rows:
        keyed.setdefault((r["model"], r["pp"], r["vpp"], r["distribution"]), {})[r["schedule"]] = r
    for (model, pp, vpp, dist), group in keyed.items():
        mega, fused, split = group["megatron"], group["dpp:adaptive"], group["dpp:adaptive+W"]
        fit = lambda r: f"{r['memory_gb']:.0f}{'' if r['fits_memory'] else '!'}"
        v_cells = "| - | - | - |"  # no v rows: two chunks a rank do not divide the stage's layers
        if "zb-v+W" in group:
            zbv, v_split = group["zb-v+W"], group["dpp:adaptive+W/v"]
            v_cells = f"| {zbv['ratio']:.3f} | **{v_split['ratio']:.3f}** | {fit(v_split)} |"
        lines.append(f"| {model} | {pp} | {vpp} | {dist} | {mega['time_ms']:.1f} | {mega['bubble']:.3f} | "
                     f"**{fused['ratio']:.3f}** | {fused['bubble']:.3f} | **{split['ratio']:.3f}** | "
                     f"{split['bubble']:.3f} | {split['pipeline_bound_ratio']:.3f} | "
                     f"{fit(mega)} / {fit(split)} {v_cells}")
    return "\n".join(lines)


def format_assumptions(facts: dict) -> str:
    lines = ["assumptions:", f"  hardware: {facts['hardware']}",
             f"  GPU memory: {facts['gpu_memory_gb']:g} GB",
             f"  compute: {facts['compute']}", f"  layout: {facts['layout']}",
             f"  messages on node: {facts['messages']['on_node']}",
             f"  messages between nodes: {facts['messages']['inter_node']}",
             f"  messages: {facts['messages']['rule']}", f"  memory budget: {facts['memory_budget']}"]
    lines += [f"  lengths {name}: {line}" for name, line in facts["distributions"].items()]
    lines.append(f"  variable-length groups: mean over {facts['batches']} sampled batches (seeds "
                 f"0..{facts['batches'] - 1}), packed groups over {facts['packed_batches']} (seeds "
                 f"0..{facts['packed_batches'] - 1}); ratio range in parentheses")
    lines += [f"  skipped: {line}" for line in facts["skipped"]]
    lines.append("  fullest rank's GB, Megatron 1F1B / dpp:adaptive+W, vpp 1, by TP (why each model's TP):")
    lines += [f"    {line}" for line in facts["memory_by_tp"]]
    lines.append("  per group and sequence length (full length, micro-batch 1): layer F / B / W ms, "
                 "stage F / B ms, last "
                 "stage's output layer F+B ms, layer activations MB (+W stash MB), message MB, hop")
    for g in facts["groups"]:
        t, hop = g["task_times"], g["hop"]
        lines.append(f"    {g['model']} TP {g['tp']} pp {g['pp']} vpp {g['vpp']} seq {g['seq_length']} "
                     f"({g['gpus']} GPUs, "
                     f"M {g['microbatches']}): {t['layer_forward_ms']:.3f} / {t['layer_backward_ms']:.3f} / "
                     f"{t['layer_weight_grad_ms']:.3f}, {t['stage_forward_ms']:.2f} / "
                     f"{t['stage_backward_ms']:.2f}, {t['last_stage_output_layer_ms']:.2f}, "
                     f"{t['layer_activation_mb']:.0f} (+{t['layer_weight_grad_stash_mb']:.0f}), "
                     f"{g['message_mb']:.1f}, {hop['kind']} {hop['ms']:.3f} ms "
                     f"({hop['inter_node_hops']} of {hop['hops']} hops between nodes)")
    return "\n".join(lines)


def format_cpu(cpu: dict) -> str:
    lines = ["pp=2 overlap: benchmarks/real_model_bench.py's CPU model (hidden 768, 4 layers, 12 heads, "
             "FFN 3072, fp32, vocab 4096, sample lengths <= 512, micro-batch 1, 8 microbatches)",
             f"  CPU rate {cpu['matmul_gflops']:.1f} GFLOP/s (fitted: a batch's forwards take the measured "
             f"{CPU_FORWARD_COMPUTE_MS:g} ms); rank speed {cpu['rank_speed'][0]:.3f} / "
             f"{cpu['rank_speed'][1]:.3f}; {cpu['batches']} sampled batches",
             "| schedule | projected ms | projected ratio | projected bubble | measured part 1 "
             "(runs 1, 2) | measured part 2 | measured bubble |", "|---|---|---|---|---|---|---|"]
    for r in cpu["rows"]:
        m = r["measured"]
        lines.append(f"| {r['schedule']} | {r['time_ms']:.1f} | {r['ratio']:.3f} | {r['bubble']:.3f} | "
                     f"{m['part1'][0]:.3f}, {m['part1'][1]:.3f} | {m['part2']:.3f} | {m['bubble']:.3f} |")
    lines.append("  measured: " + "; ".join(cpu["measured_commands"])
                 + " (docs/results.md, The real model)")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                        help="GPT-3 sizes to project (default both: 13B with TP 2, 175B with TP 8).")
    parser.add_argument("--pp", nargs="+", type=int, default=list(PIPELINE_SIZES),
                        help="Pipeline sizes (default 4 8 16); one that does not divide the layers is "
                             "skipped and said so. Each also runs with virtual stages where they divide.")
    parser.add_argument("--distributions", nargs="+", choices=DISTRIBUTIONS, default=list(DISTRIBUTIONS),
                        help="Length distributions (default all): uniform (full length), sample (the "
                             "sample corpus's, cut at 512 and scaled to 2048), longtail "
                             f"({LONGTAIL_SPEC}, clipped at 2048), packed8k and packed32k (windows of "
                             f"8192 and 32768 tokens packed from {PACKED_SPEC} documents, attention "
                             "per document).")
    parser.add_argument("--batches", type=int, default=32,
                        help="Sampled batches per variable-length group, seeds 0..N-1 (default 32).")
    parser.add_argument("--packed-batches", type=int, default=8,
                        help="Sampled batches per packed group, seeds 0..N-1 (default 8: each batch "
                             "holds 4 x pp windows of many documents).")
    parser.add_argument("--microbatches-per-stage", type=int, default=4,
                        help="Microbatches per iteration = this x pp (default 4).")
    parser.add_argument("--ipc-latency-us", type=float, default=IPC_LATENCY_US,
                        help="On-node message: fixed one-way time, us (default 260: shm_tensor's CUDA "
                             "IPC, smallest measured; ../shared/gpu/README.md also saw 705 once).")
    parser.add_argument("--ipc-64mib-us", type=float, default=IPC_64MIB_US,
                        help="On-node message: one-way time of 64 MiB, us (default 502, the slower "
                             "measured figure); sets the bandwidth term.")
    parser.add_argument("--matmul-efficiency", type=float, default=1.0,
                        help="Scale the preset's nominal matmul rate (default 1: the preset's "
                             "989.4 bf16 TFLOP/s as the search prices it). Slower compute makes the "
                             "fixed message costs relatively smaller.")
    parser.add_argument("--sample-data", default=SAMPLE_PREFIX,
                        help="Indexed dataset whose document lengths make the 'sample' distribution "
                             "(default data/sample/sample_text_document, made offline if missing).")
    parser.add_argument("--cpu-batches", type=int, default=32,
                        help="Sampled batches of the pp=2 CPU overlap (default 32).")
    parser.add_argument("--no-cpu-overlap", action="store_true", help="Leave out the pp=2 CPU overlap.")
    parser.add_argument("--quick", action="store_true",
                        help="For tests: 13B at pp 4 only (vpp 1 and 2), 2 batches per variable "
                             "or packed distribution, 4 CPU batches; seconds.")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help="Write every figure as JSON to PATH; without PATH print the JSON on "
                             "stdout instead of the tables.")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.pp, args.batches, args.cpu_batches = ["13B"], [4], 2, 4
        args.packed_batches = 2
    if args.ipc_64mib_us <= args.ipc_latency_us or args.ipc_latency_us < 0:
        parser.error("--ipc-64mib-us must exceed --ipc-latency-us >= 0")
    if not 0.0 < args.matmul_efficiency <= 1.0:
        parser.error("--matmul-efficiency must lie in (0, 1]")
    if (min(args.pp) < 2 or args.batches < 1 or args.packed_batches < 1 or args.cpu_batches < 1
            or args.microbatches_per_stage < 1):
        parser.error("--pp values >= 2, --batches, --packed-batches, --cpu-batches, "
                     "--microbatches-per-stage >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    distributions = make_distributions(args.distributions, args.sample_data, SEQ_LENGTH)
    rows, groups, skipped, tp_memory = project_scale(args, distributions)
    command = " ".join(["python benchmarks/scale_projection.py", *(sys.argv[1:] if argv is None else argv)])
    result = {"command": command, "assumptions": assumptions(args, distributions, groups, skipped, tp_memory),
              "rows": rows}
    if not args.no_cpu_overlap:
        result["cpu_overlap"] = project_cpu_overlap(args)
    text = "\n\n".join([format_rows(rows), format_wide(rows), format_assumptions(result["assumptions"])]
                       + ([format_cpu(result["cpu_overlap"])] if "cpu_overlap" in result else []))
    if args.json == "-":
        print(json.dumps(result, indent=1))
    else:
        print(text)
        if args.json:
            with open(args.json, "w") as out:
                json.dump(result, out, indent=1)
    print(f"wall time {time.monotonic() - started:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
