"""benchmarks/real_model_bench.py --quick runs end to end: Megatron's 1F1B, 1f1b-sorted,
dpp:adaptive and dpp:adaptive with --dpp-split-backward on the real GPT at pp=2, and zb-v and
dpp:adaptive split on the v placement, each rank pinned to a core; part 1 runs every variant but
the v ones on the same batches in one process per rank (paired by batch), part 2 trains each
variant in its own traced run (paired by round and iteration). Its JSON holds
every time, the paired ratios, the compute time of the runtime's variants and the trace figures.
The targets are the benchmark's to report, not a test's to assert (timings on shared CPUs are
noisy)."""
import json
import os
import statistics
import subprocess
import sys

import pytest

from _train_util import REPO_ROOT, _env, ensure_sample_data


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_benchmark_writes_paired_ratios_and_trace_figures(tmp_path):
    ensure_sample_data()
    out = tmp_path / "real_model.json"
    # Packed windows with per-document attention of the long-tailed corpus, and beside them the
    # same documents unpacked (part 2 only: other batches).
    # One v variant (the v's split and order): the others build the same chunks.
    variants = ["megatron-1f1b", "1f1b-sorted", "dpp:adaptive", "dpp:adaptive+W", "zb-v+W/v",
                "dpp:adaptive+W/unpacked", "megatron-1f1b/unmasked"]
    command = [sys.executable, os.path.join(REPO_ROOT, "benchmarks", "real_model_bench.py"), "--quick",
               "--data", "masked", "--corpus", "long-tailed", "--variants", *variants,
               "--json", str(out), "--timeout", "240"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=580, env=_env(),
                            cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    settings = report["settings"]
    assert settings["quick"] is True and report["reference"] == "megatron-1f1b"
    assert (settings["variants"], settings["data"], settings["corpus"]) == (variants, "masked",
                                                                           "long-tailed")
    # The v variants build two chunks a rank, the unpacked one other batches: part 2 only.
    names = settings["variants"][:4]
    one = report["one_process"]
    assert sorted(one["times_ms"]) == sorted(names)
    batches, batch_skip = settings["batches"], settings["batch_skip"]
    for name in names:
        assert len(one["times_ms"][name]) == batches and all(ms > 0 for ms in one["times_ms"][name])
        ratio = one["summary"][name]["ratio_to_reference"]
        assert ratio["pairs"] == batches - batch_skip
        assert 0 < ratio["interval_95"][0] <= ratio["median"] <= ratio["interval_95"][1], ratio
        if name == "megatron-1f1b":
            assert ratio["median"] == 1.0 and one["busy_ms"][name][0] is None
        else:  # the runtime's variants: each rank's compute time, within the call's time
            kinds = {"F", "B", "W"} if name == "dpp:adaptive+W" else {"F", "B"}
            for per_rank, total in zip(one["busy_ms"][name], one["times_ms"][name]):
                assert len(per_rank) == 2 and all(set(rank) == kinds for rank in per_rank), per_rank
                assert all(0 < sum(rank.values()) <= total for rank in per_rank), (per_rank, total)
    # Every batch ran every variant once, the order rotating.
    assert [order[0] for order in one["order"]] == [names[i % len(names)] for i in range(batches)]
    assert "ratio_to_sorted" in one["summary"]["dpp:adaptive"]
    assert "compute_ratio_to_fused" in one["summary"]["dpp:adaptive+W"]
    rounds, iters, skip = settings["rounds"], settings["iters"], settings["skip"]
    for name in settings["variants"]:
        runs = report["times_ms"][name]
        assert len(runs) == rounds and all(len(run) == iters for run in runs), runs
        assert all(ms > 0 for run in runs for ms in run), runs
        row = report["summary"][name]
        ratio = row["ratio_to_reference"]
        assert ratio["pairs"] == len(ratio["ratios"]) == rounds * (iters - skip)
        low, high = ratio["interval_95"]
        assert 0 < low <= ratio["median"] <= high, ratio
        if name == "megatron-1f1b":
            assert ratio["median"] == 1.0
        assert len(row["forward_ms"]) == 2 and all(ms > 0 for ms in row["forward_ms"]), row
        assert 0 <= row["per_task_send_posting_ms"] <= row["per_task_overhead_ms"], row
        # A measured iteration cannot beat the chain of its own measured tasks (1% for rounding).
        assert row["time_over_critical_path"] >= 0.99, row
        assert 0 <= row["bubble"] < 1, row
        assert len(report["trace_stats"][name]) == rounds
        # Tokens/s from each iteration's log line; the ratio is by round (other data, other tokens).
        assert all(len(run) == iters and all(r > 0 for r in run) for run in report["tokens_per_s"][name])
        assert row["tokens_per_s"] > 0 and len(row["tokens_ratios"]) == rounds
        if name == "megatron-1f1b":
            assert row["tokens_ratio"] == 1.0
    per_iteration = {name: statistics.median(ms * rate / 1000.0 for run_ms, run_rates in
                                             zip(report["times_ms"][name], report["tokens_per_s"][name])
                                             for ms, rate in zip(run_ms, run_rates))
                     for name in ("megatron-1f1b", "dpp:adaptive+W/unpacked")}
    # A window holds --seq-length tokens, an unpacked sample at most that (here, at 64 tokens, most
    # documents are longer: about as many); the log's tokens/s has one decimal.
    assert per_iteration["megatron-1f1b"] >= 0.999 * per_iteration["dpp:adaptive+W/unpacked"], per_iteration
    # The unmasked run trains on the same windows: the same tokens an iteration (the log's
    # tokens/s has one decimal, the times are the same run's).
    unmasked = statistics.median(ms * rate / 1000.0 for run_ms, run_rates in
                                 zip(report["times_ms"]["megatron-1f1b/unmasked"],
                                     report["tokens_per_s"]["megatron-1f1b/unmasked"])
                                 for ms, rate in zip(run_ms, run_rates))
    assert abs(unmasked / per_iteration["megatron-1f1b"] - 1) < 0.01, (unmasked, per_iteration)
    assert "/ megatron-1f1b: median" in result.stdout


def test_the_long_tailed_corpus_is_lognormal_documents_ending_in_eod(tmp_path):
    """long_tailed_corpus.py: drawn lengths have the asked mean and spread, the dataset holds them
    (+1 for the EOD token, the sample vocabulary's <|endoftext|>), and the same settings give the
    same bytes."""
    ensure_sample_data()
    sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
    import numpy as np
    from long_tailed_corpus import EOD_TOKEN, SAMPLE_VOCAB, lognormal_lengths, write_corpus
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    many = lognormal_lengths(200_000, mean=512, cv=1.5, longest=10**9, seed=1)
    assert abs(many.mean() / 512 - 1) < 0.03 and abs(many.std() / many.mean() / 1.5 - 1) < 0.1
    assert lognormal_lengths(50, 512, 1.5, 300, 7).max() == 300  # clipped
    settings = dict(documents=40, mean=64.0, cv=1.5, longest=256, seed=3)
    prefix = write_corpus(str(tmp_path / "a"), **settings)
    dataset = IndexedDataset(prefix)
    eod = json.load(open(SAMPLE_VOCAB))[EOD_TOKEN]
    expected = lognormal_lengths(40, 64.0, 1.5, 256, 3) + 1
    assert list(dataset.sequence_lengths) == list(expected)
    assert all(dataset[i][-1] == eod and eod not in dataset[i][:-1] for i in range(len(dataset)))
    again = write_corpus(str(tmp_path / "b"), **settings)
    assert open(prefix + ".bin", "rb").read() == open(again + ".bin", "rb").read()
    assert np.unique(np.concatenate([dataset[i] for i in range(len(dataset))])).size > 100  # real text


def test_suffixed_variants_run_their_own_data_whatever_data_is():
    sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
    import real_model_bench as bench

    args = bench.parse_args(["--data", "masked", "--variants", "megatron-1f1b",
                             "megatron-1f1b/unmasked", "dpp:adaptive/unpacked"])
    args.data_prefix = None
    masking, varlen = "--dataloader-inter-document-masking", "--variable-seq-lengths"
    assert masking in bench.gpt_flags(args, variant="megatron-1f1b")
    unmasked = bench.gpt_flags(args, variant="megatron-1f1b/unmasked")
    assert masking not in unmasked and varlen not in unmasked
    unpacked = bench.gpt_flags(args, variant="dpp:adaptive/unpacked")
    assert varlen in unpacked and masking not in unpacked and "--use-dpp" in unpacked
    assert bench.one_process_variants(args.variants) == ["megatron-1f1b"]
    with pytest.raises(SystemExit):  # /unmasked compares with masked windows only
        bench.parse_args(["--data", "packed", "--variants", "megatron-1f1b/unmasked"])


def test_every_variant_is_a_command_line_the_trainer_accepts(monkeypatch):
    """Each variant's flags, on the benchmark's own model and data flags, pass the trainer's flag
    check (the budget variants' --dpp-memory-budget 1.25x among them)."""
    sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
    import real_model_bench as bench

    from megatron_dpp.arguments import parse_args

    ensure_sample_data()
    monkeypatch.setenv("WORLD_SIZE", "2")  # the benchmark's two ranks
    args = bench.parse_args(["--data", "masked", "--quick"])
    args.data_prefix = None
    for name in bench.VARIANTS:
        data = bench.variant_data(name)
        if data is not None:
            args.data = "masked" if data == "packed" else "packed"
        parsed = parse_args(bench.gpt_flags(args, variant=name), prog="real_model_bench")
        assert parsed.use_dpp == ("--use-dpp" in bench.VARIANTS[name]), name
        if "1.25x" in name:
            assert parsed.dpp_memory_budget is not None, name


def test_per_task_overhead_leaves_out_a_ranks_fill_and_drain(tmp_path):
    """Two ranks, one iteration: rank 0 runs F0 (0-10 ms) and B0 (30-50 ms), nothing recorded in
    between (20 ms of its own loop); rank 1 runs F0 (12-20) and B0 (20-28) and is then outside
    the runtime until the window ends at 50 ms. Only rank 0's 20 ms count: 5 ms over 4 tasks (the
    whole window's uncovered time, 20 + 12 + 22 ms, would say 13.5)."""
    sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
    import real_model_bench as bench

    from megatron_dpp.trace import chrome
    from megatron_dpp.trace.recorder import TraceRecorder

    run = tmp_path / "run-pp2-dpp"
    run.mkdir()
    schedule = {0: [("F0.0", 0, 10), ("B0.0", 30, 50)], 1: [("F0.0", 12, 20), ("B0.0", 20, 28)]}
    for rank, tasks in schedule.items():
        recorder = TraceRecorder(rank, f"rank {rank} (pp {rank}, tp 0, dp 0)")
        recorder.mark("iteration 0", 0.0, {"forward_only": False, "policy": "dpp:adaptive"})
        for name, start, end in tasks:
            recorder.task(name, "forward" if name[0] == "F" else "backward", start / 1e3, end / 1e3,
                          {"iteration": 0, "microbatch": 0, "chunk": 0, "virtual_stage": rank,
                           "tokens": 100})
        sent = ("F0.0", 10) if rank == 0 else ("B0.0", 28)
        got = ("B0.0", 28) if rank == 0 else ("F0.0", 10)
        recorder.message(f"send {sent[0]}", sent[1] / 1e3,
                         {"peer": 1 - rank, "tag": int(sent[0][0] == "B"), "bytes": 64})
        recorder.message(f"recv {got[0]}", got[1] / 1e3,
                         {"peer": 1 - rank, "tag": int(got[0][0] == "B"), "bytes": 64})
        chrome.write_trace(str(run / f"benchmark-rank{rank}.json"), recorder.events,
                           {"run": "run-pp2-dpp", "rank": rank, "world_size": 2,
                            "pipeline_rank": rank, "tensor_rank": 0, "data_rank": 0,
                            "policy": "dpp:adaptive"})
    stats = bench.trace_stats(str(tmp_path), skip=0)
    assert stats["per_task_overhead_ms"] == pytest.approx(5.0, abs=1e-6), stats
    assert stats["per_task_send_posting_ms"] == 0


def test_layouts_go_to_the_variants_of_their_chunk_count(monkeypatch):
    """--layout reaches the one-chunk variants (and part 1), --chunked-layout the /v and /vpp2
    ones; a layout string with the wrong stage or layer count stops in one line."""
    sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
    import real_model_bench as bench

    args = bench.parse_args(["--data", "masked", "--layout", "Ettt|tL",
                             "--chunked-layout", "Et|tt|t|L"])
    layout = "--pipeline-model-parallel-layout"
    assert bench.layout_flags(args, None) == [layout, "Ettt|tL"]
    assert bench.layout_flags(args, "dpp:adaptive+W") == [layout, "Ettt|tL"]
    assert bench.layout_flags(args, "dpp:adaptive+W/v") == [layout, "Et|tt|t|L"]
    assert bench.layout_flags(args, "interleaved-1f1b/vpp2") == [layout, "Et|tt|t|L"]
    assert bench.layout_flags(bench.parse_args([]), "dpp:adaptive+W/v") == []
    # The layout string gives the chunk count: Megatron-LM refuses it beside the flag.
    assert bench.OTHER_CHUNKS_FLAG not in bench.variant_flags(args, "dpp:adaptive+W/v")
    assert "v" in bench.variant_flags(args, "dpp:adaptive+W/v")
    assert bench.OTHER_CHUNKS_FLAG in bench.variant_flags(bench.parse_args([]), "zb-v+W/v")
    assert bench.layout_problem("Ett|ttL", 2, 4) is None
    assert bench.layout_problem("Et|tt|t|L", 2, 4) == "4 stages, these variants have 2"
    assert bench.layout_problem("Et|t|t|L", 4, 4) == "3 transformer layers, --num-layers is 4"
    with pytest.raises(SystemExit):
        bench.parse_args(["--chunked-layout", "Ettt|tL"])
