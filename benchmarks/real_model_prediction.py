"""The simulator's prediction for a benchmarks/real_model_bench.py run: the same corpus cut into
the same windows, priced as the runtime prices them, on the task times that run measured.

Input: the benchmark's --json (its settings: corpus, --data packed or masked, --seq-length,
--hidden-size, heads, layers, microbatches; its measurements: Megatron 1F1B's median forward per
rank from the traces, the backward/forward and W/(B+W) compute ratios of part 1). Windows: as
Megatron's GPT dataset makes them, the documents shuffled and concatenated, cut every --seq-length
tokens, the windows shuffled; each window's documents are its pieces between end-of-document
tokens. A window's work: one unit per token, plus with per-document attention (--data masked)
c * sum(s_i^2) with the model's c (models/memory_model.py, causal_attention_work_per_token_pair;
pipeline/work.py, segments_work), as the runtime's dpp:adaptive sees it; activation bytes equal
(every window holds --seq-length tokens). Stage speeds: rank 1's measured forward over rank 0's
(the output layer and the loss are on rank 1). Per batch, over --batches batches of --microbatches
windows: Megatron's 1F1B, dpp:adaptive, each fused and split (+W), at the default ('auto') budget;
time / 1F1B's, the median and quartiles over batches, beside the bound (the busiest rank's work).

    python benchmarks/real_model_prediction.py runs/masked_long.json            # seconds
    python benchmarks/real_model_prediction.py runs/masked_long.json --json runs/prediction.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import List

import numpy as np

from megatron_dpp.models.memory_model import ModelShape, causal_attention_work_per_token_pair
from megatron_dpp.pipeline import TaskGraph
from megatron_dpp.pipeline.work import segments_work
from megatron_dpp.sim import DurationModel, simulate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import long_tailed_corpus  # noqa: E402
from scale_projection import read_document_lengths  # noqa: E402

PREFIXES = {"sample": long_tailed_corpus.SAMPLE_PREFIX, "long-tailed": long_tailed_corpus.DEFAULT_PREFIX}
PER_DOCUMENT_ATTENTION = ("masked", "whole-masked")
REFERENCE = "1f1b"
SCHEDULES = ((REFERENCE, False), ("dpp:adaptive", False), (REFERENCE, True), ("dpp:adaptive", True))


def window_pieces(document_lengths: np.ndarray, window: int, rng: np.random.Generator) -> List[List[int]]:
    """One epoch of windows: the documents shuffled and concatenated, cut every `window` tokens;
    each window as the lengths of its documents' pieces, the windows shuffled."""
    windows, current, filled = [], [], 0
    for length in document_lengths[rng.permutation(len(document_lengths))]:
        left = int(length)
        while left:
            piece = min(left, window - filled)
            current.append(piece)
            filled += piece
            left -= piece
            if filled == window:
                windows.append(current)
                current, filled = [], 0
    return [windows[i] for i in rng.permutation(len(windows))]


def measured_speeds(bench: dict) -> tuple:
    """(rank speeds, backward/forward, W share of the backward) from the benchmark's figures."""
    forwards = [stat["forward_ms"] for stat in bench["trace_stats"]["megatron-1f1b"]]
    rank_forward = [statistics.median(f[r] for f in forwards) for r in range(2)]
    fused = bench["one_process"]["summary"].get("dpp:adaptive", {}).get("compute_ms_by_kind", {})
    split = bench["one_process"]["summary"].get("dpp:adaptive+W", {}).get("compute_ms_by_kind", {})
    backward_ratio = fused["B"] / fused["F"] if fused else DurationModel.backward_ratio
    w_share = split["W"] / (split["B"] + split["W"]) if split else DurationModel.weight_grad_fraction
    return [1.0, rank_forward[1] / rank_forward[0]], backward_ratio, w_share


def predict(bench: dict, batches: int, seed: int) -> dict:
    settings = bench["settings"]
    if settings["data"] not in ("packed", *PER_DOCUMENT_ATTENTION):
        raise SystemExit(f"{settings['data']!r} data: this predicts packed windows only")
    window, hidden, M = settings["seq_length"], settings["hidden_size"], settings["microbatches"]
    shape = ModelShape("gpt", settings["num_layers"], hidden, settings["attention_heads"],
                       4 * hidden, window, padded_vocab_size=4096, max_position_embeddings=window,
                       dtype="fp32")
    c = (causal_attention_work_per_token_pair(shape)
         if settings["data"] in PER_DOCUMENT_ATTENTION else 0.0)
    rank_speed, backward_ratio, w_share = measured_speeds(bench)
    model = DurationModel(rank_speed=rank_speed, backward_ratio=backward_ratio,
                          weight_grad_fraction=w_share)
    rng = np.random.default_rng(seed)
    documents = read_document_lengths(PREFIXES[settings["corpus"]])
    windows: List[List[int]] = []
    ratios = {run: [] for run in SCHEDULES}
    bounds = {False: [], True: []}
    for batch in range(batches):
        while len(windows) < M:
            windows += window_pieces(documents, window, rng)
        packs, windows = windows[:M], windows[M:]
        sizes = [segments_work(pieces, c) for pieces in packs]
        times = {}
        for name, split in SCHEDULES:
            graph = TaskGraph(2, 1, M, sizes, [window] * M, split_backward=split)
            result = simulate(graph, name, model, seed=batch)
            times[(name, split)] = result.makespan
            if name == REFERENCE:
                bounds[split].append(result.lower_bound)
        reference = times[(REFERENCE, False)]
        for run in SCHEDULES:
            ratios[run].append(times[run] / reference)
        bounds[False][-1] /= reference
        bounds[True][-1] /= reference

    def summary(values):
        q = statistics.quantiles(values, n=4)
        return {"median": statistics.median(values), "q1": q[0], "q3": q[2]}

    return {"settings": {**{k: settings[k] for k in ("corpus", "data", "seq_length", "hidden_size",
                                                      "microbatches")},
                         "per_token_pair": c, "rank_speed": rank_speed,
                         "backward_ratio": backward_ratio, "weight_grad_fraction": w_share,
                         "batches": batches, "seed": seed},
            "ratio_to_1f1b": {name + ("+W" if split else ""): summary(values)
                              for (name, split), values in ratios.items()},
            "bound": {"fused": summary(bounds[False]), "split": summary(bounds[True])}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench_json", help="benchmarks/real_model_bench.py's --json file")
    parser.add_argument("--batches", type=int, default=200, help="batches simulated (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="the windows' shuffle (default 0)")
    parser.add_argument("--json", metavar="PATH", help="write the prediction as JSON")
    args = parser.parse_args(argv)
    if args.batches < 2:
        parser.error("--batches: at least 2")
    with open(args.bench_json) as f:
        prediction = predict(json.load(f), args.batches, args.seed)
    s = prediction["settings"]
    print(f"simulated: {s['corpus']} corpus, {s['data']}, windows of {s['seq_length']}, "
          f"c = {s['per_token_pair']:.3g}, rank speeds {s['rank_speed'][0]:.2f} "
          f"{s['rank_speed'][1]:.2f}, B/F {s['backward_ratio']:.2f}, W share "
          f"{s['weight_grad_fraction']:.2f}, {s['batches']} batches")
    for name, r in prediction["ratio_to_1f1b"].items():
        print(f"  {name:16s} / 1f1b: median {r['median']:.3f} (quartiles {r['q1']:.3f}-{r['q3']:.3f})")
    for kind, r in prediction["bound"].items():
        print(f"  bound ({kind:5s})  / 1f1b: median {r['median']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(prediction, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
