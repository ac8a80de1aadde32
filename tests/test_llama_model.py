"""Llama through the model seam: its flags (one-line errors), the model Megatron-Core builds from
them (RMSNorm, SwiGLU, grouped-query attention, no biases, rotary positions, untied output), the
analytical memory model against the built model's parameters and autograd's saved bytes, and the
launcher (dry run and a short CPU run with falling loss)."""
from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch

from _train_util import PYTHON, REPO_ROOT, _env
from megatron_dpp.models import memory_model as mm

VOCAB = 1024


def _parse(flags: list[str]):
    """The trainer's parser and Llama's own checks (the shared ones would need data)."""
    from megatron_dpp.arguments import build_parser
    from megatron_dpp.models.families import LLAMA

    args = build_parser(model="llama").parse_args(flags)
    LLAMA.validate(args)
    return args


def _pretrain(flags: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "megatron_dpp.pretrain", "--model", "llama", *flags],
                          capture_output=True, text=True, timeout=timeout, env=_env(),
                          cwd=REPO_ROOT)


SHAPE_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
               "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "2",
               "--train-iters", "1", "--lr", "1e-3"]


# ----------------------------------------------------------------------------------------------
# flags
# ----------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags, message", [
    (["--num-query-groups", "3"], "--num-query-groups 3 must be positive and divide "
                                  "--num-attention-heads 4"),
    (["--num-query-groups", "0"], "--num-query-groups 0 must be positive"),
    (["--rotary-base", "0"], "--rotary-base must be positive"),
    (["--rope-scaling-factor", "8"], "--rope-scaling-factor 8 scales nothing without "
                                     "--use-rope-scaling: add it or remove the factor"),
    (["--use-rope-scaling", "--rope-scaling-factor", "0"],
     "--rope-scaling-factor must be positive, got 0"),
    (["--tokenizer-type", "BertWordPieceLowerCase"],
     "is BERT's; Llama trains with GPT2BPETokenizer or Llama2Tokenizer"),
])
def test_bad_llama_flags_are_one_line_errors(flags, message):
    result = _pretrain(SHAPE_FLAGS + flags)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr[-2000:]


def test_checkpoint_setting_differences_name_what_no_shape_shows():
    import argparse

    from megatron_dpp.models.families import GPT, LLAMA, checkpoint_setting_differences

    saved = argparse.Namespace(norm_epsilon=1e-5, rotary_base=500000, use_rope_scaling=True,
                               rope_scaling_factor=8.0, hidden_size=64)
    run = argparse.Namespace(norm_epsilon=1e-5, rotary_base=500000, use_rope_scaling=False,
                             rope_scaling_factor=None, hidden_size=128)
    assert checkpoint_setting_differences(LLAMA, saved, run) == [
        ("--use-rope-scaling", True, False), ("--rope-scaling-factor", 8.0, None)]
    assert checkpoint_setting_differences(LLAMA, saved, saved) == []
    assert checkpoint_setting_differences(GPT, saved, run) == []  # GPT has no rotary settings
    # Checkpoints of runs before a flag existed do not have it: nothing to compare.
    assert checkpoint_setting_differences(LLAMA, argparse.Namespace(), run) == []


def test_llama_flags_defaults_and_shape_round_trip():
    from megatron_dpp.models.families import LLAMA, MODEL_FAMILIES

    args = _parse(SHAPE_FLAGS[:8])
    assert (args.num_query_groups, args.rotary_base) == (4, 10000)
    assert args.untie_embeddings_and_output_weights  # implied by --model llama
    assert MODEL_FAMILIES["llama"] is LLAMA and not LLAMA.ties_output(False)
    args = _parse(SHAPE_FLAGS[:8] + ["--num-query-groups", "2", "--rotary-base", "500000"])
    fields = LLAMA.shape_fields(args)
    assert fields == {"num_query_groups": 2, "rotary_base": 500000}
    shape = mm.model_shape("llama", 2, 64, 4, 32, VOCAB, **fields)
    assert LLAMA.shape_flags(shape) == ["--num-query-groups", "2", "--rotary-base", "500000"]


# ----------------------------------------------------------------------------------------------
# the built model, against the flags and the memory model
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def megatron():
    from megatron_dpp.search import model_measurement

    with model_measurement.single_process_megatron("llama"):
        yield model_measurement


def _llama31_inverse_frequencies(head_size: int, base: float, factor: float) -> torch.Tensor:
    """Llama 3.1's rotary frequencies, as Meta's reference code scales them: wavelengths shorter
    than the original context over 4 kept, longer than it divided by the factor, a smooth blend
    between (original context 8192, low/high frequency factors 1 and 4)."""
    old_context, low_factor, high_factor = 8192, 1.0, 4.0
    frequencies = 1.0 / base ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)
    scaled = []
    for frequency in frequencies.tolist():
        wavelength = 2 * torch.pi / frequency
        if wavelength < old_context / high_factor:
            scaled.append(frequency)
        elif wavelength > old_context / low_factor:
            scaled.append(frequency / factor)
        else:
            smooth = (old_context / wavelength - low_factor) / (high_factor - low_factor)
            scaled.append((1 - smooth) * frequency / factor + smooth * frequency)
    return torch.tensor(scaled)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags, factor", [([], None), (["--use-rope-scaling"], 8.0),
                                           (["--use-rope-scaling", "--rope-scaling-factor", "32"],
                                            32.0)])
def test_rope_scaling_gives_llama_31s_frequencies(megatron, flags, factor):
    from megatron_dpp.models.llama import build_llama_chunks
    from megatron_dpp.training.config import transformer_config_from_args

    from megatron_dpp.arguments import parse_args

    args = parse_args([*SHAPE_FLAGS, "--rotary-base", "500000", "--mock-data",
                       "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", *flags],
                      model="llama")
    assert args.rope_scaling_factor == factor
    args.padded_vocab_size = VOCAB
    (model,) = build_llama_chunks(args, transformer_config_from_args(args), seed=1)
    head_size = 64 // 4
    plain = 1.0 / 500000 ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)
    expected = plain if factor is None else _llama31_inverse_frequencies(head_size, 500000, factor)
    torch.testing.assert_close(model.rotary_pos_emb.inv_freq.cpu(), expected, rtol=1e-6, atol=0)
    if factor is not None:  # the low frequencies scaled, the high ones kept
        assert not torch.equal(expected, plain) and expected[0] == plain[0]


def _shape(**others) -> mm.ModelShape:
    fields = dict(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=64,
                  padded_vocab_size=VOCAB, ffn_hidden_size=160, num_query_groups=2, dtype="fp32",
                  hidden_dropout=0.0, attention_dropout=0.0)
    fields.update(others)
    return mm.model_shape("llama", **fields)


@pytest.mark.timeout(120)
def test_built_model_is_llama(megatron):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    model = megatron.build_model(_shape())
    config = model.config
    assert config.normalization == "RMSNorm" and config.gated_linear_unit
    assert config.activation_func is torch.nn.functional.silu
    assert not config.add_bias_linear and config.num_query_groups == 2
    assert model.position_embedding_type == "rope" and isinstance(model.rotary_pos_emb,
                                                                  RotaryEmbedding)
    assert not model.share_embeddings_and_output_weights
    assert not hasattr(model.embedding, "position_embeddings")
    layer = model.decoder.layers[0]
    assert isinstance(layer.input_layernorm, torch.nn.RMSNorm)
    assert isinstance(model.decoder.final_layernorm, torch.nn.RMSNorm)
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())
    head_size = 64 // 4
    assert layer.self_attention.linear_qkv.weight.shape == (64 + 2 * 2 * head_size, 64)
    assert layer.mlp.linear_fc1.weight.shape == (2 * 160, 64)  # gate and up: SwiGLU


@pytest.mark.timeout(120)
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_parameter_counts_equal_megatron_core(megatron, groups):
    shape = _shape(num_query_groups=groups)
    model = megatron.build_model(shape)
    layer = model.decoder.layers[0]
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    assert count(layer) == mm.layer_parameter_count(shape)
    assert count(model.embedding) == mm.embedding_parameter_count(shape)
    assert count(model) == mm.total_parameter_count(shape)
    assert (count(model.output_layer) + count(model.decoder.final_layernorm)
            == mm.output_parameter_count(shape))


def _layer_saved_bytes(profiling, block, shape, batch: int, rotary) -> int:
    """What one layer keeps for backward, with the rotary angles the model hands its layers (the
    same as the profiler's own sample input)."""
    hidden, inputs = profiling.layer_inputs(shape, batch)
    assert torch.equal(inputs["rotary_pos_emb"], rotary)
    params = list(block.parameters())
    with profiling.SavedTensors(exclude=params) as saved:
        output = block(hidden, **inputs)
    nbytes = saved.alive_bytes()
    del output
    return nbytes


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_activation_model_matches_saved_tensors(megatron, dtype, dropout):
    """Exact for the layer in every recompute mode (seq 32/64, micro-batch 1/2, groups 2/4), and
    within 10% for the embedding and the output head (as GPT's check)."""
    profiling = megatron
    for seq in (32, 64):
        for groups in (2, 4):
            shape = _shape(seq_length=seq, max_position_embeddings=seq, num_query_groups=groups,
                           dtype=dtype, hidden_dropout=dropout, attention_dropout=dropout)
            whole = profiling.build_model(shape)
            inner = getattr(whole, "module", whole)
            rotary = inner.rotary_pos_emb(seq)
            for mode in mm.RECOMPUTE_MODES:
                block = profiling.build_layer(shape, mode)
                for batch in (1, 2):
                    measured = _layer_saved_bytes(profiling, block, shape, batch, rotary)
                    analytical = mm.layer_activation_bytes(shape, batch, 1, False, mode)
                    assert analytical == measured, (mode, seq, groups, batch)
            for batch in (1, 2):
                embedding, head = profiling.measured_other_activation_bytes(whole, shape, batch)
                assert mm.embedding_activation_bytes(shape, batch) == pytest.approx(embedding,
                                                                                    rel=0.10)
                assert mm.output_activation_bytes(shape, batch) == pytest.approx(head, rel=0.10)


def test_runtime_estimate_reads_the_config_groups(megatron):
    """LLAMA_SPEC.activation_bytes (the DPP runtime's budget) is the layer model per chunk."""
    from megatron_dpp.models.llama import LLAMA_SPEC

    shape = _shape(num_layers=4)
    config = megatron.transformer_config(shape)
    (estimate,) = LLAMA_SPEC.activation_bytes(config, [2 * 64], 2, 1, 2)  # 2 layers per chunk
    assert estimate == 2 * mm.layer_activation_bytes(shape, 2)


def test_forward_flops_count_grouped_attention_and_swiglu():
    shape = _shape(num_query_groups=1)
    s, b, h, f, kv = 64, 2, 64, 160, 2 * 16
    expected = 2 * s * b * (h * (h + kv) + h * h + 3 * h * f) + 4 * b * s * s * h
    assert mm.layer_forward_flops(shape, b) == expected


# ----------------------------------------------------------------------------------------------
# the launcher
# ----------------------------------------------------------------------------------------------
def _launcher(args: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "run_scripts/run_single_llama.sh", *args], capture_output=True,
                          text=True, timeout=timeout, env=_env({**os.environ, **env}),
                          cwd=REPO_ROOT)


@pytest.mark.timeout(120)
def test_launcher_dry_run_names_the_entry_and_the_recipe():
    result = _launcher(["--dry-run"], {"PP": "2"}, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "recipe llama_tiny" in result.stdout + result.stderr
    assert re.search(r"-m megatron_dpp\.pretrain --model llama ", result.stdout), result.stdout
    assert "--pipeline-model-parallel-size 2" in result.stdout


@pytest.mark.timeout(120)
def test_launcher_rejects_an_unknown_recipe():
    result = _launcher(["--dry-run"], {"RECIPE": "llama_nope"}, timeout=60)
    assert result.returncode == 2
    assert "llama2_7b" in result.stderr and "llama_tiny" in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_launcher_trains_with_falling_loss():
    """A short run of the CPU recipe at PP=2 with the DPP runtime: the loss falls."""
    result = _launcher(["--train-iters", "8", "--global-batch-size", "8", "--lr-warmup-iters",
                        "1", "--log-interval", "1", "--eval-iters", "0"], {"PP": "2"}, timeout=170)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    losses = [float(v) for v in re.findall(r"\| lm loss: ([-+0-9.eE]+)", result.stdout)]
    assert len(losses) == 8, result.stdout[-3000:]
    assert losses[-1] < losses[0] - 0.5, losses
