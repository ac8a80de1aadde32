"""Galvatron's profiler's own files, in its current and previous layouts (tests/fixtures/galvatron:
files written for these tests in those layouts, with our own numbers), read by the search: the
model profile's keys and file names, and a hardware directory without our compute file."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatron_dpp.search import cli
from megatron_dpp.search.errors import SearchInputError
from megatron_dpp.search.hardware import load_hardware, read_hardware_dir, with_matmul_rates
from megatron_dpp.search.model_profile import find_profile_files, read_model_profile_dir

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "galvatron"
ARGS = ["--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "512",
        "--global-batch-size", "16", "--num-nodes", "1", "--num-gpus-per-node", "8",
        "--memory-budget-gb", "40", "--bf16", "--top", "3", "--vocab-size", "4096"]


def test_current_layout_model_named_files_per_sample_times_and_skipped_keys():
    profile = read_model_profile_dir(FIXTURES / "model_current", 512, 8, "bf16")
    # layertype_0_bszB_seqS is per sample (Galvatron divides by the batch): x B here.
    assert profile.forward_ms == {(0, 1, 512): 1.2, (0, 2, 512): 2.0, (0, 4, 512): 3.6}
    assert profile.layer_forward_ms(0, 4, 512) == pytest.approx(3.6)
    assert profile.layer_backward_ms(0, 2, 512) == pytest.approx(4.0)  # 2x forward, no companion
    layer = profile.memory.layers[(0, True, 512)]
    assert layer.activation_mb_per_sample == {1: 9.0, 2: 4.5, 4: 2.25, 8: 1.125}
    assert layer.checkpoint_mb_per_sample == 0.5 and layer.parameter_mb == 12.0
    assert set(profile.memory.other) == {(stage, True, 512) for stage in
                                         ("pp_off", "pp_on_first", "pp_on_last")}
    assert profile.model == "unknown" and "per-sample" in profile.source
    assert "computation_profiling_bf16_toygpt_all.json" in profile.source


def test_previous_layout_without_batch_or_sequence_levels():
    profile = read_model_profile_dir(FIXTURES / "model_previous", 512, 8, "bf16")
    # "layertype_0": per sample, at the file name's seqlen512.
    assert profile.forward_ms == {(0, 1, 512): 1.1}
    assert profile.layer_forward_ms(0, 4, 512) == pytest.approx(4.4)
    layer = profile.memory.layers[(0, False, 512)]
    assert layer.activation_mb_per_sample == {1: 10.0, 2: 6.0, 4: 4.0, 8: 3.0}
    # other_memory's one figure holds at every tp size.
    assert profile.memory.other[("pp_on_last", False, 512)].model_states_mb == {
        1: 165.0, 2: 165.0, 4: 165.0, 8: 165.0}
    assert profile.memory.other[("pp_off", False, 512)].activation_mb_per_sample[2] == 22.0


def test_previous_layout_without_seqlen_in_the_name_takes_seq_length(tmp_path):
    for kind in ("computation", "memory"):
        shutil.copy(FIXTURES / "model_previous" / f"{kind}_profiling_bf16_hidden512_head8_seqlen512.json",
                    tmp_path / f"{kind}_profiling_bf16_hidden512_head8.json")
    with pytest.raises(SearchInputError, match="give --seq-length") as error:
        read_model_profile_dir(tmp_path, 512, 8, "bf16")
    assert "\n" not in str(error.value) and "layertype_0" in str(error.value)
    profile = read_model_profile_dir(tmp_path, 512, 8, "bf16", seq_length=1024)
    assert profile.forward_ms == {(0, 1, 1024): 1.1}


def test_hidden_head_names_with_several_lengths_and_other_keys():
    profile = read_model_profile_dir(FIXTURES / "model_hidden", 512, 8, "bf16")
    assert profile.forward_ms == {(0, 2, 256): 0.5, (0, 2, 512): 1.0}
    assert set(profile.memory.layers) == {(0, True, 256), (0, True, 512)}
    # Not this model's hidden size: no file of that name, nothing else picked.
    with pytest.raises(SearchInputError, match="computation_profiling_bf16_hidden_1024_head_8.json"):
        read_model_profile_dir(FIXTURES / "model_hidden", 1024, 8, "bf16")


def test_several_model_named_profiles_need_a_name(tmp_path):
    for name in ("toygpt_all", "toygpt_seqlen512_all"):
        for kind in ("computation", "memory"):
            shutil.copy(FIXTURES / "model_current" / f"{kind}_profiling_bf16_toygpt_all.json",
                        tmp_path / f"{kind}_profiling_bf16_{name}.json")
    with pytest.raises(SearchInputError, match="--model-profile-name") as error:
        read_model_profile_dir(tmp_path, 512, 8, "bf16")
    assert "\n" not in str(error.value)
    pairs = find_profile_files(tmp_path, 512, 8, "bf16", name="toygpt_seqlen512_all")
    assert pairs[0].galvatron and pairs[0].seq_length == 512
    assert read_model_profile_dir(tmp_path, 512, 8, "bf16", name="toygpt_all").forward_ms[(0, 4, 512)] == 3.6


@pytest.mark.parametrize("kind, content, message", [
    ("computation", {"layertype_0_bsz1_seq512": 1.0, "layer0_bsz1": 2.0}, "key 'layer0_bsz1'"),
    ("computation", {"layertype_0_bsz1_seq512": "slow"}, "must be a number"),
    ("memory", {"layertype_0_sp": {"512": {"parameter_size": 1.0}}}, "lacks"),
    ("memory", {"1_1_8_sp": {}, "other_mem_pp_off": {}}, "unknown key 'other_mem_pp_off'"),
])
def test_bad_galvatron_files_are_one_line_naming_file_and_key(tmp_path, kind, content, message):
    for name in ("computation", "memory"):
        shutil.copy(FIXTURES / "model_current" / f"{name}_profiling_bf16_toygpt_all.json", tmp_path)
    (tmp_path / f"{kind}_profiling_bf16_toygpt_all.json").write_text(json.dumps(content))
    with pytest.raises(SearchInputError, match=message) as error:
        read_model_profile_dir(tmp_path, 512, 8, "bf16")
    assert "\n" not in str(error.value) and f"{kind}_profiling_bf16_toygpt_all.json" in str(error.value)


def test_galvatron_hardware_directory_gets_matmul_rates_from_a_preset_or_a_quick_measurement():
    hardware = read_hardware_dir(FIXTURES / "hardware", 1, 8)
    assert hardware.allreduce_busbw(4, False) == 118.0 and hardware.p2p_bandwidth(8) == 96.25
    assert hardware.matmul_tflops == {}
    preset, line = with_matmul_rates(hardware, "bf16", "8xA100-nvlink-ib200")
    assert preset.matmul_tflops["bf16"] == 312.0 and "preset 8xA100-nvlink-ib200" in line
    assert preset.allreduce_busbw_gbps == hardware.allreduce_busbw_gbps
    measured, line = with_matmul_rates(hardware, "fp32", measure=lambda dtype: (0.5, "a fake run"))
    assert measured.matmul_tflops == {"fp32": 0.5} and line.startswith("matmul TFLOP/s: measured")
    assert "a fake run" in measured.source
    same, line = with_matmul_rates(load_hardware("8xH100-nvlink-ib400", 1, 8), "bf16")
    assert "from the hardware profile" in line and same.matmul_tflops["bf16"] == 989.4


def test_start_search_with_galvatron_files_alone(capsys):
    """Galvatron's hardware directory and model profile, nothing of ours: the search runs, and one
    line says where the matmul rate comes from (measured here, or the preset named)."""
    base = ARGS + ["--hardware", str(FIXTURES / "hardware")]
    for profile in ("model_current", "model_previous", "model_hidden"):
        assert cli.main(base + ["--model-profile", str(FIXTURES / profile)]) == 0, profile
        out = capsys.readouterr().out
        assert sum(line.startswith("matmul TFLOP/s: measured: bf16") for line in out.splitlines()) == 1
        assert "model figures: Galvatron's profiler's files" in out
    assert cli.main(base + ["--matmul-preset", "8xH100-nvlink-ib400"]) == 0  # analytical times
    out = capsys.readouterr().out
    assert "matmul TFLOP/s: preset 8xH100-nvlink-ib400 (datasheet: bf16 989.4" in out
