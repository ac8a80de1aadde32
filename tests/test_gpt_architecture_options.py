"""GPT's architecture options, each on its own (Megatron-LM's names, defaults and meanings): rotary
and partial rotary embeddings, --swiglu, --squared-relu, --normalization RMSNorm,
--disable-bias-linear, --add-qkv-bias (with it: a bias on the query/key/value projection only,
Qwen2.5's), grouped-query attention, --qk-layernorm, --kv-channels (any head size),
--untie-embeddings-and-output-weights and --apply-query-key-layer-scaling.

- each option's GPT (our layer spec: the direct layer and linears) equals the same model built
  from Megatron-Core's own local spec and GPTModel with the TransformerConfig fields Megatron-LM
  sets for the flag: same weights, the same loss and gradients (one process, pp=1);
- the direct layer runs each of them itself (none makes it fall back to Megatron's forward);
- the memory model's parameter counts equal the built model's and its activation bytes what
  autograd keeps, for each option and a Qwen3-like combination;
- bad values are one-line errors, as Megatron-LM refuses them;
- --use-dpp equals Megatron's 1F1B on a Qwen3-like GPT at pp=2 (within 1e-5 per iteration).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from _train_util import TINY_GPT_ARGS, data_args, run_training
from megatron_dpp.models import memory_model as mm

VOCAB = 128
SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "2",
         "--train-iters", "1", "--lr", "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--use-cpu-initialization", "--no-gradient-accumulation-fusion"]
# A Qwen3-style decoder: grouped-query attention, q/k norms, a head size other than hidden / heads,
# SwiGLU, RMSNorm, rotary positions, no biases, an untied output layer.
QWEN3 = ["--group-query-attention", "--num-query-groups", "2", "--qk-layernorm",
         "--kv-channels", "32", "--swiglu", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--rotary-base", "1000000",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
# A Qwen2.5-style decoder: Qwen3's without the q/k norms and with a bias on the QKV projection only.
QWEN2_5 = ["--group-query-attention", "--num-query-groups", "2", "--add-qkv-bias", "--swiglu",
           "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--rotary-base",
           "1000000", "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
OPTIONS = {
    "rope": ["--position-embedding-type", "rope"],
    "partial_rope": ["--position-embedding-type", "rope", "--rotary-percent", "0.5",
                     "--rotary-base", "5000", "--no-rope-fusion"],
    "swiglu": ["--swiglu"],
    "squared_relu": ["--squared-relu"],
    "rmsnorm": ["--normalization", "RMSNorm"],
    "no_bias": ["--disable-bias-linear"],
    "qkv_bias": ["--disable-bias-linear", "--add-qkv-bias"],
    "gqa": ["--group-query-attention", "--num-query-groups", "2"],
    "mqa": ["--group-query-attention"],  # Megatron-LM's default: one group
    "qk_layernorm": ["--qk-layernorm"],
    "kv_channels": ["--kv-channels", "32"],
    "untied": ["--untie-embeddings-and-output-weights"],
    "qk_layer_scaling": ["--apply-query-key-layer-scaling"],
    "qwen3": QWEN3,
    "qwen2_5": QWEN2_5,
}


def _parse(monkeypatch, *flags):
    from megatron_dpp.arguments import parse_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    args = parse_args([*data_args(), *SHAPE, *flags], prog="megatron_dpp.pretrain_gpt",
                      model="gpt")
    args.padded_vocab_size = VOCAB  # what build_tokenizer sets
    return args


@pytest.fixture(scope="module")
def megatron():
    from megatron_dpp.search import model_measurement

    with model_measurement.single_process_megatron("gpt"):
        yield model_measurement


# ----------------------------------------------------------------------------------------------
# flags
# ----------------------------------------------------------------------------------------------
def test_the_flags_take_megatron_lms_values(monkeypatch):
    defaults = _parse(monkeypatch)
    assert (defaults.normalization, defaults.swiglu, defaults.position_embedding_type,
            defaults.add_bias_linear, defaults.add_qkv_bias, defaults.num_query_groups,
            defaults.kv_channels, defaults.rotary_percent, defaults.rotary_base,
            defaults.ffn_hidden_size) == \
        ("LayerNorm", False, "learned_absolute", True, True, 4, 16, 1.0, 10000, 256)
    # Megatron-LM's validate_args: add_qkv_bias follows add_bias_linear unless the flag is given.
    assert _parse(monkeypatch, "--disable-bias-linear").add_qkv_bias is False
    assert _parse(monkeypatch, "--disable-bias-linear", "--add-qkv-bias").add_qkv_bias is True
    assert _parse(monkeypatch, "--add-qkv-bias").add_bias_linear is True
    qwen = _parse(monkeypatch, *QWEN3)
    assert (qwen.num_query_groups, qwen.kv_channels, qwen.qk_layernorm, qwen.rotary_base) == \
        (2, 32, True, 1000000)
    # --swiglu's --ffn-hidden-size default: 2/3 of 4h, a multiple of 64 (Megatron-LM's).
    assert qwen.ffn_hidden_size == int(4 * 64 * 2 / 3 / 64) * 64 == 128
    assert _parse(monkeypatch, "--group-query-attention").num_query_groups == 1
    # --kv-channels with a hidden size the heads do not divide (Megatron-LM allows it).
    odd = _parse(monkeypatch, "--hidden-size", "70", "--kv-channels", "16")
    assert (odd.hidden_size, odd.kv_channels) == (70, 16)


@pytest.mark.parametrize("flags, message", [
    (["--kv-channels", "0"], "--kv-channels must be positive, got 0"),
    (["--group-query-attention", "--num-query-groups", "3"],
     "--num-query-groups 3 must be positive and divide --num-attention-heads 4"),
    (["--num-query-groups", "2"], "--num-query-groups 2 groups keys and values with "
                                  "--group-query-attention only"),
    (["--position-embedding-type", "rope", "--rotary-percent", "0"],
     "--rotary-percent must be in (0, 1], got 0"),
    (["--position-embedding-type", "rope", "--rotary-percent", "1.5"],
     "--rotary-percent must be in (0, 1], got 1.5"),
    (["--position-embedding-type", "rope", "--rotary-percent", "0.1"],
     "--rotary-percent 0.1 rotates 1 of each head's 16 channels"),
    (["--position-embedding-type", "rope", "--rotary-base", "0"],
     "--rotary-base must be positive, got 0"),
    (["--rotary-base", "5000"], "--rotary-base 5000 sets rotary embeddings and "
                                "--position-embedding-type is learned_absolute"),
    (["--no-position-embedding"], "--no-position-embedding goes with --position-embedding-type "
                                  "rope"),
    (["--swiglu", "--squared-relu"], "--swiglu and --squared-relu are two MLP activations"),
    (["--hidden-size", "70"], "--hidden-size 70 is not divisible by --num-attention-heads 4"),
])
def test_bad_values_are_one_line_errors(monkeypatch, capsys, flags, message):
    from _train_util import flag_error

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    error = flag_error(capsys, [*data_args(), *SHAPE, *flags])
    assert message in error, error


def test_each_flag_has_its_help(capsys):
    from megatron_dpp.arguments import build_parser

    text = build_parser(model="gpt").format_help()
    for flag in ("--position-embedding-type", "--rotary-percent", "--rotary-base",
                 "--no-rope-fusion", "--swiglu", "--squared-relu", "--normalization",
                 "--disable-bias-linear", "--add-qkv-bias", "--group-query-attention",
                 "--num-query-groups", "--qk-layernorm", "--kv-channels",
                 "--untie-embeddings-and-output-weights", "--apply-query-key-layer-scaling"):
        assert flag in text, flag


# ----------------------------------------------------------------------------------------------
# the model against Megatron-Core's own spec
# ----------------------------------------------------------------------------------------------
def _megatron_lm_config(args):
    """The TransformerConfig Megatron-LM's core_transformer_config_from_args gives these flags
    (written out here, not through our builder)."""
    from megatron.core.activations import squared_relu
    from megatron.core.transformer import TransformerConfig

    fields = dict(num_layers=args.num_layers, hidden_size=args.hidden_size,
                  ffn_hidden_size=args.ffn_hidden_size,
                  num_attention_heads=args.num_attention_heads, kv_channels=args.kv_channels,
                  num_query_groups=args.num_query_groups if args.group_query_attention else None,
                  normalization=args.normalization, add_bias_linear=args.add_bias_linear,
                  add_qkv_bias=args.add_qkv_bias, qk_layernorm=args.qk_layernorm,
                  apply_query_key_layer_scaling=args.apply_query_key_layer_scaling,
                  hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                  bias_activation_fusion=False, bias_dropout_fusion=False,
                  masked_softmax_fusion=False, apply_rope_fusion=False,
                  gradient_accumulation_fusion=False, persist_layer_norm=False)
    if args.swiglu:
        fields.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu)
    if args.squared_relu:
        fields["activation_func"] = squared_relu
    return TransformerConfig(**fields)


def _megatron_gpt(args, config):
    """GPTModel over Megatron-Core's get_gpt_layer_local_spec, as Megatron-LM's gpt_builders."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm,
                                    normalization=args.normalization)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=args.max_position_embeddings,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type,
                    rotary_percent=args.rotary_percent, rotary_base=args.rotary_base)


def _loss_and_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    positions = torch.arange(tokens.size(1)).repeat(tokens.size(0), 1)
    losses = model(tokens, positions, None, labels=tokens)
    loss = losses.float().sum()
    loss.backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters()
             if param.grad is not None}
    return losses.detach(), grads


@pytest.mark.timeout(300)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_the_model_equals_megatron_cores_own(monkeypatch, megatron, option):
    from megatron_dpp.models import MODEL_SPECS
    from megatron_dpp.mcore.direct_layer import DirectTransformerLayer
    from megatron_dpp.models.transformer_config import transformer_config_from_args

    args = _parse(monkeypatch, *OPTIONS[option])
    config = transformer_config_from_args(args)
    reference_config = _megatron_lm_config(args)
    for field in ("normalization", "gated_linear_unit", "activation_func", "add_bias_linear",
                  "add_qkv_bias", "qk_layernorm", "kv_channels", "num_query_groups",
                  "apply_query_key_layer_scaling", "attention_softmax_in_fp32"):
        assert getattr(config, field) == getattr(reference_config, field), field
    (ours,) = MODEL_SPECS["gpt"].build_chunks(args, config, 1)
    reference = _megatron_gpt(args, reference_config)
    missing, unexpected = reference.load_state_dict(ours.state_dict(), strict=False)
    assert not [k for k in missing + unexpected if not k.endswith("_extra_state")], \
        (missing, unexpected)
    layers = ours.decoder.layers
    # Each option runs through the direct layer itself.
    assert all(type(layer) is DirectTransformerLayer and layer.runs_directly for layer in layers)
    assert all(type(layer) is not DirectTransformerLayer for layer in reference.decoder.layers)
    tokens = torch.randint(0, VOCAB, (2, args.seq_length), generator=torch.Generator().manual_seed(0))
    want_loss, want_grads = _loss_and_grads(reference, tokens)
    got_loss, got_grads = _loss_and_grads(ours, tokens)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-6)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    _check_shapes(args, ours)


def _check_shapes(args, model):
    """What each option builds, tensor by tensor."""
    layer = model.decoder.layers[0]
    attention = layer.self_attention
    d, groups = args.kv_channels, args.num_query_groups
    assert attention.linear_qkv.weight.shape == ((4 + 2 * groups) * d, 64)
    assert attention.linear_proj.weight.shape == (64, 4 * d)
    fc1 = 2 * args.ffn_hidden_size if args.swiglu else args.ffn_hidden_size
    assert layer.mlp.linear_fc1.weight.shape == (fc1, 64)
    assert (attention.linear_qkv.bias is not None) == args.add_qkv_bias
    if args.add_qkv_bias:
        assert attention.linear_qkv.bias.shape == ((4 + 2 * groups) * d,)
    for linear in (attention.linear_proj, layer.mlp.linear_fc1, layer.mlp.linear_fc2):
        assert (linear.bias is not None) == args.add_bias_linear
    assert hasattr(model.embedding, "position_embeddings") == (
        args.position_embedding_type == "learned_absolute")
    assert model.share_embeddings_and_output_weights == (
        not args.untie_embeddings_and_output_weights)
    norm = torch.nn.RMSNorm if args.normalization == "RMSNorm" else torch.nn.LayerNorm
    assert isinstance(layer.input_layernorm, norm)
    if args.qk_layernorm:
        assert isinstance(attention.q_layernorm, norm)
        assert attention.q_layernorm.weight.shape == (d,)
    if args.position_embedding_type == "rope":
        rotated = int(d * args.rotary_percent) if args.rotary_percent < 1 else d
        assert model.rotary_pos_emb(8).shape[-1] == rotated


# ----------------------------------------------------------------------------------------------
# the memory model follows each option
# ----------------------------------------------------------------------------------------------
def _shape(monkeypatch, option, **others):
    from megatron_dpp.models.families import GPT

    args = _parse(monkeypatch, *OPTIONS[option])
    fields = dict(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=32,
                  padded_vocab_size=VOCAB, ffn_hidden_size=args.ffn_hidden_size, dtype="fp32",
                  hidden_dropout=0.0, attention_dropout=0.0,
                  untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
                  **GPT.shape_fields(args))
    fields.update(others)
    return mm.model_shape("gpt", **fields)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_parameter_counts_and_flags_follow_the_option(monkeypatch, megatron, option):
    from megatron_dpp.models.families import GPT

    shape = _shape(monkeypatch, option)
    model = megatron.build_model(shape)  # from the shape's flags (GPT.shape_flags)
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    assert count(model.decoder.layers[0]) == mm.layer_parameter_count(shape)
    assert count(model.embedding) == mm.embedding_parameter_count(shape)
    assert count(model) == mm.total_parameter_count(shape)
    # At pp=1 a tied output layer's weight is the word embedding's (counted there).
    tied = 0 if shape.untie_embeddings_and_output_weights else VOCAB * shape.hidden_size
    assert (count(model.output_layer) + count(model.decoder.final_layernorm)
            == mm.output_parameter_count(shape) - tied)
    # The shape's flags give the shape back (the search's strategy files write them).
    args = _parse(monkeypatch, *GPT.shape_flags(shape), "--ffn-hidden-size",
                  str(shape.ffn_hidden_size),
                  *(["--untie-embeddings-and-output-weights"]
                    if shape.untie_embeddings_and_output_weights else []))
    assert _shape(monkeypatch, option, **GPT.shape_fields(args)) == shape


@pytest.mark.timeout(600)
@pytest.mark.parametrize("option", ["rope", "partial_rope", "swiglu", "squared_relu", "rmsnorm",
                                    "no_bias", "qkv_bias", "gqa", "mqa", "qk_layernorm",
                                    "kv_channels", "qwen3", "qwen2_5"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_activation_model_matches_saved_tensors(monkeypatch, megatron, option, dtype):
    """Exact for the layer in every recompute mode at micro-batch 1 and 2."""
    for dropout in (0.0, 0.1):
        shape = _shape(monkeypatch, option, dtype=dtype, hidden_dropout=dropout,
                       attention_dropout=dropout)
        for mode in mm.RECOMPUTE_MODES:
            block = megatron.build_layer(shape, mode)
            for batch in (1, 2):
                measured = megatron.measured_layer_activation_bytes(block, shape, batch)
                analytical = mm.layer_activation_bytes(shape, batch, 1, False, mode)
                assert analytical == measured, (option, dtype, dropout, mode, batch)


def test_the_runtime_estimate_reads_the_architecture_from_the_config(monkeypatch, megatron):
    from megatron_dpp.models import MODEL_SPECS

    shape = _shape(monkeypatch, "qwen3", num_layers=4)
    config = megatron.transformer_config(shape)
    (estimate,) = MODEL_SPECS["gpt"].activation_bytes(config, [2 * 32], 2, 1, 2)
    assert estimate == 2 * mm.layer_activation_bytes(shape, 2)
    assert estimate != 2 * mm.layer_activation_bytes(dataclasses.replace(
        shape, kv_channels=16, qk_layernorm=False), 2)


def test_forward_flops_follow_the_head_size(monkeypatch):
    shape = _shape(monkeypatch, "qwen3")
    s, b, h, f, q, kv = 32, 2, 64, 128, 4 * 32, 2 * 2 * 32
    expected = 2 * s * b * (h * (q + kv) + q * h + 3 * h * f) + 4 * b * s * s * q
    assert mm.layer_forward_flops(shape, b) == expected


# ----------------------------------------------------------------------------------------------
# DPP against Megatron's 1F1B
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dpp_matches_megatron_1f1b_on_a_qwen3_like_gpt():
    common = ["--train-iters", "6", "--pipeline-model-parallel-size", "2", *QWEN3]
    rc, ref_losses, ref_norms, out = run_training(common + ["--p2p-transport", "torch"], nproc=2,
                                                  timeout=300, base_args=TINY_GPT_ARGS)
    assert rc == 0, out[-3000:]
    assert len(ref_losses) == 6 and len(ref_norms) == 6, out[-3000:]
    rc, losses, norms, out = run_training(common + ["--use-dpp", "--dpp-timeout", "60",
                                                    "--p2p-transport", "shm"], nproc=2,
                                          timeout=300, base_args=TINY_GPT_ARGS)
    assert rc == 0, out[-3000:]
    assert losses == pytest.approx(ref_losses, rel=1e-5), (losses, ref_losses)
    assert norms == pytest.approx(ref_norms, rel=1e-5), (norms, ref_norms)
    assert ref_losses[-1] < ref_losses[0]
