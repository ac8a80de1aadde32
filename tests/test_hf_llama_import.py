"""tools/convert_hf_llama.py: a Hugging Face Llama directory as a model-only checkpoint that
`--model llama --load DIR --finetune` trains from; tools/export_hf_llama.py: a checkpoint back as
a Hugging Face directory. Small Llamas are made here with transformers (random weights,
grouped-query attention, rotary base 500000, with and without Llama 3.1's rotary scaling, the
config.json as transformers 5 writes it and as Meta's files have it); the converted model's
logits must equal transformers' own forward, the way back must give the weights bit for bit, and
the launcher must train from the checkpoint at pp=2 with the DPP runtime, its checkpoint then
exported and read by transformers with our model's logits."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import warnings

import pytest
import torch

from _train_util import PYTHON, REPO_ROOT, _env, main_in_process
from megatron_dpp.convert import llama_hf
from megatron_dpp.one_line_errors import InputError

VOCAB = 256  # a multiple of 128: Megatron pads nothing
LLAMA31_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _write_tokenizer(directory) -> None:
    """A Hugging Face tokenizer of VOCAB words (w0 is BOS, w1 EOS), as Llama 3's files lay it
    out: tokenizer.json and tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w2"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "w0", "eos_token": "w1"}))


def _make_llama(directory, scaled: bool, dtype=torch.float32, metas_keys: bool = False,
                tokenizer: bool = False, mistral: bool = False) -> None:
    """A random Llama saved by transformers; metas_keys: its config.json rewritten with
    rope_theta and rope_scaling as Meta's published files have them; tokenizer: with a
    tokenizer's files beside it; mistral: a Mistral (v0.2's kind: no attention window)."""
    import transformers

    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                 max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=0,
                 eos_token_id=1)
    if mistral:
        config = transformers.MistralConfig(**shape, rope_theta=1000000.0, sliding_window=None)
        model = transformers.MistralForCausalLM(config).to(dtype)
    else:
        config = transformers.LlamaConfig(**shape, rope_theta=500000.0,
                                          rope_scaling=dict(LLAMA31_SCALING) if scaled else None)
        model = transformers.LlamaForCausalLM(config).to(dtype)
    with torch.no_grad():  # the norms away from 1, so that a swapped norm shows
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
    model.save_pretrained(str(directory))
    if tokenizer:
        _write_tokenizer(directory)
    if metas_keys:
        path = directory / "config.json"
        written = json.loads(path.read_text())
        parameters = written.pop("rope_parameters", None) or {}
        written["rope_theta"] = parameters.get("rope_theta", 500000.0)
        written["rope_scaling"] = dict(LLAMA31_SCALING) if scaled else None
        written["torch_dtype"] = written.pop("dtype", "float32")
        path.write_text(json.dumps(written))


def _convert(hf_dir, save, *extra) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "tools/convert_hf_llama.py", "--hf-dir", str(hf_dir), "--save",
                           str(save), *extra], capture_output=True, text=True, timeout=200,
                          env=_env(), cwd=REPO_ROOT)


def _export(load, save, *extra) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "tools/export_hf_llama.py", "--load", str(load), "--save",
                           str(save), *extra], capture_output=True, text=True, timeout=200,
                          env=_env(), cwd=REPO_ROOT)


def _in_process(main, argv) -> subprocess.CompletedProcess:
    """A tool's main (convert_hf_llama.main, export_main) called in this process, its exit code
    and output as the command's: a process of its own spends seconds importing torch and
    Megatron-Core. The tests that check a tool prints nothing on stderr (no warnings: an
    interpreter's imports included) run the command itself."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level  # the tool quiets it, and its warning filters
    try:
        with warnings.catch_warnings():
            return main_in_process(main, argv)
    finally:
        logger.setLevel(level)


def _convert_here(hf_dir, save, *extra) -> subprocess.CompletedProcess:
    from megatron_dpp.convert.convert_hf_llama import main

    return _in_process(main, ["--hf-dir", hf_dir, "--save", save, *extra])


def _export_here(load, save, *extra) -> subprocess.CompletedProcess:
    from megatron_dpp.convert.convert_hf_llama import export_main

    return _in_process(export_main, ["--load", load, "--save", save, *extra])


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """convert(**kind): a Llama made by _make_llama(**kind) and converted by the command (or, with
    here=True, in this process), once per module for the tests that only read them (the same
    kind: the same keywords); (its directory, the checkpoint, the conversion's CompletedProcess),
    which each test checks itself."""
    made = {}

    def convert(here: bool = False, **kind):
        key = (here, *sorted(kind.items()))
        if key not in made:
            directory = tmp_path_factory.mktemp("converted")
            _make_llama(directory / "hf", **kind)
            made[key] = (directory / "hf", directory / "ckpt",
                         (_convert_here if here else _convert)(directory / "hf",
                                                               directory / "ckpt"))
        return made[key]

    return convert


def _safetensors(directory) -> dict:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def _flags(stdout: str) -> list[str]:
    """The model flags of the converter's "train with:" line (its tokenizer flags left out)."""
    line = next(line for line in stdout.splitlines() if "train with:" in line)
    flags = line.split("train with: --model llama ", 1)[1].split()
    end = min(flags.index(flag) for flag in ("--load", "--tokenizer-type") if flag in flags)
    return flags[:end]


@contextlib.contextmanager
def _megatron():
    """One rank's Megatron for our model; only around our model's use, as the tools called in
    this process (_in_process) start and end a group of their own."""
    from megatron_dpp.search import model_measurement

    with model_measurement.single_process_megatron("llama"):
        yield


@pytest.fixture
def megatron():
    with _megatron():
        yield


def _assert_our_logits_equal_transformers(flags: list[str], checkpoint, hf_dir) -> None:
    """Our Llama (pp = tp = 1, fp32) built from the trainer flags and loaded from `checkpoint`
    (an iteration folder, saved at any layout) against transformers' model from hf_dir."""
    from megatron.core import dist_checkpointing
    from transformers import AutoModelForCausalLM

    from megatron_dpp.arguments import parse_args
    from megatron_dpp.models.llama import build_llama_chunks
    from megatron_dpp.training.config import transformer_config_from_args

    args = parse_args([*flags, "--seq-length", "48", "--micro-batch-size", "1",
                       "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-4",
                       "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                       str(VOCAB - 1), "--attention-backend", "sdpa", "--hidden-dropout", "0",
                       "--attention-dropout", "0"], model="llama")
    args.padded_vocab_size = VOCAB  # as build_tokenizer sets it
    (model,) = build_llama_chunks(args, transformer_config_from_args(args), seed=1)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(checkpoint))
    model.load_state_dict(loaded["model"], strict=True)
    model.eval()
    reference = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    tokens = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(48).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        ours = model(tokens, positions, attention_mask=None)
        theirs = reference(tokens).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scaled, metas_keys, mistral",
                         [(False, False, False), (True, True, False), (False, False, True)],
                         ids=["llama3", "llama3.1-metas-config", "mistral"])
def test_converted_logits_equal_transformers(megatron, converted, scaled, metas_keys, mistral):
    hf_dir, ckpt, done = converted(scaled=scaled, metas_keys=metas_keys, mistral=mistral)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.strip() == "", done.stderr[-3000:]  # no warnings
    flags = _flags(done.stdout)
    assert ("--use-rope-scaling" in flags) == scaled
    assert flags[flags.index("--rotary-base") + 1] == ("1000000" if mistral else "500000")
    _assert_our_logits_equal_transformers(flags, ckpt / "iter_0000000", hf_dir)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_export_gives_back_the_weights_bit_for_bit(converted, tmp_path, dtype):
    # bf16's conversion is the launcher test's, by the command; fp32's is this test's own: in
    # this process (the export, whose stderr is checked, runs the command).
    hf_dir, ckpt, conversion = converted(here=dtype == torch.float32, scaled=True, dtype=dtype,
                                         tokenizer=True)
    assert conversion.returncode == 0, conversion.stderr[-3000:]
    assert (f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {hf_dir} --load "
            f"{ckpt} --finetune" in conversion.stdout), conversion.stdout
    done = _export(ckpt, tmp_path / "back")
    assert done.returncode == 0 and done.stderr.strip() == "", done.stderr[-3000:]
    original, exported = _safetensors(hf_dir), _safetensors(tmp_path / "back")
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert exported[name].dtype == dtype and torch.equal(exported[name], tensor), name
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["rope_scaling"] == LLAMA31_SCALING and config["vocab_size"] == VOCAB
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)  # from the tokenizer
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(tmp_path / "back"))


@pytest.mark.parametrize("change, message", [
    ({"tie_word_embeddings": True}, "tie_word_embeddings (Llama 3.2 1B/3B's tied output layer"),
    ({"attention_bias": True}, "attention_bias (--model llama has no biases) is not supported"),
    ({"model_type": "qwen2"}, "model_type 'qwen2'; only Llama's architecture converts here "
                              "('llama', 'mistral')"),
    ({"model_type": "mistral", "sliding_window": 4096},
     "sliding_window 4096 (Mistral 7B v0.1's windowed attention"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' (Llama's MLP is SwiGLU: silu) is not supported"),
    ({"head_dim": 32}, "head_dim 32 is not hidden_size / num_attention_heads (64 / 4)"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling {'rope_type': 'yarn'"),
    ({"rope_scaling": dict(LLAMA31_SCALING, original_max_position_embeddings=4096)},
     "is not Llama 3.1's"),
])
def test_configs_it_cannot_build_are_one_line_errors(change, message):
    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
              "num_hidden_layers": 2, "intermediate_size": 160, "max_position_embeddings": 128,
              "hidden_act": "silu", "rope_theta": 500000.0, **change}
    with pytest.raises(InputError) as raised:
        llama_hf.trainer_flags(config)
    assert "\n" not in str(raised.value) and message in str(raised.value), raised.value


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["sharded", "pytorch_model.bin"])
def test_every_weight_file_layout_converts(tmp_path, layout):
    """Weights in several model-0000K-of-0000N.safetensors files (their index names each
    tensor's file), or in pytorch_model.bin: converted and exported back, bit for bit."""
    from transformers import AutoModelForCausalLM

    _make_llama(tmp_path / "single", scaled=False)
    original = _safetensors(tmp_path / "single")
    source = tmp_path / "source"
    if layout == "sharded":
        AutoModelForCausalLM.from_pretrained(str(tmp_path / "single")).save_pretrained(
            str(source), max_shard_size="100KB")
        assert len([name for name in os.listdir(source) if name.endswith(".safetensors")]) > 2
    else:
        source.mkdir()
        (source / "config.json").write_text((tmp_path / "single" / "config.json").read_text())
        torch.save(original, source / "pytorch_model.bin")
    assert _convert_here(source, tmp_path / "ckpt").returncode == 0
    done = _export_here(tmp_path / "ckpt", tmp_path / "back", "--vocab-size", str(VOCAB))
    assert done.returncode == 0, done.stderr[-3000:]
    exported = _safetensors(tmp_path / "back")
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[name], tensor) for name, tensor in original.items())


@pytest.mark.timeout(300)
def test_export_mistakes_are_one_line_errors(converted, tmp_path):
    # No tokenizer files: the Llama of test_converted_logits_equal_transformers[llama3].
    _, ckpt, conversion = converted(scaled=False, metas_keys=False, mistral=False)
    assert conversion.returncode == 0
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    # The first through the command (its exit code and stderr), the others in this process.
    cases = [(_export, (tmp_path / "none", tmp_path / "out"),
              f"--load '{tmp_path / 'none'}' is not a directory"),
             (_export_here, (ckpt, tmp_path / "out"), "names no tokenizer (converted from "
                                                      "weights without one); pass --vocab-size N"),
             (_export_here, (ckpt, tmp_path / "full", "--vocab-size", "256"),
              f"--save '{tmp_path / 'full'}' exists and is not an empty directory"),
             (_export_here, (ckpt, tmp_path / "out", "--vocab-size", "300"),
              "--vocab-size 300 exceeds the checkpoint's padded vocabulary 256")]
    for export, arguments, expected in cases:
        done = export(*arguments)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
        assert expected in lines[0], lines[0]
    assert not (tmp_path / "out").exists()
    assert [name for name in os.listdir(tmp_path) if name.startswith(".export")] == []


@pytest.mark.timeout(200)
def test_bad_directories_are_one_line_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "no_weights").mkdir()
    (tmp_path / "no_weights" / "config.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
         "num_hidden_layers": 2, "intermediate_size": 160, "max_position_embeddings": 128,
         "vocab_size": VOCAB}))
    cases = {"missing": "--hf-dir '{d}' is not a directory",
             "empty": "'{d}' has no config.json; pass the directory of a Hugging Face Llama",
             "no_weights": "'{d}' has no weights (model.safetensors, its index, or "
                           "pytorch_model.bin)"}
    # The first through the command (its exit code and stderr), the others in this process.
    for name, expected in cases.items():
        directory = tmp_path / name
        convert = _convert if name == "missing" else _convert_here
        done = convert(directory, tmp_path / "out")
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
        assert expected.format(d=directory) in lines[0], lines[0]
    assert not (tmp_path / "out" / "iter_0000000").exists()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_launcher_trains_from_the_converted_checkpoint_at_pp2(converted, tmp_path):
    """A bf16 Llama converted, then trained in bf16 at pp=2 with --use-dpp (the checkpoint,
    written at pp=1, reshards on load); without --finetune the load says how to load it. The
    trained checkpoint (saved at pp=2) exported: transformers reads it and gives our logits."""
    hf_dir, ckpt, done = converted(scaled=True, dtype=torch.bfloat16, tokenizer=True)
    assert done.returncode == 0, done.stderr[-3000:]
    done_flags = done.stdout
    common = ["--seq-length", "32", "--train-iters", "4", "--global-batch-size", "8",
              "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "0", "--bf16",
              *_flags(done.stdout), "--load", str(ckpt)]
    # RECIPE named: the converted shape flags alone would leave every other flag at Megatron-LM's
    # default (no --micro-batch-size, no --lr); the tiny recipe fills them, as a user would ask.
    env = _env({**os.environ, "PP": "2", "RECIPE": "llama_tiny", "DATA_ARGS": f"--mock-data --tokenizer-type "
                f"NullTokenizer --vocab-size {VOCAB - 1}"})

    def launch(*extra):
        return subprocess.run(["bash", "run_scripts/run_single_llama.sh", *common, *extra],
                              capture_output=True, text=True, timeout=280, cwd=REPO_ROOT, env=env)

    trained = launch("--finetune", "--save", str(tmp_path / "trained"))
    assert trained.returncode == 0, (trained.stdout + trained.stderr)[-3000:]
    assert "warning: checkpoint" not in trained.stderr, trained.stderr[-3000:]
    assert "PP=2" in trained.stdout and "USE_DPP=1" in trained.stdout, trained.stdout[-3000:]
    assert (f"loaded checkpoint from {ckpt / 'iter_0000000'} at iteration 0 "
            f"(--finetune" in trained.stdout), trained.stdout[-3000:]
    losses = [float(v) for v in re.findall(r"\| lm loss: ([-+0-9.eE]+)", trained.stdout)]
    assert len(losses) == 4 and all(loss == loss for loss in losses), trained.stdout[-3000:]
    # Llama 3.1's checkpoint trained with another rotary scaling factor: it loads (the shapes
    # agree; the other load flags also take a model-only checkpoint), and one line says so.
    other = launch("--no-load-optim", "--no-load-rng", "--rope-scaling-factor", "32")
    assert other.returncode == 0, (other.stdout + other.stderr)[-3000:]
    warnings = [line for line in other.stderr.splitlines() if "warning: checkpoint" in line]
    assert len(warnings) == 1 and ("was saved with --rope-scaling-factor 8.0; this run has "
                                   "--rope-scaling-factor 32.0" in warnings[0]), other.stderr[-3000:]
    refused = launch()
    assert refused.returncode != 0
    assert ("holds the model only (no optimizer, learning-rate schedule or RNG states, as a "
            "converted checkpoint): load it with --finetune" in refused.stdout + refused.stderr)
    # The run named NullTokenizer: the export takes the vocabulary from --vocab-size.
    done = _export_here(tmp_path / "trained", tmp_path / "exported", "--vocab-size", str(VOCAB))
    assert done.returncode == 0, done.stderr[-3000:]
    exported = _safetensors(tmp_path / "exported")
    original = _safetensors(hf_dir)
    assert exported["lm_head.weight"].dtype == torch.bfloat16
    assert not torch.equal(exported["lm_head.weight"], original["lm_head.weight"])  # trained
    with _megatron():
        _assert_our_logits_equal_transformers(_flags(done_flags), tmp_path / "trained" /
                                              "iter_0000004", tmp_path / "exported")
