"""benchmarks/real_model_prediction.py: windows cut as Megatron's GPT dataset cuts them, and a
prediction whose figures follow from the properties of the schedules:
- without per-document attention every window is equal work, and at the default budget
  dpp:adaptive runs exactly Megatron's order (docs/scheduling.md; tests/test_sched_properties.py),
  so its ratio is 1 in every batch;
- no schedule beats the busiest rank's work.
"""
import json
import os
import subprocess
import sys

import numpy as np

from _train_util import ensure_sample_data

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "real_model_prediction.py")
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from real_model_prediction import window_pieces  # noqa: E402


def test_windows_hold_every_token_once_cut_at_the_window():
    lengths = np.array([5, 17, 3, 40, 1, 9, 25])
    windows = window_pieces(lengths, 8, np.random.default_rng(0))
    assert all(sum(pieces) == 8 for pieces in windows)
    assert len(windows) == lengths.sum() // 8  # the last partial window is left out
    # A 40-token document fills five windows on its own, a piece of each.
    assert sum(pieces == [8] for pieces in windows) >= 40 // 8 - 1


def bench_json(tmp_path, data: str) -> str:
    """What real_model_bench --json writes, with the fields the prediction reads."""
    bench = {"settings": {"corpus": "sample", "data": data, "seq_length": 512, "hidden_size": 64,
                          "attention_heads": 2, "num_layers": 2, "microbatches": 8},
             "trace_stats": {"megatron-1f1b": [{"forward_ms": [10.0, 15.0]},
                                               {"forward_ms": [12.0, 18.0]}]},
             "one_process": {"summary": {
                 "dpp:adaptive": {"compute_ms_by_kind": {"F": 100.0, "B": 190.0}},
                 "dpp:adaptive+W": {"compute_ms_by_kind": {"F": 100.0, "B": 120.0, "W": 80.0}}}}}
    path = tmp_path / f"{data}.json"
    path.write_text(json.dumps(bench))
    return str(path)


def predict(tmp_path, data: str) -> dict:
    ensure_sample_data()
    out = tmp_path / f"{data}-prediction.json"
    done = subprocess.run([sys.executable, SCRIPT, bench_json(tmp_path, data), "--batches", "6",
                           "--json", str(out)], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text())


def test_equal_windows_leave_dpp_megatrons_order_and_nothing_beats_the_bound(tmp_path):
    prediction = predict(tmp_path, "packed")
    settings = prediction["settings"]
    assert settings["per_token_pair"] == 0.0
    assert settings["rank_speed"] == [1.0, 1.5]
    assert abs(settings["backward_ratio"] - 1.9) < 1e-9
    assert abs(settings["weight_grad_fraction"] - 0.4) < 1e-9
    ratios = prediction["ratio_to_1f1b"]
    assert abs(ratios["dpp:adaptive"]["q1"] - 1.0) < 1e-9
    assert abs(ratios["dpp:adaptive"]["q3"] - 1.0) < 1e-9
    for statistic in ("q1", "median", "q3"):
        assert ratios["dpp:adaptive+W"][statistic] >= prediction["bound"]["split"][statistic] - 1e-9
    assert prediction["bound"]["fused"]["median"] <= 1.0


def test_per_document_attention_prices_windows_by_their_documents(tmp_path):
    prediction = predict(tmp_path, "masked")
    # GPT's causal attention per token pair at f = 4h: 1/(12h).
    assert abs(prediction["settings"]["per_token_pair"] - 1 / (12 * 64)) < 1e-12
    # Every batch's time is at least its bound, so each order statistic is too.
    for name, ratio in prediction["ratio_to_1f1b"].items():
        bound = prediction["bound"]["split" if name.endswith("+W") else "fused"]
        for statistic in ("q1", "median", "q3"):
            assert ratio[statistic] >= bound[statistic] - 1e-9, (name, statistic)
