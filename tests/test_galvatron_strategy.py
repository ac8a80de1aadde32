"""Galvatron's strategy file (galvatron_config_*.json) to our layout and back: the fixtures are
files written for these tests in Galvatron's layout (tests/fixtures/galvatron/strategies)."""
from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from megatron_dpp.pipeline.registry import INTERLEAVED_1F1B, ONE_F_ONE_B
from megatron_dpp.search import cli, galvatron_strategy as gs, strategy
from megatron_dpp.search.errors import SearchInputError
from megatron_dpp.search.space import Layout, SpaceInputs

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "galvatron"
UNIFORM = FIXTURES / "strategies" / "galvatron_config_toygpt_1nodes_8gpus_per_node_40GB_bf16.json"
PER_LAYER = FIXTURES / "strategies" / "galvatron_config_toygpt_per_layer_tp.json"
INPUTS = SpaceInputs(num_layers=8, num_attention_heads=8, ffn_hidden_size=2048, global_batch_size=16,
                     num_nodes=1, gpus_per_node=8)
ARGS = ["--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "512",
        "--global-batch-size", "16", "--num-nodes", "1", "--num-gpus-per-node", "8",
        "--memory-budget-gb", "40", "--bf16", "--vocab-size", "4096",
        "--hardware", str(FIXTURES / "hardware"), "--model-profile", str(FIXTURES / "model_current"),
        "--matmul-preset", "8xH100-nvlink-ib400"]


def _config(**change) -> dict:
    return {**json.loads(UNIFORM.read_text()), **change}


def test_uniform_strategy_converts():
    layout = gs.layout_from_galvatron(gs.read_galvatron_config(UNIFORM), "f", INPUTS)
    assert layout == Layout(tp=2, pp=2, vpp=1, dp=2, micro_batch_size=2, num_microbatches=4,
                            recompute="full", distributed_optimizer=True, sequence_parallel=False,
                            schedule=ONE_F_ONE_B, split_backward=False)
    ddp = gs.layout_from_galvatron(_config(default_dp_type="ddp", checkpoint="0," * 7 + "0"), "f", INPUTS)
    assert not ddp.distributed_optimizer and ddp.recompute == "none"
    # Keys Galvatron's runtime does not read are ignored; optional ones take its defaults.
    minimal = {key: _config()[key] for key in ("pp_deg", "tp_sizes_enc", "tp_consecutive_flags",
                                                "dp_types_enc", "global_bsz", "chunks", "vtp")}
    minimal.update(pipeline_type="pipedream_flush", extra_key_of_a_later_version=[1, 2])
    assert gs.layout_from_galvatron(minimal, "f", INPUTS).recompute == "none"


@pytest.mark.parametrize("change, message", [
    ({"checkpoint": "1,1,1,1,0,0,0,0"}, "checkpoint varies per layer (layers 0-3: 1, 4-7: 0)"),
    ({"dp_types_enc": "0,0,0,0,0,0,0,1"}, "dp_types_enc varies per layer"),
    ({"dp_types_enc": "1,1,1,1,1,1,1,1"}, "ZeRO-3"),
    ({"default_dp_type": "zero3"}, "ZeRO-3"),
    ({"pp_deg": 4, "tp_sizes_enc": "1,1,1,1,1,1,1,1", "vtp": 1, "pp_division": "1,3,2,2"},
     "pp_division 1,3,2,2: only the last stage's layers may differ"),
    ({"pp_deg": 4, "tp_sizes_enc": "1,1,1,1,1,1,1,1", "vtp": 1, "pp_division": "3,3,2,0"},
     "pp_division 3,3,2,0: only the last stage's layers may differ"),
    ({"pp_division": "4,3"}, "is not 2 stages of 8 layers"),
    ({"use_sp": "1,1,1,1,1,1,1,1"}, "Ulysses"),
    ({"tp_consecutive_flags": "0,0,0,0,0,0,0,0"}, "consecutive"),
    ({"pipeline_type": "gpipe"}, "'gpipe'"),
    ({"vtp": 1}, "vtp 1 differs"),
    ({"cp_sizes_enc": "2,2,2,2,2,2,2,2"}, "cp_sizes_enc is not 1"),
    ({"global_bsz": 32}, "differs from --global-batch-size 16"),
    ({"chunks": 3}, "not 3 chunks"),
    ({"tp_sizes_enc": "2,2,2"}, "has 3 layers, --num-layers is 8"),
    ({"tp_sizes_enc": "x"}, "not a list of integers"),
    ({"pp_deg": 3, "pp_division": "3,3,2"}, "tp 2 x pp_deg 3 does not divide the 8 GPUs"),
    ({"embed_sdp": 1}, "ZeRO-3 for the embedding"),
])
def test_what_ours_cannot_express_is_one_line_naming_the_key(change, message):
    with pytest.raises(SearchInputError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        gs.layout_from_galvatron(_config(**change), "galvatron_config_x.json", INPUTS)
    assert "\n" not in str(error.value) and "galvatron_config_x.json" in str(error.value)


def test_per_layer_tp_file_is_refused_in_one_line_by_start_search(capsys):
    assert cli.main(ARGS + ["--galvatron-config", str(PER_LAYER)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and captured.out == ""
    assert "tp_sizes_enc varies per layer (layers 0-3: 2, 4-7: 4)" in err[0]
    assert str(PER_LAYER) in err[0]


def test_start_search_converts_and_prices_a_galvatron_strategy(tmp_path, capsys):
    path = tmp_path / "ours.json"
    assert cli.main(ARGS + ["--galvatron-config", str(UNIFORM), "--output-strategy", str(path)]) == 0
    out = capsys.readouterr().out
    assert "converted from Galvatron's strategy" in out and "TP2 PP2 VPP1 DP2 mbs2" in out
    content = strategy.read_strategy(path)
    layout = content["layout"]
    assert (layout["tensor_model_parallel_size"], layout["pipeline_model_parallel_size"],
            layout["micro_batch_size"], layout["recompute"], layout["distributed_optimizer"]) == (
        2, 2, 2, "full", True)
    assert content["predicted"]["iteration_ms"] > 0


def test_our_layout_to_galvatron_and_back():
    layout = Layout(tp=2, pp=2, vpp=1, dp=2, micro_batch_size=2, num_microbatches=4, recompute="full",
                    distributed_optimizer=True, sequence_parallel=True, schedule=ONE_F_ONE_B,
                    split_backward=False)
    config = gs.galvatron_config_from_layout(layout, 8, 16)
    assert config == _config(use_sp="0,0,0,0,0,0,0,0")  # the fixture's fields, in Galvatron's spelling
    assert gs.sequence_parallel_note(layout) is not None  # not a field of the file
    back = gs.layout_from_galvatron(json.loads(json.dumps(config)), "f", INPUTS)
    assert back == Layout(**{**layout.__dict__, "sequence_parallel": False})
    interleaved = Layout(**{**layout.__dict__, "vpp": 2, "schedule": INTERLEAVED_1F1B,
                            "recompute": "selective"})
    with pytest.raises(SearchInputError, match="2 virtual stages per rank, schedule interleaved-1f1b, "
                                               "selective recompute"):
        gs.galvatron_config_from_layout(interleaved, 8, 16)


def test_a_division_uneven_in_its_last_stage_converts_and_back():
    """Galvatron's pp_division with only the last stage different: Megatron-LM's
    --decoder-last-pipeline-num-layers, in the layout and in the trainer's flags."""
    layout = gs.layout_from_galvatron(_config(pp_division="5,3"), "f", INPUTS)
    assert layout.last_stage_layers == 3 and layout.rank_layers(8) == [5, 3]
    assert gs.galvatron_config_from_layout(layout, 8, 16)["pp_division"] == "5,3"
    assert gs.layout_from_galvatron(_config(pp_division="4,4"), "f", INPUTS).last_stage_layers == 0
    # Without pp_division Galvatron's runtime splits evenly, the remainder on the last stage.
    config = {key: value for key, value in _config(pp_deg=3, tp_sizes_enc="1,1,1,1,1,1,1,1", vtp=1,
                                                  global_bsz=16, chunks=8).items()
              if key != "pp_division"}
    with pytest.raises(SearchInputError, match="tp 1 x pp_deg 3 does not divide the 8 GPUs"):
        gs.layout_from_galvatron(config, "f", INPUTS)
    nine = SpaceInputs(**{**INPUTS.__dict__, "num_layers": 9, "gpus_per_node": 4})
    config.update(pp_deg=2, tp_sizes_enc="1," * 8 + "1", checkpoint="0," * 8 + "0",
                  dp_types_enc="0," * 8 + "0", tp_consecutive_flags="1," * 8 + "1",
                  use_sp="0," * 8 + "0")
    nine_layers = gs.layout_from_galvatron(config, "f", nine)
    assert nine_layers.rank_layers(9) == [4, 5] and nine_layers.last_stage_layers == 5
    flags = strategy.megatron_flags(_problem_stub(9), _cost_stub(nine_layers))
    assert flags[flags.index("--decoder-last-pipeline-num-layers") + 1] == "5"


def _problem_stub(num_layers: int):
    from megatron_dpp.models.memory_model import ModelShape

    return types.SimpleNamespace(shape=ModelShape(model="gpt", num_layers=num_layers, hidden_size=64,
                                                  num_attention_heads=8, ffn_hidden_size=256,
                                                  seq_length=128, padded_vocab_size=512,
                                                  max_position_embeddings=128),
                                 global_batch_size=16, lengths=None, packed=None)


def _cost_stub(layout: Layout):
    return types.SimpleNamespace(layout=layout)


def test_output_format_galvatron_writes_both_files(tmp_path, capsys):
    path = tmp_path / "out" / "ours.json"
    assert cli.main(ARGS + ["--top", "3", "--output-format", "galvatron", "--output-strategy", str(path)]) == 0
    out = capsys.readouterr().out
    assert strategy.read_strategy(path)["format"] == strategy.STRATEGY_FORMAT
    written = tmp_path / "out" / "galvatron_config_gpt_1nodes_8gpus_per_node_40GB_bf16.json"
    config = json.loads(written.read_text())
    assert "Galvatron's strategy format: layout #" in out and str(written) in out
    layout = gs.layout_from_galvatron(config, str(written), INPUTS)
    ours = strategy.read_strategy(path)["layout"]
    if "layout #1" in out:  # the winner itself: the same layout (Megatron's SP is not in the file)
        assert (layout.tp, layout.pp, layout.dp, layout.micro_batch_size) == (
            ours["tensor_model_parallel_size"], ours["pipeline_model_parallel_size"],
            ours["data_parallel_size"], ours["micro_batch_size"])
