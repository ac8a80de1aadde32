"""Optional kernels and core attention (megatron_dpp.kernels, megatron_dpp.models.sdpa_attention).

- SdpaCoreAttention equals Megatron-Core's DotProductAttention (forward and q/k/v gradients, fp32,
  1e-5): causal GPT, BERT's padding mask with padded rows, grouped-query attention, layer scaling;
- the flash-attn path, with a fake `flash_attn` module: layouts and the causal flag;
- with CUDA "available" and no optional package, the config and spec builders ask for nothing
  missing (every fusion that needs one is off, core attention is ours), and a layer built from the
  spec runs without importing any of them;
- the `kernels:` lines, once each; Megatron-Core's optional-package warnings filtered, others not.
"""
from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
import types

import pytest
import torch

from megatron_dpp import kernels
from megatron_dpp.models.gpt import GPT_SPEC

from _one_rank import one_rank_megatron
from _train_util import PYTHON, REPO_ROOT, data_args, ensure_sample_data

SQ, BATCH, HEADS, HEAD_DIM = 12, 3, 4, 8
TOLERANCE = dict(atol=1e-5, rtol=1e-5)

# Everything optional that some Megatron-Core fusion or backend imports.
OPTIONAL_MODULES = ("apex", "amp_C", "transformer_engine", "flash_attn", "triton",
                    *kernels.FUSED_SOFTMAX_MODULES, kernels.FUSED_WGRAD_MODULE,
                    "fused_layer_norm_cuda", "fast_layer_norm")


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    with one_rank_megatron(tmp_path_factory.mktemp("attention"), GPT_SPEC.cpu_patched_modules):
        yield


def _config(**overrides):
    from megatron.core.transformer import TransformerConfig

    settings = dict(num_layers=2, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                    use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                    bias_activation_fusion=False, bias_dropout_fusion=False,
                    masked_softmax_fusion=False, gradient_accumulation_fusion=False)
    settings.update(overrides)
    return TransformerConfig(**settings)


def _padding_mask(lengths: list[int], seq: int) -> torch.Tensor:
    """BertModel's [b, 1, s, s] mask (True = masked out) for samples of these real lengths."""
    real = (torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]).float()
    return ((real[:, None, :] * real[:, :, None]).unsqueeze(1)) < 0.5


def _qkv(groups: int, dtype=torch.float32):
    generator = torch.Generator().manual_seed(7)
    shapes = [(SQ, BATCH, HEADS, HEAD_DIM), (SQ, BATCH, groups, HEAD_DIM),
              (SQ, BATCH, groups, HEAD_DIM)]
    return [torch.randn(shape, generator=generator).to(dtype).requires_grad_() for shape in shapes]


def _run(module, qkv, mask, mask_type):
    output = module(*qkv, mask, attn_mask_type=mask_type)
    grad = torch.randn(output.shape, generator=torch.Generator().manual_seed(11))
    output.backward(grad)
    grads = [t.grad.clone() for t in qkv]
    for t in qkv:
        t.grad = None
    return output.detach(), grads


@pytest.mark.parametrize("layer_scaling", [False, True])
@pytest.mark.parametrize("groups", [HEADS, 2])
@pytest.mark.parametrize("mask_kind", ["causal", "padding"])
def test_sdpa_attention_equals_megatron_dot_product_attention(megatron, mask_kind, groups,
                                                              layer_scaling):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dpp.models.sdpa_attention import SdpaCoreAttention

    config = _config(num_query_groups=groups, apply_query_key_layer_scaling=layer_scaling)
    mask_type = AttnMaskType.causal if mask_kind == "causal" else AttnMaskType.padding
    # Padding: one full sample, two with padded positions (whose rows attend to nothing).
    mask = None if mask_kind == "causal" else _padding_mask([SQ, 7, 3], SQ)
    arguments = dict(config=config, layer_number=2, attn_mask_type=mask_type,
                     attention_type="self")
    reference = DotProductAttention(**arguments).train()
    ours = SdpaCoreAttention(**arguments).train()
    qkv = _qkv(groups)
    expected, expected_grads = _run(reference, qkv, mask, mask_type)
    actual, actual_grads = _run(ours, qkv, mask, mask_type)
    assert actual.shape == (SQ, BATCH, HEADS * HEAD_DIM)
    torch.testing.assert_close(actual, expected, **TOLERANCE)
    for name, got, want in zip("qkv", actual_grads, expected_grads):
        torch.testing.assert_close(got, want, **TOLERANCE, msg=f"gradient of {name}")
    assert torch.isfinite(actual).all()


def _fake_flash_attn(calls: list):
    """A `flash_attn` module whose flash_attn_func computes with SDPA in flash-attn's layout
    ([b, s, heads, hn]; fewer key/value heads for grouped-query attention)."""
    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
        calls.append(dict(q=tuple(q.shape), k=tuple(k.shape), causal=causal,
                          dropout_p=dropout_p, softmax_scale=softmax_scale))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # -> [b, heads, s, hn]
        repeat = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                               scale=softmax_scale)
        return out.transpose(1, 2)

    module = types.ModuleType("flash_attn")
    module.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    module.flash_attn_func = flash_attn_func
    return module


@pytest.mark.parametrize("groups", [HEADS, 2])
def test_flash_attn_path_transposes_layouts_and_passes_causal(megatron, monkeypatch, groups):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dpp.models.sdpa_attention import SdpaCoreAttention

    calls: list = []
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_attn(calls))
    config = _config(num_query_groups=groups, bf16=True, params_dtype=torch.bfloat16)
    arguments = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                     attention_type="self")
    flash = SdpaCoreAttention(**arguments, use_flash_attn=True).train()
    sdpa = SdpaCoreAttention(**arguments).train()
    qkv = _qkv(groups, torch.bfloat16)
    got, got_grads = _run(flash, qkv, None, AttnMaskType.causal)
    assert calls == [dict(q=(BATCH, SQ, HEADS, HEAD_DIM), k=(BATCH, SQ, groups, HEAD_DIM),
                          causal=True, dropout_p=0.0, softmax_scale=pytest.approx(HEAD_DIM ** -0.5))]
    want, want_grads = _run(sdpa, qkv, None, AttnMaskType.causal)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    for got_grad, want_grad in zip(got_grads, want_grads):
        torch.testing.assert_close(got_grad, want_grad, atol=2e-2, rtol=2e-2)
    # A padding mask (BERT) goes through SDPA: flash_attn_func takes no mask.
    _run(flash, qkv, _padding_mask([SQ, 7, 3], SQ), AttnMaskType.padding)
    assert len(calls) == 1


# ----------------------------------------------------------------------------------------------
# which attention, on a "GPU" without optional packages
# ----------------------------------------------------------------------------------------------
class _MissingModules:
    """A meta-path finder for which every optional module is missing; records each attempt and
    whether it was only a look-up (importlib.util.find_spec, as megatron_dpp.kernels probes)."""

    def __init__(self):
        self.attempts: list[tuple[str, bool]] = []

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in OPTIONAL_MODULES:
            return None
        probe = any(frame.f_code.co_name == "find_spec"
                    and frame.f_globals.get("__name__") == "importlib.util" for frame in _frames())
        self.attempts.append((name, probe))
        raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)


def _frames():
    frame = sys._getframe(1)
    while frame is not None:
        yield frame
        frame = frame.f_back


@pytest.fixture
def no_optional_packages(monkeypatch):
    # Megatron-Core's guarded imports of optional packages run when its modules are first
    # imported; import them now, so that what follows shows only what the builders ask for.
    import megatron.core.fusions.fused_layer_norm  # noqa: F401
    import megatron.core.models.bert.bert_layer_specs  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.transformer.transformer_layer  # noqa: F401

    for name in list(sys.modules):
        if name.split(".")[0] in OPTIONAL_MODULES:
            monkeypatch.delitem(sys.modules, name)
    finder = _MissingModules()
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    return finder


def _recipe_flags(path: str) -> list[str]:
    script = f'source "{REPO_ROOT / path}"; printf "%s\\n" "${{MODEL_ARGS[@]}}" "${{TRAINING_ARGS[@]}}"'
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True,
                            timeout=30)
    return result.stdout.split()


def _recipe_args(model: str, monkeypatch):
    from megatron_dpp.arguments import parse_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    if model == "gpt":
        base, recipe = data_args(), "examples/gpt3/gpt3_tiny.sh"
    else:
        sample = ensure_sample_data()
        base = ["--data-path", str(sample / "sample_bert_text_sentence"),
                "--tokenizer-type", "BertWordPieceLowerCase",
                "--vocab-file", str(sample / "bert-vocab.txt"), "--split", "98,2,0"]
        recipe = "examples/bert/bert_tiny.sh"
    args = parse_args([*base, *_recipe_flags(recipe)], prog=f"megatron_dpp.pretrain_{model}",
                      model=model)
    args.padded_vocab_size = 128  # what build_tokenizer sets
    return args


@pytest.mark.parametrize("model", ["gpt", "bert"])
def test_gpu_without_optional_packages_asks_for_nothing_missing(megatron, model, monkeypatch,
                                                                no_optional_packages):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module

    from megatron_dpp.models.bert import bert_layer_spec
    from megatron_dpp.models.gpt import gpt_layer_spec
    from megatron_dpp.models.sdpa_attention import SdpaCoreAttention
    from megatron_dpp.training.config import transformer_config_from_args

    args = _recipe_args(model, monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    choices = kernels.kernel_choices(args)
    config = transformer_config_from_args(args)
    attention = kernels.core_attention_from_args(args)
    spec = (gpt_layer_spec if model == "gpt" else bert_layer_spec)(attention.module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # build and run on CPU

    assert attention.module == kernels.SDPA, attention
    assert "Transformer Engine not installed" in attention.reason
    for fusion in ("masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion",
                   "apply_rope_fusion", "gradient_accumulation_fusion", "persist_layer_norm"):
        assert getattr(config, fusion) is False, fusion
    assert not choices.transformer_engine_layers.on
    assert "scaled_masked_softmax_cuda" not in choices.masked_softmax_fusion.reason  # unused
    assert "fused_weight_gradient_mlp_cuda not importable" in \
        choices.gradient_accumulation_fusion.reason
    # No FusedAdam of Transformer Engine or Apex: torch's own fused AdamW.
    assert choices.fused_optimizer.on and "torch's fused AdamW" in choices.fused_optimizer.reason
    core = spec.submodules.self_attention.submodules.core_attention
    assert core.module is SdpaCoreAttention
    assert all(probe for _name, probe in no_optional_packages.attempts), \
        no_optional_packages.attempts  # only megatron_dpp.kernels' look-ups so far

    no_optional_packages.attempts.clear()
    layer = build_module(spec, config=config, layer_number=1).train()
    hidden = torch.randn(16, 2, config.hidden_size, requires_grad=True)
    mask = None if model == "gpt" else _padding_mask([16, 9], 16)
    assert layer.self_attention.attn_mask_type == (
        AttnMaskType.causal if model == "gpt" else AttnMaskType.padding)
    output, _context = layer(hidden, attention_mask=mask)
    output.sum().backward()
    assert torch.isfinite(hidden.grad).all()
    assert no_optional_packages.attempts == []


def test_cpu_default_stays_megatron_local_attention(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    choice = kernels.core_attention()
    assert choice.module == kernels.LOCAL
    assert "activation-memory model" in choice.line()
    assert kernels.core_attention("sdpa").module == kernels.SDPA


def test_use_flash_attn_without_flash_attn_runs_sdpa_and_says_so(monkeypatch,
                                                                   no_optional_packages):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    choice = kernels.core_attention(use_flash_attn=True)
    assert choice.module == kernels.SDPA
    assert "flash-attn, which is not installed; torch SDPA runs instead" in choice.line()
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_attn([]))
    monkeypatch.setattr(sys, "meta_path", sys.meta_path[1:])  # flash_attn (the fake) is back
    assert kernels.core_attention(use_flash_attn=True).module == kernels.FLASH_ATTN
    assert kernels.core_attention(use_flash_attn=True, split_backward=True).module == \
        kernels.FLASH_ATTN  # core attention has no weights: the split backward takes it too


@pytest.mark.parametrize("te,flash,backend,use_flash,split,expected", [
    (True, False, "auto", False, False, (kernels.TRANSFORMER_ENGINE, "auto")),
    (True, False, "sdpa", False, False, (kernels.SDPA, "auto")),
    (True, False, "fused", False, False, (kernels.TRANSFORMER_ENGINE, "fused")),
    (True, True, "auto", True, False, (kernels.TRANSFORMER_ENGINE, "flash")),
    (True, False, "auto", True, False, (kernels.TRANSFORMER_ENGINE, "auto")),
    (True, True, "auto", True, True, (kernels.FLASH_ATTN, "auto")),
    (True, False, "auto", False, True, (kernels.SDPA, "auto")),
    (False, False, "local", False, False, (kernels.LOCAL, "auto")),
])
def test_core_attention_choice_on_a_gpu(te, flash, backend, use_flash, split, expected,
                                        monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "transformer_engine_available", lambda: te)
    monkeypatch.setattr(kernels, "flash_attn_available", lambda: flash)
    choice = kernels.core_attention(backend, use_flash, split)
    assert (choice.module, choice.te_backend) == expected, choice


def test_split_backward_models_take_the_chosen_attention(megatron, monkeypatch):
    from megatron_dpp.models.bert import BertShape, build_bert_chunks
    from megatron_dpp.models.gpt import GPTShape, build_gpt_chunks
    from megatron_dpp.models.sdpa_attention import SdpaCoreAttention
    from megatron_dpp.models.weight_grad import DeferredBertModel, DeferredGPTModel

    config = _config()
    (gpt,) = build_gpt_chunks(config, GPTShape(64, 16, False), seed=1, deferred_weight_grads=True,
                              attention=kernels.SDPA)
    (bert,) = build_bert_chunks(config, BertShape(64, 16, True), seed=1,
                                deferred_weight_grads=True, attention=kernels.SDPA)
    assert isinstance(gpt, DeferredGPTModel) and isinstance(bert, DeferredBertModel)
    for layer in [*gpt.decoder.layers, *bert.encoder.layers]:
        assert isinstance(layer.self_attention.core_attention, SdpaCoreAttention)
    assert bert.attn_mask_dimensions == "b1ss"
    tokens = torch.randint(0, 64, (2, 16))
    padding = (torch.arange(16)[None, :] < torch.tensor([[16], [10]])).long()
    lm_loss, _sop = bert(tokens, padding, tokentype_ids=torch.zeros_like(tokens),
                         lm_labels=tokens)
    assert torch.isfinite(lm_loss).all()


# ----------------------------------------------------------------------------------------------
# the startup lines and the warnings they replace
# ----------------------------------------------------------------------------------------------
def test_kernel_lines_are_printed_once_each(monkeypatch):
    import argparse

    monkeypatch.setattr(kernels, "_logged", False)
    args = argparse.Namespace(attention_backend="auto", use_flash_attn=False,
                              dpp_split_backward=False, gradient_accumulation_fusion=True,
                              no_persist_layer_norm=False, bias_gelu_fusion=True,
                              bias_swiglu_fusion=True, bias_dropout_fusion=True)
    lines: list[str] = []
    kernels.log_kernel_choices(args, lines.append)
    kernels.log_kernel_choices(args, lines.append)
    features = [line.split(":")[1].strip().rsplit(" ", 1)[0] for line in lines]
    assert len(lines) == 12 and all(line.startswith("kernels: ") for line in lines), lines
    assert len(set(features)) == len(features), features
    assert any(line.startswith("kernels: masked softmax fusion off: ") for line in lines)


_EMIT = """
import warnings
{install}
import megatron.core.models.gpt.gpt_layer_specs, megatron.core.models.bert.bert_lm_head
import megatron.core.optimizer
warnings.warn("Apex is not installed. Falling back to Torch Norm")  # not Megatron-Core's: shown
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("install", [False, True])
def test_megatron_optional_package_warnings_are_filtered(install):
    code = _EMIT.format(install="from megatron_dpp.kernels import install_warning_filters; "
                        "install_warning_filters()" if install else "")
    result = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    from_megatron = [line for line in result.stderr.splitlines()
                     if "site-packages/megatron/core" in line and "UserWarning" in line]
    if install:
        assert from_megatron == [], result.stderr
    else:  # the warnings the filter removes are there without it
        assert any("Apex is not installed" in line for line in from_megatron), result.stderr
        assert any("Transformer Engine and Apex" in line for line in from_megatron), result.stderr
    assert result.stderr.count("Apex is not installed") >= 1  # ours, from <string>, stays


# ----------------------------------------------------------------------------------------------
# the flags
# ----------------------------------------------------------------------------------------------
def _parse_errors(argv, monkeypatch, capsys, cuda=False):
    """parse_args on the tiny GPT recipe plus argv: its one-line error, or None if accepted."""
    from megatron_dpp.arguments import parse_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    try:
        parse_args([*data_args(), *_recipe_flags("examples/gpt3/gpt3_tiny.sh"), *argv],
                   prog="megatron_dpp.pretrain_gpt")
    except SystemExit as exit_:
        assert exit_.code == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1, lines
        return lines[0]
    return None


@pytest.mark.parametrize("argv,cuda,error", [
    (["--attention-backend", "sdpa"], False, None),
    (["--attention-backend", "local"], False, None),
    (["--attention-backend", "flash"], False,
     "--attention-backend flash is Transformer Engine's attention and needs Transformer Engine"),
    (["--attention-backend", "unfused"], True,
     "--attention-backend unfused is Transformer Engine's attention and needs Transformer Engine"),
    (["--attention-backend", "nonsense"], False, "invalid choice: 'nonsense'"),
    (["--use-flash-attn"], True, None),  # without flash-attn: runs torch SDPA, says so at startup
    (["--use-flash-attn", "--attention-backend", "local"], True,
     "--use-flash-attn asks for flash attention and --attention-backend local"),
])
def test_attention_flags(argv, cuda, error, monkeypatch, capsys, no_optional_packages):
    got = _parse_errors(argv, monkeypatch, capsys, cuda)
    if error is None:
        assert got is None
    else:
        assert got is not None and error in got, got


# ----------------------------------------------------------------------------------------------
# Megatron-LM's --no-bias-*-fusion flags (the torch.compile'd fusions)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model, flags, gelu_or_swiglu, dropout", [
    ("gpt", [], True, True),  # Megatron-LM's default where torch.compile has a GPU backend
    ("gpt", ["--no-bias-gelu-fusion"], False, True),
    ("gpt", ["--no-bias-dropout-fusion"], True, False),
    ("gpt", ["--no-bias-swiglu-fusion"], True, True),  # GPT's MLP is GeLU: not its flag
    ("gpt", ["--no-bias-gelu-fusion", "--bias-gelu-fusion"], True, True),  # the last one wins
    ("llama", ["--no-bias-swiglu-fusion"], False, True),
    ("llama", ["--no-bias-gelu-fusion"], True, True),
])
def test_bias_fusion_flags_decide_on_a_gpu(model, flags, gelu_or_swiglu, dropout, monkeypatch):
    from megatron_dpp.arguments import parse_args
    from megatron_dpp.training.config import transformer_config_from_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    recipe = {"gpt": "examples/gpt3/gpt3_tiny.sh", "llama": "examples/llama/llama_tiny.sh"}[model]
    args = parse_args([*data_args(), *_recipe_flags(recipe), *flags],
                      prog=f"megatron_dpp.pretrain_{model}", model=model)
    args.padded_vocab_size = 128
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "module_importable",
                        lambda name: name == kernels.TRITON_MODULE)  # triton only
    choices = kernels.kernel_choices(args)
    config = transformer_config_from_args(args)
    activation = "swiglu" if model == "llama" else "gelu"

    assert choices.bias_activation_fusion.feature == f"bias-{activation} fusion"
    assert (choices.bias_activation_fusion.on, config.bias_activation_fusion) == (gelu_or_swiglu,) * 2
    assert (choices.bias_dropout_fusion.on, config.bias_dropout_fusion) == (dropout,) * 2
    if not gelu_or_swiglu:
        assert choices.bias_activation_fusion.line() == (
            f"kernels: bias-{activation} fusion off: --no-bias-{activation}-fusion: unfused torch ops")
    if not dropout:
        assert choices.bias_dropout_fusion.line() == (
            "kernels: bias-dropout-add fusion off: --no-bias-dropout-fusion: unfused torch ops")


def test_gpt_125m_recipe_leaves_the_compiled_fusions_off(monkeypatch):
    """The GPU recipe's choice (its step is bound by the host); gpu_check.sh's gpt-fused step runs
    the fused variant beside it."""
    from megatron_dpp.arguments import parse_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "module_importable", lambda name: name == kernels.TRITON_MODULE)
    recipe = _recipe_flags("examples/gpt3/gpt3_125m.sh")
    choices = kernels.kernel_choices(parse_args([*data_args(), *recipe],
                                                prog="megatron_dpp.pretrain_gpt", model="gpt"))
    assert not choices.bias_activation_fusion.on and not choices.bias_dropout_fusion.on
    fused = kernels.kernel_choices(parse_args(
        [*data_args(), *recipe, "--bias-gelu-fusion", "--bias-dropout-fusion"],
        prog="megatron_dpp.pretrain_gpt", model="gpt"))
    assert fused.bias_activation_fusion.on and fused.bias_dropout_fusion.on


# ----------------------------------------------------------------------------------------------
# Megatron-Core loaded without torch's compiler where nothing is compiled
# ----------------------------------------------------------------------------------------------
_IMPORT = """
import sys, torch
from megatron_dpp import kernels
compile_ = torch.compile
kernels.import_megatron_core(compile_fusions={compile})
from megatron.core.fusions import fused_bias_dropout
from megatron.core.transformer import utils
import megatron.core.models.gpt
assert torch.compile is compile_
compiled = [hasattr(fn, "_torchdynamo_orig_callable")
            for fn in (utils.gelu_impl, fused_bias_dropout.bias_dropout_add_fused_train)]
print("dynamo" if "torch._dynamo" in sys.modules else "no dynamo", compiled)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("compile_fusions", [False, True])
def test_megatron_core_loads_without_torch_compile_where_nothing_is_compiled(compile_fusions):
    """The rank entry (megatron_dpp.pretrain) passes compile_fusions=cuda_available(): on a CPU
    Megatron-Core's torch.compile'd functions are plain ones and its import loads no Dynamo (about 3 s
    of a rank's start); with compiling they are wrapped, as Megatron-Core does by itself."""
    env = {name: value for name, value in os.environ.items()
           if name != "TORCHDYNAMO_DISABLE"}  # conftest.py's: torch.compile would wrap nothing
    result = subprocess.run([sys.executable, "-c", _IMPORT.format(compile=compile_fusions)],
                            capture_output=True, text=True, timeout=110, cwd=REPO_ROOT, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = "dynamo [True, True]" if compile_fusions else "no dynamo [False, False]"
    assert result.stdout.strip() == expected, result.stdout
