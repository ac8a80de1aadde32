"""The hardware profile: Galvatron's files read and written, presets, the cost arithmetic, and the
profiler run on this machine (2 processes, --quick)."""
from __future__ import annotations

import json
import math

import pytest
from _hardware_profile import run_profile_script

from megatron_dpp.search.errors import SearchInputError
from megatron_dpp.search.hardware import (
    PRESETS, HardwareProfile, collective_group, group_sizes, load_hardware, pipeline_group,
    pipeline_sizes, read_hardware_dir, write_hardware_dir)


def _profile(**changes) -> HardwareProfile:
    figures = dict(
        num_nodes=1, gpus_per_node=4,
        allreduce_busbw_gbps={(4, True): 100.0, (2, True): 200.0, (2, False): 50.0},
        p2p_gbps={2: 10.0, 4: 5.0}, overlap_coefficient=1.25,
        sp_time_ms={("allreduce", 4, 1): 0.5, ("all2all", 4, 1): 0.25, ("allreduce", 2, 8): 3.0},
        matmul_tflops={"bf16": 100.0, "fp32": 10.0}, source="hand-written for the test")
    figures.update(changes)
    return HardwareProfile(**figures)


def test_write_then_read_gives_the_same_profile(tmp_path):
    profile = _profile()
    written = write_hardware_dir(profile, tmp_path)
    assert sorted(path.name for path in written) == sorted([
        "allreduce_bandwidth_1nodes_4gpus_per_node.json", "p2p_bandwidth_1nodes_4gpus_per_node.json",
        "overlap_coefficient.json", "sp_time_1nodes_4gpus_per_node.json",
        "megatron_dpp_compute_1nodes_4gpus_per_node.json"])
    assert read_hardware_dir(tmp_path, 1, 4) == profile
    # The keys on disk are Galvatron's.
    allreduce = json.loads((tmp_path / "allreduce_bandwidth_1nodes_4gpus_per_node.json").read_text())
    assert allreduce == {"allreduce_size_4_consec_1": 100.0, "allreduce_size_2_consec_1": 200.0,
                         "allreduce_size_2_consec_0": 50.0}


def test_reads_a_directory_galvatron_wrote(tmp_path):
    files = {
        "allreduce_bandwidth_2nodes_8gpus_per_node.json": {
            "allreduce_size_16_consec_1": 150.5, "allreduce_size_8_consec_1": 180.0,
            "allreduce_size_8_consec_0": 40.0, "allreduce_size_4_consec_1": 190,
            "allreduce_size_4_consec_0": 30.0, "allreduce_size_2_consec_1": 200.0,
            "allreduce_size_2_consec_0": 20.0},
        "p2p_bandwidth_2nodes_8gpus_per_node.json": {"pp_size_2": 20.0, "pp_size_4": 21.0,
                                                      "pp_size_8": 22.0, "pp_size_16": 23.0},
        "overlap_coefficient.json": {"overlap_coe": 1.1388},
        "sp_time_2nodes_8gpus_per_node.json": {"allreduce_size_8_1MB_time": 0.05,
                                               "allreduce_size_8_2MB_time": 0.07,
                                               "all2all_size_8_1MB_time": 0.04},
    }
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content, indent=4))
    profile = read_hardware_dir(tmp_path, 2, 8)
    assert profile.allreduce_busbw_gbps[(16, True)] == 150.5
    assert profile.allreduce_busbw_gbps[(4, True)] == 190.0
    assert profile.allreduce_busbw_gbps[(2, False)] == 20.0
    assert dict(profile.p2p_gbps) == {2: 20.0, 4: 21.0, 8: 22.0, 16: 23.0}
    assert profile.overlap_coefficient == 1.1388
    assert dict(profile.sp_time_ms) == {("allreduce", 8, 1): 0.05, ("allreduce", 8, 2): 0.07,
                                        ("all2all", 8, 1): 0.04}
    assert dict(profile.matmul_tflops) == {}
    assert str(tmp_path) in profile.source
    assert "allreduce_bandwidth_2nodes_8gpus_per_node.json" in profile.source
    assert "sp_time_2nodes_8gpus_per_node.json" in profile.source
    with pytest.raises(SearchInputError, match="no matmul TFLOP/s for bf16"):
        profile.matmul_ms(1e12, "bf16")
    # load_hardware takes the directory too.
    assert load_hardware(str(tmp_path), 2, 8) == profile


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_load_and_name_their_source(name, tmp_path):
    profile = load_hardware(name, 2, 8)
    assert profile.source.startswith(f"preset {name}: NVIDIA ")
    assert "datasheet" in profile.source
    # Every key Galvatron's reader asks for on 2 x 8: consec_1 of the world, both below it.
    assert set(profile.allreduce_busbw_gbps) == {(16, True), *((size, flag) for size in (8, 4, 2)
                                                               for flag in (True, False))}
    assert set(profile.p2p_gbps) == {2, 4, 8, 16}
    assert set(profile.matmul_tflops) == {"bf16", "fp16", "fp32"}
    assert 1.1 <= profile.overlap_coefficient <= 1.3
    # Inside a node NVLink, across nodes the NICs: a strided pair (one GPU on each node) is slower.
    assert profile.allreduce_busbw_gbps[(2, True)] > profile.allreduce_busbw_gbps[(2, False)]
    write_hardware_dir(profile, tmp_path)
    assert read_hardware_dir(tmp_path, 2, 8) == profile


def test_preset_figures_are_the_datasheets():
    h100 = PRESETS["8xH100-nvlink-ib400"](2, 8)
    assert h100.matmul_tflops["bf16"] == 989.4
    assert h100.allreduce_busbw_gbps[(8, True)] == 450.0  # NVLink 4: 900 GB/s both ways
    assert h100.allreduce_busbw_gbps[(16, True)] == 400.0  # 8 x 400 Gb/s per node
    assert h100.allreduce_busbw_gbps[(2, False)] == 50.0  # one 400 Gb/s NIC
    assert h100.p2p_gbps[2] == 50.0
    a100 = PRESETS["8xA100-nvlink-ib200"](1, 8)
    assert a100.matmul_tflops["bf16"] == 312.0
    assert a100.allreduce_busbw_gbps[(8, True)] == 300.0
    assert a100.p2p_gbps[8] == 300.0


def test_unknown_preset_names_the_presets():
    with pytest.raises(SearchInputError) as error:
        load_hardware("8xB200", 1, 8)
    message = str(error.value)
    assert "\n" not in message
    assert all(name in message for name in PRESETS)


def test_preset_refuses_more_gpus_than_its_node_has():
    with pytest.raises(SearchInputError, match="1 to 8 GPUs"):
        load_hardware("8xA100-nvlink-ib200", 1, 16)


def test_missing_files_are_one_line(tmp_path):
    (tmp_path / "overlap_coefficient.json").write_text('{"overlap_coe": 1.2}')
    with pytest.raises(SearchInputError) as error:
        read_hardware_dir(tmp_path, 1, 8)
    message = str(error.value)
    assert "\n" not in message
    assert "allreduce_bandwidth_1nodes_8gpus_per_node.json" in message
    assert "p2p_bandwidth_1nodes_8gpus_per_node.json" in message


def test_malformed_files_are_one_line(tmp_path):
    write_hardware_dir(_profile(), tmp_path)
    (tmp_path / "p2p_bandwidth_1nodes_4gpus_per_node.json").write_text('{"pp_size_2": "fast"}')
    with pytest.raises(SearchInputError, match="is not a number"):
        read_hardware_dir(tmp_path, 1, 4)
    (tmp_path / "p2p_bandwidth_1nodes_4gpus_per_node.json").write_text('{"pp_sz_2": 1.0}')
    with pytest.raises(SearchInputError, match="unexpected key 'pp_sz_2'"):
        read_hardware_dir(tmp_path, 1, 4)
    write_hardware_dir(_profile(), tmp_path)
    (tmp_path / "overlap_coefficient.json").write_text("{not json")
    with pytest.raises(SearchInputError, match="not readable as JSON"):
        read_hardware_dir(tmp_path, 1, 4)


def test_bad_figures_are_refused():
    with pytest.raises(SearchInputError, match="positive"):
        _profile(p2p_gbps={2: 0.0})
    with pytest.raises(SearchInputError, match="at least 1"):
        _profile(overlap_coefficient=0.9)


def test_groups_are_galvatrons():
    assert group_sizes(16) == [16, 8, 4, 2]
    assert group_sizes(6) == [6, 3]
    assert pipeline_sizes(16) == [2, 4, 8, 16]
    assert pipeline_sizes(16, max_pp_size=4) == [2, 4]
    assert collective_group(16, 4, True, 1) == [4, 5, 6, 7]
    assert collective_group(16, 4, False, 1) == [1, 5, 9, 13]  # one rank of each block
    assert pipeline_group(8, 4, 0) == [0, 2, 4, 6]


def test_allreduce_and_p2p_arithmetic():
    profile = _profile()
    gib = 1 << 30
    # Ring all-reduce: 2(n-1)/n * bytes / bus bandwidth.
    assert profile.allreduce_ms(gib, 4) == pytest.approx(2 * 3 / 4 * gib / 100e9 * 1e3)
    assert profile.allreduce_ms(gib, 2, consecutive=True) == pytest.approx(gib / 200e9 * 1e3)
    assert profile.allreduce_ms(gib, 2, consecutive=False) == pytest.approx(gib / 50e9 * 1e3)
    assert profile.allreduce_ms(gib, 1) == 0.0
    # The whole cluster is one group whether called consecutive or not.
    assert profile.allreduce_ms(gib, 4, consecutive=False) == profile.allreduce_ms(gib, 4)
    # Not measured: the nearest measured size not smaller (3 -> 4), else the largest (8 -> 4).
    assert profile.allreduce_ms(gib, 3) == pytest.approx(2 * 2 / 3 * gib / 100e9 * 1e3)
    assert profile.allreduce_ms(gib, 8) == pytest.approx(2 * 7 / 8 * gib / 100e9 * 1e3)
    # Point-to-point: bytes / bandwidth of the pipeline size.
    assert profile.p2p_ms(10**9, 2) == pytest.approx(100.0)
    assert profile.p2p_ms(10**9, 4) == pytest.approx(200.0)
    assert profile.p2p_ms(10**9, 3) == pytest.approx(200.0)
    assert profile.p2p_ms(10**9, 1) == 0.0
    assert profile.matmul_ms(1e12, "bf16") == pytest.approx(10.0)


def test_latency_adds_to_every_message_and_round_trips(tmp_path):
    """alpha + bytes / bandwidth where the profile has latencies (our compute file); a profile
    without them (Galvatron's files, the presets) prices bandwidth only."""
    plain = _profile()
    timed = _profile(allreduce_latency_ms={2: 0.25, 4: 0.5}, p2p_latency_ms={2: 0.125})
    assert timed.allreduce_ms(4096, 2) == pytest.approx(0.25 + plain.allreduce_ms(4096, 2))
    assert timed.allreduce_ms(4096, 2, consecutive=False) == pytest.approx(
        0.25 + plain.allreduce_ms(4096, 2, consecutive=False))
    assert timed.allreduce_ms(4096, 3) == pytest.approx(0.5 + plain.allreduce_ms(4096, 3))  # nearest not smaller
    assert timed.p2p_ms(4096, 4) == pytest.approx(0.125 + plain.p2p_ms(4096, 4))  # the largest measured
    assert timed.allreduce_ms(4096, 1) == 0.0 and timed.p2p_ms(4096, 1) == 0.0
    assert plain.allreduce_latency(2) == 0.0 and plain.p2p_latency(2) == 0.0
    write_hardware_dir(timed, tmp_path)
    assert read_hardware_dir(tmp_path, 1, 4) == timed
    compute = json.loads((tmp_path / "megatron_dpp_compute_1nodes_4gpus_per_node.json").read_text())
    assert compute["allreduce_latency_ms"] == {"2": 0.25, "4": 0.5}
    with pytest.raises(SearchInputError, match="a latency must be a number >= 0"):
        _profile(p2p_latency_ms={2: -1.0})
    compute["p2p_latency_ms"] = {"two": 1.0}
    (tmp_path / "megatron_dpp_compute_1nodes_4gpus_per_node.json").write_text(json.dumps(compute))
    with pytest.raises(SearchInputError, match="p2p_latency_ms must be an object of size -> ms"):
        read_hardware_dir(tmp_path, 1, 4)


def test_nothing_measured_is_a_search_input_error():
    profile = _profile(allreduce_busbw_gbps={}, p2p_gbps={})
    with pytest.raises(SearchInputError, match="no all-reduce bandwidth"):
        profile.allreduce_ms(1 << 20, 2)
    with pytest.raises(SearchInputError, match="no point-to-point bandwidth"):
        profile.p2p_ms(1 << 20, 2)


def test_profile_script_refuses_bad_flags_in_one_line(tmp_path):
    result = run_profile_script({}, "--output-dir", str(tmp_path), "--sp-sizes-mb", "1,2", timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "at least 8 sizes" in result.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.timeout(150)
def test_quick_profile_on_this_machine(quick_hardware_profile):
    out, result = quick_hardware_profile
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    names = sorted(path.name for path in out.iterdir())
    assert names == sorted([
        "allreduce_bandwidth_1nodes_2gpus_per_node.json", "p2p_bandwidth_1nodes_2gpus_per_node.json",
        "overlap_coefficient.json", "sp_time_1nodes_2gpus_per_node.json",
        "megatron_dpp_compute_1nodes_2gpus_per_node.json"])
    profile = read_hardware_dir(out, 1, 2)
    assert set(profile.allreduce_busbw_gbps) == {(2, True)}
    assert set(profile.p2p_gbps) == {2}
    assert profile.overlap_coefficient >= 1.0
    assert "fp32" in profile.matmul_tflops
    # Small-message latencies (ours): one per consecutive group size and pipeline size.
    assert set(profile.allreduce_latency_ms) == {2} and set(profile.p2p_latency_ms) == {2}
    assert all(math.isfinite(ms) and ms >= 0 for ms in [*profile.allreduce_latency_ms.values(),
                                                         *profile.p2p_latency_ms.values()])
    assert {mb for (_op, _size, mb) in profile.sp_time_ms} == set(range(1, 9))
    assert all(math.isfinite(value) and value > 0 for value in profile.allreduce_busbw_gbps.values())
    assert "gloo" in profile.source and "p2p over --p2p-transport auto" in profile.source
    # The summary says which transport carried the p2p figure.
    assert "point-to-point bandwidth" in result.stdout and "latency (ms, small messages)" in result.stdout
    assert ("shm_tensor" in result.stdout) or ("torch.distributed" in result.stdout)
