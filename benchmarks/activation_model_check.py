"""The analytical activation model (megatron_dpp.search.memory_model) against the bytes
Megatron-Core really keeps (megatron_dpp.search.model_measurement's saved-tensor count): tp = 1 in
one process, tp = --tp in that many.

For every model, dtype, hidden size, sequence length, micro-batch and recompute mode of the grid:
measured bytes of one layer, the analytical bytes, and their ratio; then the embedding's and the
output head's; the same for one rank at tensor-parallel size --tp (default 2, that many gloo
processes, micro-batch 2). Prints a Markdown table (docs/search.md "Model profile" shows an
excerpt), or with --json one JSON object: {"rows": [...], "max_relative_error": float}.

    .venv/bin/python benchmarks/activation_model_check.py [--json] [--dropout P]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dpp.search import memory_model as mm  # noqa: E402
from megatron_dpp.search import model_measurement as mp  # noqa: E402

HIDDEN_SIZES = (64, 128)
SEQ_LENGTHS = (64, 128)
MICRO_BATCHES = (1, 2)
HEADS = 4
VOCAB = 1024


def rows(model: str, dtype: str, dropout: float) -> list[dict]:
    out = []
    with mp.single_process_megatron(model):
        for hidden in HIDDEN_SIZES:
            for seq in SEQ_LENGTHS:
                shape = mm.model_shape(model, 1, hidden, HEADS, seq, VOCAB, dtype=dtype,
                                       hidden_dropout=dropout, attention_dropout=dropout)
                blocks = {mode: mp.build_layer(shape, mode) for mode in mm.RECOMPUTE_MODES}
                full_model = mp.build_model(shape)
                for batch in MICRO_BATCHES:
                    measured = {mode: mp.measured_layer_activation_bytes(block, shape, batch)
                                for mode, block in blocks.items()}
                    analytical = {mode: mm.layer_activation_bytes(shape, batch, 1, False, mode)
                                  for mode in mm.RECOMPUTE_MODES}
                    measured["embedding"], measured["output"] = mp.measured_other_activation_bytes(
                        full_model, shape, batch)
                    analytical["embedding"] = mm.embedding_activation_bytes(shape, batch)
                    analytical["output"] = mm.output_activation_bytes(shape, batch)
                    for part in measured:
                        out.append({"model": model, "dtype": dtype, "dropout": dropout,
                                    "hidden": hidden, "seq": seq, "batch": batch, "part": part,
                                    "measured": measured[part], "analytical": analytical[part],
                                    "ratio": analytical[part] / measured[part]})
    return out


def tensor_parallel_rows(model: str, dtype: str, dropout: float, tp: int) -> list[dict]:
    """One rank's bytes at tp (tp gloo processes) against the analytical model, micro-batch 2."""
    out = []
    for hidden in HIDDEN_SIZES:
        options = mp.ProfilingOptions(
            model=model, hidden_size=hidden, num_attention_heads=HEADS, ffn_hidden_size=4 * hidden,
            seq_lengths=SEQ_LENGTHS, micro_batch_sizes=(2,), dtype=dtype, padded_vocab_size=VOCAB,
            max_position_embeddings=max(SEQ_LENGTHS), hidden_dropout=dropout,
            attention_dropout=dropout, tp_sizes=(1, tp),
            measured_tp_size=tp, warmup=0, repeats=1)
        for (seq, part), measured in sorted(mp.measure_tensor_parallel(options, tp).items()):
            shape = options.shape(seq)
            if part in mm.RECOMPUTE_MODES:
                analytical = mm.layer_activation_bytes(shape, 2, tp, False, part)
            elif part == "embedding":
                analytical = mm.embedding_activation_bytes(shape, 2, tp)
            else:
                part, analytical = "output", mm.output_activation_bytes(shape, 2, tp)
            out.append({"model": model, "dtype": dtype, "dropout": dropout, "tp": tp,
                        "hidden": hidden, "seq": seq, "batch": 2, "part": part,
                        "measured": measured, "analytical": analytical,
                        "ratio": analytical / measured})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="Print one JSON object.")
    parser.add_argument("--tp", type=int, default=2,
                        help="Also compare one rank at this tensor-parallel size (that many gloo "
                             "processes; 1: skip).")
    parser.add_argument("--dropout", type=float, default=0.1,
                        help="Hidden and attention dropout (default 0.1, Megatron-LM's).")
    args = parser.parse_args()
    table = []
    for model in ("gpt", "bert"):
        for dtype in ("fp32", "bf16"):
            table += [dict(row, tp=1) for row in rows(model, dtype, args.dropout)]
            if args.tp > 1:
                table += tensor_parallel_rows(model, dtype, args.dropout, args.tp)
    worst = max(abs(row["ratio"] - 1) for row in table)
    if args.json:
        print(json.dumps({"rows": table, "max_relative_error": worst}, indent=1))
        return 0
    print("| model | dtype | tp | h | s | b | part | measured B | analytical B | "
          "analytical/measured |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in table:
        print(f"| {row['model']} | {row['dtype']} | {row['tp']} | {row['hidden']} | {row['seq']} | "
              f"{row['batch']} | {row['part']} | {row['measured']} | {row['analytical']} | "
              f"{row['ratio']:.4f} |")
    print(f"\nlargest relative error: {worst:.4%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
