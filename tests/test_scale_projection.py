"""benchmarks/scale_projection.py --quick: the structure of its JSON and checks that can fail.

The bounds, and why they hold:
- equal lengths at the default ('auto') budget: dpp:adaptive runs exactly Megatron's order
  (docs/scheduling.md; tests/test_sched_properties.py checks it on random pipelines), so its
  ratio is 1; dpp:adaptive+W finishes no later than Megatron's order with each W after its B
  (same property test), which finishes no later than the fused order when tasks cost no overhead
  (the same order, every input gradient sent no later);
- no schedule beats the simulator's pipeline bound, and no dynamic policy exceeds its budget;
- on the v placement (groups of two chunks a rank) the same holds against ZB-V's order: at equal
  lengths dpp:adaptive/v runs it (its spine), and zb-v, a static order, keeps to the budget sized
  by itself;
- packed windows (packed8k, packed32k) hold their window's tokens whatever their documents: the
  memory of a layout grows with the window, and a layout over 80 GB is priced and says so.
"""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "scale_projection.py")
SCHEDULES = ("megatron", "dpp:adaptive", "dpp:adaptive+W")
V_SCHEDULES = ("zb-v", "zb-v+W", "dpp:adaptive/v", "dpp:adaptive+W/v")
DISTRIBUTIONS = ("uniform", "sample", "longtail", "packed8k", "packed32k")
PACKED = {"packed8k": 8192, "packed32k": 32768}
EPSILON = 1e-9


def run_script(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *flags], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def quick_output() -> str:
    done = run_script("--quick", "--json")
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def result(quick_output) -> dict:
    return json.loads(quick_output)


def groups(rows: list[dict]) -> dict:
    keyed = {}
    for row in rows:
        key = (row["model"], row["pp"], row["vpp"], row["distribution"])
        keyed.setdefault(key, {})[row["schedule"]] = row
    return keyed


def test_every_group_has_every_schedule(result):
    keyed = groups(result["rows"])
    # --quick: 13B at pp 4, vpp 1 and 2, every distribution.
    expected = {(vpp, name) for vpp in (1, 2) for name in DISTRIBUTIONS}
    assert {(key[2], key[3]) for key in keyed} == expected
    for key, group in keyed.items():
        assert tuple(group) == SCHEDULES + (V_SCHEDULES if key[2] == 2 else ())
        assert group["megatron"]["ratio"] == 1.0


def test_v_rows_are_priced_within_their_memory(result):
    """Groups of two chunks a rank carry the v rows, on the v placement, each within 80 GB (at
    2048 tokens) and within its own budget on every rank (zb-v too: the 'auto' budget of the v is
    its order's)."""
    facts = result["assumptions"]
    v_groups = {key: group for key, group in groups(result["rows"]).items() if key[2] == 2}
    assert len(v_groups) == len(DISTRIBUTIONS)  # --quick: 13B pp 4, every distribution
    for key, group in v_groups.items():
        for name in V_SCHEDULES:
            row = group[name]
            assert row["placement"] == "v" and row["layout"].endswith("/v"), row
            if key[3] not in PACKED:
                assert row["fits_memory"] and row["memory_gb"] <= facts["gpu_memory_gb"], row
            assert row["peak_over_budget"] <= 1.0 + EPSILON, row
            assert len(row["budget_by_rank_gb"]) == row["pp"] and min(row["budget_by_rank_gb"]) > 0
        for name in SCHEDULES:
            assert group[name]["placement"] == "interleaved"
        # Split backwards hold each W's stash; the policy does not change the layout's memory.
        assert group["zb-v+W"]["memory_gb"] > group["zb-v"]["memory_gb"]
        assert group["dpp:adaptive/v"]["memory_gb"] == group["zb-v"]["memory_gb"]
        assert group["dpp:adaptive+W/v"]["memory_gb"] == group["zb-v+W"]["memory_gb"]


def test_figures_are_sane(result):
    for row in result["rows"]:
        assert row["time_ms"] > 0 and row["ratio"] > 0, row
        assert 0.0 <= row["bubble"] < 1.0, row
        assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"], row
        # No schedule beats the pipeline bound; the dynamic policies stay within their budgets.
        assert row["pipeline_ms"] >= row["pipeline_bound_ms"] * (1 - EPSILON), row
        if row["schedule"] != "megatron":
            assert row["peak_over_budget"] <= 1.0 + EPSILON, row
        assert row["fits_memory"] == (row["memory_gb"] <= result["assumptions"]["gpu_memory_gb"])


def test_dpp_never_worse_with_equal_lengths(result):
    for key, group in groups(result["rows"]).items():
        if key[3] == "uniform":
            assert group["dpp:adaptive"]["ratio"] == pytest.approx(1.0, abs=EPSILON), key
            assert group["dpp:adaptive+W"]["ratio"] <= 1.0 + EPSILON, key
            if "zb-v" in group:  # dpp:adaptive/v follows ZB-V's order
                assert group["dpp:adaptive/v"]["time_ms"] == pytest.approx(group["zb-v"]["time_ms"],
                                                                           rel=EPSILON), key


def test_split_backward_holds_more_memory(result):
    for key, group in groups(result["rows"]).items():
        assert group["dpp:adaptive"]["memory_gb"] == group["megatron"]["memory_gb"], key
        assert group["dpp:adaptive+W"]["memory_gb"] > group["megatron"]["memory_gb"], key


def test_assumptions_are_stated(result):
    facts = result["assumptions"]
    assert "8xH100-nvlink-ib400" in facts["hardware"]
    on_node = facts["messages"]["on_node"]
    assert "CUDA IPC" in on_node and "../shared/gpu/README.md" in on_node
    assert "InfiniBand" in facts["messages"]["inter_node"]
    assert set(facts["distributions"]) == set(DISTRIBUTIONS)
    assert "lognormal:2048:1.5" in facts["distributions"]["packed32k"]
    assert facts["memory_budget"].startswith("'auto'")
    assert facts["memory_by_tp"]
    for group in facts["groups"]:
        times = group["task_times"]
        assert 0 < times["layer_weight_grad_ms"] < times["layer_backward_ms"]
        assert times["layer_forward_ms"] > 0 and group["hop"]["ms"] > 0
    assert result["command"].startswith("python benchmarks/scale_projection.py")


def test_packed_rows_are_priced_at_their_window(result):
    """Packed rows run at their window: memory grows with it; 13B at 32768 tokens does not fit
    80 GB, and its rows are there and say so (the table's GB column too)."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import scale_projection

    keyed = groups(result["rows"])
    seqs = {group["seq_length"] for group in result["assumptions"]["groups"]}
    assert seqs == {2048, *PACKED.values()}
    for (model, pp, vpp, dist), group in keyed.items():
        for row in group.values():
            assert row["seq_length"] == PACKED.get(dist, 2048), row
        if dist in PACKED:
            smaller = keyed[(model, pp, vpp, "uniform" if dist == "packed8k" else "packed8k")]
            for name, row in group.items():
                assert row["memory_gb"] > smaller[name]["memory_gb"], (dist, name)
                assert row["time_ms"] > smaller[name]["time_ms"], (dist, name)
    over = [row for row in result["rows"] if row["distribution"] == "packed32k"]
    assert over and not any(row["fits_memory"] for row in over)
    table = scale_projection.format_rows(over)
    assert table.count("(no) |") == len(over)


def test_cpu_overlap_beside_its_measurement(result):
    cpu = result["cpu_overlap"]
    names = [row["schedule"] for row in cpu["rows"]]
    assert names == ["1f1b", "1f1b-sorted", "dpp:adaptive", "dpp:adaptive+W"]
    for row in cpu["rows"]:
        assert 0 < row["ratio"] <= 1.0 + EPSILON and 0 <= row["bubble"] < 1
        assert len(row["measured"]["part1"]) == 2
    assert cpu["rank_speed"][0] == 1.0 and cpu["rank_speed"][1] > 1.0  # the loss stage is slower


def test_identical_inputs_give_identical_outputs(quick_output):
    again = run_script("--quick", "--json")
    assert again.returncode == 0, again.stderr
    assert again.stdout == quick_output


def test_help_explains_every_flag():
    done = run_script("--help")
    assert done.returncode == 0
    for flag in ("--models", "--pp", "--distributions", "--batches", "--packed-batches",
                 "--microbatches-per-stage",
                 "--ipc-latency-us", "--ipc-64mib-us", "--matmul-efficiency", "--sample-data",
                 "--cpu-batches", "--no-cpu-overlap", "--quick", "--json"):
        assert flag in done.stdout


def test_bad_flag_is_one_line():
    done = run_script("--ipc-latency-us", "600", "--ipc-64mib-us", "500")
    assert done.returncode == 2 and "--ipc-64mib-us must exceed" in done.stderr
