"""The strategy search's model side: Galvatron's model profile files (round trip, a hand-written
Galvatron directory, the time fits), the analytical memory model against Megatron-Core's real
models (parameter counts) and against the bytes autograd really keeps (activations), and the
profile_model.sh command line."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest

from megatron_dpp.search import memory_model as mm
from megatron_dpp.search.errors import SearchInputError
from megatron_dpp.search.model_profile import (CHUNK_PARTS, STAGE_EXTRA_PARTS, TENSOR_PARALLEL_PARTS, LayerMemory, MemoryProfile, ModelProfile,
                                                OtherMemory, read_model_profile_dir,
                                                write_model_profile_dir)

REPO_ROOT = Path(__file__).resolve().parents[1]
VOCAB = 1024


# ----------------------------------------------------------------------------------------------
# files
# ----------------------------------------------------------------------------------------------
def _profile() -> ModelProfile:
    layers = {(0, sp, s): LayerMemory(parameter_mb=1.5, activation_mb_per_sample={1: 3.0, 2: 2.0},
                                      checkpoint_mb_per_sample=0.25,
                                      selective_mb_per_sample={1: 2.5, 2: 1.25})
              for sp in (False, True) for s in (128, 256)}
    other = {(stage, sp, 128): OtherMemory({1: 10.0, 2: 5.5}, {1: 0.5, 2: 0.375})
             for stage in ("pp_off", "pp_on_first", "pp_on_last") for sp in (False, True)}
    times = {(0, b, s): 0.5 * b * s / 128 for b in (1, 2, 4) for s in (128, 256)}
    return ModelProfile(model="gpt", hidden_size=256, num_attention_heads=8, dtype="bf16",
                        forward_ms=times, backward_ms={k: 2.5 * v for k, v in times.items()},
                        memory=MemoryProfile(layers, other), source="hand-made for the test")


def test_stage_extras_and_task_overhead_round_trip_and_fit(tmp_path):
    extras = {part: {(1, 128): 1.0 + i, (2, 128): 2.0 + 2 * i}
              for i, part in enumerate(STAGE_EXTRA_PARTS)}
    at_tp2 = {part: {(1, 128): 0.5 + i, (2, 128): 0.75 + i} for i, part in enumerate(TENSOR_PARALLEL_PARTS)}
    profile = dataclasses.replace(_profile(), stage_extra_ms=extras, task_overhead_ms=(0.125, 0.25),
                                  optimizer_ms_per_parameter=2e-6, tensor_parallel_ms={2: at_tp2})
    write_model_profile_dir(profile, tmp_path)
    read = read_model_profile_dir(tmp_path, 256, 8, "bf16")
    assert read == profile
    assert read.tensor_parallel(2, "forward", 2, 128) == 0.75
    assert read.tensor_parallel(2, "backward", 3, 128) == pytest.approx(1.75 + 0.25)  # the line
    assert read.tensor_parallel(4, "forward", 2, 128) is None
    assert read.stage_extra("last_forward", 4, 128) == pytest.approx(4 * 3.0)  # linear in the batch
    assert read.stage_extra("first_forward", 2, 256) == pytest.approx(2 * 2.0)  # one length: proportional
    # A profile without them (older files) reads with neither.
    write_model_profile_dir(_profile(), tmp_path / "old")
    old = read_model_profile_dir(tmp_path / "old", 256, 8, "bf16")
    assert old.stage_extra_ms == {} and old.task_overhead_ms is None and old.tensor_parallel_ms == {}
    assert old.optimizer_ms_per_parameter is None
    assert old.stage_extra("first_forward", 1, 128) is None


@pytest.mark.parametrize("change, message", [
    ({"stage_extra_ms": {"middle_forward": {}}}, "stage_extra_ms has 'middle_forward'"),
    ({"stage_extra_ms": {"first_forward": {"b1_s128": 1.0}}}, "is not bszB_seqS"),
    ({"stage_extra_ms": {"last_forward": {"bsz1_seq128": 1.0}}}, "some of first_forward"),
    ({"stage_extra_ms": {"first_forward": {"bsz1_seq128": 1.0}, "first_backward": {"bsz1_seq128": 1.0},
                         "last_forward": {"bsz1_seq128": 1.0}, "last_backward": {"bsz1_seq128": 1.0},
                         "chunk_forward": {"bsz1_seq128": 1.0}}}, "some of chunk_forward"),
    ({"task_overhead_ms": {"forward": 1.0}}, "task_overhead_ms must be"),
    ({"task_overhead_ms": {"forward": -1.0, "backward": 0.0}}, "must not be negative"),
    ({"optimizer_ms_per_parameter": "fast"}, "must be a number"),
    ({"tensor_parallel_ms": {"1": {}}}, "must be a tp size above 1"),
    ({"tensor_parallel_ms": {"2": {"forward": {"bsz1_seq128": 1.0}}}}, "times for each of forward"),
    ({"tensor_parallel_ms": {"2": {part: {"bsz1_seq128": -1.0} for part in TENSOR_PARALLEL_PARTS}}},
     "must not be negative"),
])
def test_bad_companion_extras_are_one_line_errors(tmp_path, change, message):
    paths = write_model_profile_dir(_profile(), tmp_path)
    companion = json.loads(paths[2].read_text())
    paths[2].write_text(json.dumps({**companion, **change}))
    with pytest.raises(SearchInputError, match=message):
        read_model_profile_dir(tmp_path, 256, 8, "bf16")


def test_profile_files_round_trip(tmp_path):
    profile = _profile()
    paths = write_model_profile_dir(profile, tmp_path)
    assert [p.name for p in paths] == ["computation_profiling_bf16_hidden_256_head_8.json",
                                       "memory_profiling_bf16_hidden_256_head_8.json",
                                       "megatron_dpp_profiling_bf16_hidden_256_head_8.json"]
    assert read_model_profile_dir(tmp_path, 256, 8, "bf16") == profile
    computation = json.loads(paths[0].read_text())
    assert computation["layertype_0_bsz2_seq256"] == pytest.approx(2.0)
    memory = json.loads(paths[1].read_text())
    assert memory["layertype_0_sp"]["128"]["tp_activation_per_bsz_dict"] == {
        "checkpoint": 0.25, "1": 3.0, "2": 2.0}
    assert memory["other_memory_pp_on_last"]["128"]["model_states"] == {"1": 10.0, "2": 5.5}


# The layout of Galvatron's usage page, literally (no companion file of ours).
GALVATRON_MEMORY = {
    "layertype_0": {"512": {"parameter_size": 48.0,
                            "tp_activation_per_bsz_dict": {"checkpoint": 4.0, "1": 120.0,
                                                           "2": 70.0, "4": 45.0}}},
    "layertype_0_sp": {"512": {"parameter_size": 48.0,
                               "tp_activation_per_bsz_dict": {"checkpoint": 4.0, "1": 120.0,
                                                              "2": 60.0, "4": 30.0}}},
    "other_memory_pp_off": {"512": {"model_states": {"1": 800.0, "2": 400.0},
                                    "activation": {"1": 30.0, "2": 20.0}}},
    "other_memory_pp_on_first": {"512": {"model_states": {"1": 400.0, "2": 200.0},
                                         "activation": {"1": 10.0, "2": 8.0}}},
    "other_memory_pp_on_last": {"512": {"model_states": {"1": 400.0, "2": 200.0},
                                        "activation": {"1": 20.0, "2": 12.0}}},
}


def test_galvatron_directory_reads_without_companion(tmp_path):
    (tmp_path / "computation_profiling_fp16_hidden_1024_head_16.json").write_text(json.dumps(
        {"layertype_0_bsz1_seq512": 3.0, "layertype_0_bsz2_seq512": 5.0,
         "layertype_0_bsz4_seq512": 9.0}))
    (tmp_path / "memory_profiling_fp16_hidden_1024_head_16.json").write_text(
        json.dumps(GALVATRON_MEMORY))
    profile = read_model_profile_dir(tmp_path, 1024, 16, "fp16")
    assert profile.backward_ms == {} and "2x forward" in profile.source
    assert profile.layer_forward_ms(0, 3, 512) == pytest.approx(7.0)  # 2b + 1
    assert profile.layer_backward_ms(0, 3, 512) == pytest.approx(14.0)
    layer = profile.memory.layers[(0, True, 512)]
    assert layer.activation_mb_per_sample == {1: 120.0, 2: 60.0, 4: 30.0}
    assert layer.checkpoint_mb_per_sample == 4.0 and layer.selective_mb_per_sample == {}
    assert profile.memory.other[("pp_on_last", False, 512)].activation_mb_per_sample == {
        1: 20.0, 2: 12.0}


@pytest.mark.parametrize("content, message", [
    ("{", "not valid JSON"),
    (json.dumps({"layertype_0": {"512": {"parameter_size": 1.0}}}), "lacks"),
    (json.dumps({"layer_0": {}}), "unknown key"),
])
def test_bad_memory_file_is_one_line_error(tmp_path, content, message):
    (tmp_path / "computation_profiling_fp32_hidden_64_head_4.json").write_text("{}")
    (tmp_path / "memory_profiling_fp32_hidden_64_head_4.json").write_text(content)
    with pytest.raises(SearchInputError, match=message) as error:
        read_model_profile_dir(tmp_path, 64, 4, "fp32")
    assert "\n" not in str(error.value)
    with pytest.raises(SearchInputError, match="profile_model.sh"):
        read_model_profile_dir(tmp_path, 64, 8, "fp32")


def test_time_fit_batch_linear_and_seq_quadratic():
    def truth(b, s):
        return (0.5 + 1e-3 * s + 2e-6 * s * s) * b + 0.1 * (s / 128)

    times = {(0, b, s): truth(b, s) for b in (1, 2, 4) for s in (128, 256, 512)}
    profile = dataclasses.replace(_profile(), forward_ms=times, backward_ms={})
    for b, s in [(1, 256), (3, 256), (8, 384), (2, 1024), (16, 64)]:
        assert profile.layer_forward_ms(0, b, s) == pytest.approx(truth(b, s), rel=1e-9)
    assert profile.layer_backward_ms(0, 3, 300) == pytest.approx(2 * truth(3, 300), rel=1e-9)
    one_point = dataclasses.replace(profile, forward_ms={(0, 2, 128): 4.0})
    assert one_point.layer_forward_ms(0, 4, 256) == pytest.approx(16.0)  # proportional


class _Sleep(__import__("torch").autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        __import__("time").sleep(seconds[0])
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        __import__("time").sleep(ctx.seconds[1])
        return grad, None


class _SleepingBlock(__import__("torch").nn.Module):
    """A block of `layers` layers that takes fixed + layers x per_layer seconds, per phase."""

    def __init__(self, layers, fixed=(0.004, 0.002), per_layer=(0.006, 0.010)):
        super().__init__()
        self.seconds = tuple(f + layers * p for f, p in zip(fixed, per_layer))

    def forward(self, hidden, attention_mask=None):
        return _Sleep.apply(hidden, self.seconds)


def test_time_layer_splits_a_block_into_the_layer_and_the_chunk_s_fixed_work():
    from megatron_dpp.search import model_measurement

    shape = mm.model_shape("gpt", 1, 16, 2, 64, VOCAB, max_position_embeddings=16, dtype="fp32")
    times = model_measurement.time_layer((_SleepingBlock(1), _SleepingBlock(2)), shape, batch=2,
                                       warmup=1, repeats=7)
    assert times.layer == pytest.approx((6.0, 10.0), abs=1.5)
    assert times.chunk == pytest.approx((4.0, 2.0), abs=1.5)
    assert times.one_layer_block == pytest.approx(
        tuple(a + b for a, b in zip(times.layer, times.chunk)), rel=1e-9)
    # A second layer that noise hides (no dearer than one): all of the block is the layer.
    same = model_measurement.time_layer((_SleepingBlock(1), _SleepingBlock(1)), shape, batch=2,
                                      warmup=1, repeats=3)
    for phase in (0, 1):
        assert 0 < same.layer[phase] <= same.one_layer_block[phase]
        assert same.chunk[phase] == pytest.approx(same.one_layer_block[phase] - same.layer[phase])


def test_time_fit_batch_keeps_measured_points_and_interpolates_between_them():
    # Per sample cheapest at batch 4 (a CPU's cache sweet spot): no line through all four.
    measured = {1: 1.1, 2: 1.8, 4: 3.1, 8: 6.7}
    profile = dataclasses.replace(_profile(), forward_ms={(0, b, 128): ms for b, ms in measured.items()},
                                  backward_ms={})
    for b, ms in measured.items():
        assert profile.layer_forward_ms(0, b, 128) == pytest.approx(ms, rel=1e-12)
    assert profile.layer_forward_ms(0, 3, 128) == pytest.approx((1.8 + 3.1) / 2)
    assert profile.layer_forward_ms(0, 6, 128) == pytest.approx((3.1 + 6.7) / 2)
    assert profile.layer_forward_ms(0, 16, 128) == pytest.approx(6.7 + 0.9 * 8)  # the last line
    # Below the smallest size: the line through the two smallest, never below proportional.
    small = dataclasses.replace(profile, forward_ms={(0, 4, 128): 4.0, (0, 8, 128): 6.0})
    assert small.layer_forward_ms(0, 2, 128) == pytest.approx(3.0)
    superlinear = dataclasses.replace(profile, forward_ms={(0, 4, 128): 4.0, (0, 8, 128): 10.0})
    assert superlinear.layer_forward_ms(0, 2, 128) == pytest.approx(2.0)
    with pytest.raises(SearchInputError, match="layer type 1"):
        profile.layer_forward_ms(1, 1, 128)


# ----------------------------------------------------------------------------------------------
# the analytical model against Megatron-Core
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def megatron():
    from megatron_dpp.search import model_measurement

    with model_measurement.single_process_megatron("gpt"):
        yield model_measurement


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("model, untie, binary_head",
                         [("gpt", False, True), ("gpt", True, True), ("bert", False, True),
                          ("bert", False, False)])
def test_parameter_counts_equal_megatron_core(megatron, model, untie, binary_head):
    shape = mm.model_shape(model, 1, 64, 4, 32, VOCAB, ffn_hidden_size=192,
                           max_position_embeddings=48, untie_embeddings_and_output_weights=untie,
                           bert_binary_head=binary_head, dtype="fp32")
    built = megatron.build_model(shape)
    layer = megatron.build_layer(shape)
    assert _numel(layer) == mm.layer_parameter_count(shape)
    assert _numel(built) == mm.total_parameter_count(shape)
    assert _numel(built.embedding) == mm.embedding_parameter_count(shape)


@pytest.mark.parametrize("untie", [False, True])
def test_gpt_stage_parameter_counts(megatron, untie):
    """First stage (embedding + layers) and last stage (layers + output, its own output weight
    even when tied) as Megatron-Core builds them."""
    from megatron.core.models.gpt import GPTModel

    from megatron_dpp.models.gpt import gpt_layer_spec

    shape = mm.model_shape("gpt", 2, 64, 4, 32, VOCAB, untie_embeddings_and_output_weights=untie,
                           dtype="fp32")
    config = megatron.transformer_config(shape)
    layers = 2 * mm.layer_parameter_count(shape)
    for pre, post, extra in [(True, False, mm.embedding_parameter_count(shape)),
                             (False, True, mm.output_parameter_count(shape))]:
        stage = GPTModel(config=config, transformer_layer_spec=gpt_layer_spec(),
                         vocab_size=VOCAB, max_sequence_length=32, pre_process=pre,
                         post_process=post, share_embeddings_and_output_weights=not untie)
        assert _numel(stage) == layers + extra


@pytest.mark.parametrize("model", ["gpt", "bert"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_activation_model_matches_saved_tensors(megatron, model, dtype, dropout):
    """Within 10% of the bytes Megatron-Core's layers keep (it is exact here but for a few bytes
    of the loss): seq 64/128, hidden 64/128, micro-batch 1/2, every recompute mode, and the
    embedding's and output head's."""
    profiling = megatron
    for hidden in (64, 128):
        for seq in (64, 128):
            shape = mm.model_shape(model, 1, hidden, 4, seq, VOCAB, dtype=dtype,
                                   hidden_dropout=dropout, attention_dropout=dropout)
            blocks = {mode: profiling.build_layer(shape, mode) for mode in mm.RECOMPUTE_MODES}
            whole = profiling.build_model(shape)
            for batch in (1, 2):
                for mode, block in blocks.items():
                    measured = profiling.measured_layer_activation_bytes(block, shape, batch)
                    analytical = mm.layer_activation_bytes(shape, batch, 1, False, mode)
                    assert analytical == pytest.approx(measured, rel=0.10), (mode, hidden, seq,
                                                                             batch)
                embedding, head = profiling.measured_other_activation_bytes(whole, shape, batch)
                assert mm.embedding_activation_bytes(shape, batch) == pytest.approx(embedding,
                                                                                    rel=0.10)
                assert mm.output_activation_bytes(shape, batch) == pytest.approx(head, rel=0.10)


def test_analytical_parallel_scaling():
    """Korthikanti et al.'s structure: with sequence parallelism everything but the mask splits
    by t; selective drops the attention-score terms; full keeps the (split) layer input."""
    shape = mm.model_shape("gpt", 24, 1024, 16, 2048, 51200, dtype="bf16", hidden_dropout=0.0,
                           attention_dropout=0.0)
    s, b, h = 2048, 1, 1024
    mask = s * s
    one = mm.layer_activation_bytes(shape, b, 1, False, "none")
    sp4 = mm.layer_activation_bytes(shape, b, 4, True, "none")
    assert sp4 - mask == (one - mask) // 4
    assert mm.layer_activation_bytes(shape, b, 4, True, "full") == s * b * h * 2 // 4
    selective = mm.layer_activation_bytes(shape, b, 1, False, "selective")
    # fp32 softmax + 16-bit copy; the selective checkpoint keeps the mask type (one int32)
    assert one - selective == 16 * s * s * b * (4 + 2) + mask - mm.CHECKPOINT_MASK_TYPE_BYTES
    with pytest.raises(SearchInputError):
        mm.layer_activation_bytes(shape, b, 3, False, "none")
    with pytest.raises(SearchInputError):
        mm.layer_activation_bytes(shape, b, 1, False, "everything")


def test_model_state_bytes_megatron_accounting():
    assert mm.model_state_bytes(1000, "bf16") == 18_000
    assert mm.model_state_bytes(1000, "bf16", dp=4, distributed_optimizer=True) == 6000 + 3000
    assert mm.model_state_bytes(1000, "fp32") == 16_000
    assert mm.model_state_bytes(1000, "fp32", dp=8, distributed_optimizer=True) == 8000 + 1000
    assert mm.model_state_bytes(1000, "fp32", dp=8) == 16_000
    with pytest.raises(SearchInputError):
        mm.model_state_bytes(1000, "int8")


def test_forward_flops_megatron_formula():
    shape = mm.model_shape("gpt", 1, 1024, 16, 2048, 51200)
    s, b, h = 2048, 4, 1024
    assert mm.layer_forward_flops(shape, b) == 24 * b * s * h * h + 4 * b * s * s * h


# ----------------------------------------------------------------------------------------------
# the command line
# ----------------------------------------------------------------------------------------------
def _run(args, timeout):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(["bash", str(REPO_ROOT / "run_scripts" / "profile_model.sh"), *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.timeout(150)
def test_quick_profile_writes_readable_files(tmp_path):
    result = _run(["--model", "bert", "--hidden-size", "64", "--num-attention-heads", "4",
                   "--seq-lengths", "32", "64", "--micro-batch-sizes", "1", "2",
                   "--vocab-size", "500", "--quick", "--output-dir", str(tmp_path)], timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "[4/4] bert seq 64 micro-batch 2" in result.stderr
    profile = read_model_profile_dir(tmp_path, 64, 4, "fp32")
    assert profile.model == "bert" and "measured" in profile.source
    assert set(profile.forward_ms) == {(0, b, s) for b in (1, 2) for s in (32, 64)}
    assert all(ms > 0 for ms in [*profile.forward_ms.values(), *profile.backward_ms.values()])
    layer = profile.memory.layers[(0, False, 64)]
    shape = mm.model_shape("bert", 1, 64, 4, 64, 512, max_position_embeddings=64, dtype="fp32")
    assert layer.activation_mb_per_sample[1] * 2 ** 20 * 2 == pytest.approx(
        mm.layer_activation_bytes(shape, 2), rel=0.10)
    assert set(layer.activation_mb_per_sample) == {1, 2, 4}
    # tp=2 is measured by two gloo processes (the source says so), tp=4 computed
    assert "measured at tp=1 and 2" in profile.source
    assert layer.activation_mb_per_sample[2] * 2 ** 20 * 2 == pytest.approx(
        mm.layer_activation_bytes(shape, 2, tp=2), rel=0.10)
    first = profile.memory.other[("pp_on_first", False, 64)].activation_mb_per_sample
    assert first[2] * 2 ** 20 * 2 == pytest.approx(mm.embedding_activation_bytes(shape, 2, tp=2),
                                                   rel=0.10)
    assert layer.checkpoint_mb_per_sample < layer.selective_mb_per_sample[1] < \
        layer.activation_mb_per_sample[1]
    assert profile.memory.other[("pp_on_first", True, 32)].model_states_mb[1] > 0
    # The stages' extra work at every (batch, seq), and the schedules' per-task overhead.
    assert set(profile.stage_extra_ms) == {*STAGE_EXTRA_PARTS, *CHUNK_PARTS}
    assert all(set(table) == {(b, s) for b in (1, 2) for s in (32, 64)}
               for table in profile.stage_extra_ms.values())
    assert profile.stage_extra_ms["first_forward"][(2, 64)] > 0
    assert profile.stage_extra_ms["last_forward"][(2, 64)] > 0  # the 512-token head and the loss
    assert profile.task_overhead_ms is not None and min(profile.task_overhead_ms) >= 0
    # The same times measured by the two tp=2 processes, their all-reduces included.
    assert set(profile.tensor_parallel_ms) == {2}
    assert set(profile.tensor_parallel_ms[2]) == set(TENSOR_PARALLEL_PARTS)
    assert all(set(table) == {(b, s) for b in (1, 2) for s in (32, 64)}
               for table in profile.tensor_parallel_ms[2].values())
    assert profile.tensor_parallel(2, "forward", 2, 64) > 0
    assert "layer times at tp=1 and 2" in profile.source
    assert "first/last stage extras" in profile.source
    assert profile.optimizer_ms_per_parameter > 0


@pytest.mark.parametrize("args, message", [
    (["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--bogus",
      "--output-dir", "x"], "unrecognized arguments: --bogus"),
    (["--hidden-size", "64", "--num-attention-heads", "5", "--seq-length", "32",
      "--output-dir", "x"], "not divisible"),
    (["--hidden-size", "64", "--num-attention-heads", "4", "--output-dir", "x"], "--seq-length"),
    (["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
      "--micro-batch-sizes", "0", "--output-dir", "x"], "must be positive"),
])
@pytest.mark.timeout(60)
def test_bad_flags_one_line_exit_2(args, message):
    result = _run(args, timeout=50)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
