"""The search's profiler builds the TransformerConfig that training builds, field by field
(megatron_dpp.models.transformer_config, the one builder), so the profiled layer is the trained
one; only the profiler's own flags (model_measurement.PROFILER_FLAGS) may set a field differently.
"""
import dataclasses
import functools

import pytest

from _train_util import data_args, ensure_sample_data

VOCAB = 1024

# (model, shape, training flags beyond the shape, profiler recompute mode, tp, dtype)
CASES = [
    ("gpt", dict(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=64),
     [], "none", 1, "fp32"),
    ("gpt", dict(num_layers=2, hidden_size=128, num_attention_heads=8, seq_length=128,
                 ffn_hidden_size=320, hidden_dropout=0.0, attention_dropout=0.0,
                 untie_embeddings_and_output_weights=True),
     ["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"], "full", 2, "bf16"),
    ("bert", dict(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=64,
                  max_position_embeddings=96),
     ["--recompute-activations"], "selective", 1, "bf16"),
    ("bert", dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                  bert_binary_head=False),
     ["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"], "full", 2, "fp32"),
]


def _shape_flags(shape) -> list[str]:
    flags = ["--num-layers", shape.num_layers, "--hidden-size", shape.hidden_size,
             "--num-attention-heads", shape.num_attention_heads, "--seq-length", shape.seq_length,
             "--ffn-hidden-size", shape.ffn_hidden_size,
             "--max-position-embeddings", shape.max_position_embeddings,
             "--hidden-dropout", shape.hidden_dropout,
             "--attention-dropout", shape.attention_dropout]
    if shape.untie_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    if shape.model == "bert" and not shape.bert_binary_head:
        flags.append("--bert-no-binary-head")
    return [str(flag) for flag in flags]


def _bert_data_args() -> list[str]:
    sample = ensure_sample_data()
    return ["--data-path", str(sample / "sample_bert_text_sentence"),
            "--vocab-file", str(sample / "bert-vocab.txt"), "--split", "98,2,0"]


def _training_config(shape, extra, tp, dtype, monkeypatch):
    """As pretrain_<model> builds it: parse_args, then training's builder."""
    from megatron_dpp.arguments import parse_args
    from megatron_dpp.training.config import transformer_config_from_args

    monkeypatch.setenv("WORLD_SIZE", str(tp))
    monkeypatch.setenv("RANK", "0")
    data = data_args() if shape.model == "gpt" else _bert_data_args()
    args = parse_args([*data, *_shape_flags(shape), "--tensor-model-parallel-size", str(tp),
                       "--micro-batch-size", "1", "--global-batch-size", "4",
                       "--train-iters", "5", "--lr", "1e-3", *extra], model=shape.model)
    # --bf16/--fp16 are GPU only as flags (refused on CPU): the parsed value, as a GPU run has it.
    args.bf16, args.fp16 = dtype == "bf16", dtype == "fp16"
    return transformer_config_from_args(args)


def _fields(config) -> dict:
    """Every field; the init methods (functools.partial, which compare by identity) by what they
    call with which arguments."""
    def comparable(value):
        if isinstance(value, functools.partial):
            return (value.func, value.args, tuple(sorted(value.keywords.items())))
        return value

    return {field.name: comparable(getattr(config, field.name))
            for field in dataclasses.fields(config)}


def _differences(one, other) -> dict:
    a, b = _fields(one), _fields(other)
    return {name: (a[name], b[name]) for name in a if a[name] != b[name]}


@pytest.mark.parametrize("model, shape_fields, extra, recompute, tp, dtype", CASES)
def test_the_profiler_builds_training_s_transformer_config(model, shape_fields, extra, recompute,
                                                           tp, dtype, monkeypatch):
    from megatron_dpp.search import memory_model as mm
    from megatron_dpp.search import model_measurement

    shape = mm.model_shape(model, padded_vocab_size=VOCAB, dtype=dtype, **shape_fields)
    profiled = model_measurement.transformer_config(shape, recompute, tp)
    # Training with the profiler's own flags: the same config, every field.
    same_flags = _training_config(shape, [*extra, *model_measurement.PROFILER_FLAGS], tp, dtype,
                                  monkeypatch)
    assert _differences(same_flags, profiled) == {}
    # Training with its defaults: at most the fields those flags set differ.
    trained = _training_config(shape, extra, tp, dtype, monkeypatch)
    assert set(_differences(trained, profiled)) <= {"use_cpu_initialization",
                                                    "gradient_accumulation_fusion"}
    assert profiled.use_cpu_initialization is True
    assert profiled.gradient_accumulation_fusion is False

