"""benchmarks/search_vs_measured.py --quick runs end to end: the session's quick hardware profile
of this machine (conftest.py), a quick model profile, the search's prediction of two layouts of
the tiny GPT, one training run of each (2 pinned ranks), the table and the target lines on stdout,
everything in the JSON with finite numbers. Whether the targets are met is the benchmark's to
report, not a test's to assert (timings on shared CPUs are noisy)."""
import json
import math
import os
import subprocess
import sys

import pytest

from _train_util import REPO_ROOT, _env, ensure_sample_data

BENCHMARK = os.path.join(REPO_ROOT, "benchmarks", "search_vs_measured.py")


def _finite_positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_run_prints_the_table_and_targets_and_writes_the_json(tmp_path,
                                                                     quick_hardware_profile):
    ensure_sample_data()
    # The hardware figures: the session's quick profile of this machine (what the benchmark's
    # --quick would measure itself: profile_hardware.sh --quick, 2 processes, fp32).
    hardware, profiled = quick_hardware_profile
    assert profiled.returncode == 0, profiled.stdout[-3000:] + profiled.stderr[-3000:]
    out = tmp_path / "search_vs_measured.json"
    command = [sys.executable, BENCHMARK, "--quick", "--work-dir", str(tmp_path / "profiles"),
               "--hardware", str(hardware), "--json", str(out), "--timeout", "120"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=280, env=_env(),
                            cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # The model profile was measured into --work-dir, the given hardware figures used as they are.
    assert (tmp_path / "profiles" / "model" / "computation_profiling_fp32_hidden_128_head_4.json").is_file()
    assert not (tmp_path / "profiles" / "hardware").exists()
    assert "profiling the hardware" not in result.stderr

    report = json.loads(out.read_text())
    names = ["pp2-1f1b", "tp2"]
    assert list(report["layouts"]) == names and report["reference"] == "pp2-1f1b"
    iters, skip = report["iters"], report["skip"]
    for name in names:
        row = report["layouts"][name]
        runs = row["iteration_ms"]
        assert len(runs) == report["rounds"] == 1 and len(runs[0]) == iters - skip, runs
        for key in ("predicted_ms", "measured_ms", "predicted_over_measured",
                    "measured_ratio_to_reference", "predicted_ratio_to_reference"):
            assert _finite_positive(row[key]), (name, key, row[key])
        low, high = row["interval_95"]
        assert low <= row["measured_ms"] <= high
        assert math.isclose(row["predicted_over_measured"], row["predicted_ms"] / row["measured_ms"])
        assert sorted(report["layouts"][n]["rank_predicted"] for n in names) == [1, 2]
        assert sorted(report["layouts"][n]["rank_measured"] for n in names) == [1, 2]
        breakdown = report["breakdown"][name]
        assert _finite_positive(breakdown["pipeline_ms"]) and _finite_positive(breakdown["layer_forward_ms"])
    assert report["layouts"]["pp2-1f1b"]["measured_ratio_to_reference"] == 1.0
    assert report["search_top"] and all(_finite_positive(entry["time_ms"]) for entry in report["search_top"])
    for target in ("top_ranking", "top_ranking_up_to_ties", "within_tolerance"):
        assert isinstance(report["targets"][target]["met"], bool)

    # stdout: the table (one row per layout) and the three target lines, each met or not met.
    lines = result.stdout.splitlines()
    assert any(line.startswith("| layout | predicted ms | measured ms") for line in lines)
    assert sum(line.startswith(f"| {name} |") for line in lines for name in names) == len(names)
    targets = [line for line in lines if line.startswith("# target")]
    assert len(targets) == 3 and all(": met" in line or ": not met" in line for line in targets), targets


def test_order_conflicts_count_only_pairs_the_measurement_orders():
    sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
    from search_vs_measured import order_conflicts

    # Two rounds of 4 iterations: a is 1% faster than b, but the pairs straddle 1 (a tie);
    # c is clearly 20% slower than both; d is clearly 10% faster than c.
    times = {"a": [[100, 99, 101, 100], [100, 98, 100, 101]],
             "b": [[101, 98, 102, 101], [99, 100, 101, 100]],
             "c": [[120, 119, 121, 120], [121, 120, 119, 120]],
             "d": [[108, 107, 109, 108], [109, 108, 107, 108]]}
    assert order_conflicts(["b", "a", "d", "c"], 3, times) == []  # a/b tie; d faster than c
    conflicts = order_conflicts(["c", "a", "b", "d"], 3, times)
    assert {(c["predicted_faster"], c["predicted_slower"]) for c in conflicts} == {
        ("c", "a"), ("c", "b"), ("c", "d")}
    assert all(c["interval_95"][0] > 1.0 for c in conflicts)
    # Only pairs with a layout of the predicted top: d over c below the top 2 is not checked.
    assert order_conflicts(["a", "b", "c", "d"], 2, times) == []


def test_bad_flags_are_one_line_and_exit_2():
    for argv in (["--rounds", "0"], ["--skip", "40"], ["--layouts", "pp9"], ["--no-such-flag"],
                 ["--model-profile", "/nonexistent/dir"]):
        result = subprocess.run([sys.executable, BENCHMARK, *argv], capture_output=True, text=True,
                                timeout=60, env=_env(), cwd=REPO_ROOT)
        assert result.returncode == 2, (argv, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, (argv, result.stderr)
        assert result.stdout == ""


def test_profiles_are_measured_unless_given(tmp_path, monkeypatch):
    """Without --hardware and --model-profile both profilers run into --work-dir (the quick test
    above passes the session's hardware profile); given directories are used as they are."""
    sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
    import search_vs_measured

    commands = []
    monkeypatch.setattr(search_vs_measured, "run_profiler",
                        lambda command, what, timeout, env=None: commands.append((what, command, env)))
    args = search_vs_measured.parse_args(["--quick", "--work-dir", str(tmp_path)])
    hardware, model = search_vs_measured.profiles(args, [2], 4096)
    assert (hardware, model) == (str(tmp_path / "hardware"), str(tmp_path / "model"))
    (_, hardware_command, hardware_env), (_, model_command, _) = commands
    assert [what for what, _, _ in commands] == ["hardware", "model"]
    assert hardware_command[1].endswith("run_scripts/profile_hardware.sh")
    assert hardware_command[2:] == ["--output-dir", hardware, "--dtypes", "fp32", "--quick"]
    assert hardware_env == {"NPROC": "2"}
    assert model_command[1].endswith("run_scripts/profile_model.sh")
    assert model_command[-3:] == ["--output-dir", model, "--quick"]
    assert model_command[model_command.index("--micro-batch-sizes") + 1] == "2"
    assert model_command[model_command.index("--vocab-size") + 1] == "4096"

    commands.clear()
    given = search_vs_measured.parse_args(["--quick", "--work-dir", str(tmp_path), "--hardware",
                                           str(tmp_path), "--model-profile", str(tmp_path)])
    assert search_vs_measured.profiles(given, [2], 4096) == (str(tmp_path), str(tmp_path))
    assert commands == []
