"""Megatron-LM's model flags that its scripts carry: the architecture flags (a Megatron-LM Llama
script's --swiglu --normalization RMSNorm ... validate with --model llama or --model gpt, and one
stating another architecture for BERT or Llama is refused in one line naming the model that has
it), --norm-epsilon,
--no-masked-softmax-fusion and --transformer-impl, each reaching Megatron-Core's TransformerConfig
or the `kernels:` choices (and --attention-softmax-in-fp32, which states what always holds here)."""
import pytest

from _train_util import data_args

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--micro-batch-size", "1", "--global-batch-size", "2",
        "--train-iters", "5", "--lr", "1e-3"]
# What Megatron-LM's Llama 2 example passes to describe the architecture.
LLAMA_SCRIPT = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                "--no-position-embedding", "--disable-bias-linear", "--group-query-attention",
                "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
                "--norm-epsilon", "1e-5", "--use-rotary-position-embeddings",
                "--rotary-percent", "1.0"]


def _parse(monkeypatch, capsys, model, *flags):
    """(args, None) or (None, the one error line)."""
    from megatron_dpp.arguments import parse_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    try:
        args = parse_args([*data_args(), *TINY, *flags], prog=f"megatron_dpp.pretrain_{model}",
                          model=model)
    except SystemExit as exit_:
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert exit_.code == 2 and len(lines) == 1, lines
        return None, lines[0]
    args.padded_vocab_size = 128  # what build_tokenizer sets
    return args, None


def test_a_megatron_lm_llama_script_validates_with_model_llama(monkeypatch, capsys):
    args, error = _parse(monkeypatch, capsys, "llama", *LLAMA_SCRIPT)
    assert error is None and args.num_query_groups == 2


@pytest.mark.parametrize("model, flags, expected", [
    # GPT takes each architecture flag on its own (tests/test_gpt_architecture_options.py);
    # BERT and Llama keep theirs.
    ("bert", ["--swiglu"], "--swiglu is not bert's architecture here (--model gpt or llama has "
                           "it); remove it"),
    ("bert", ["--position-embedding-type", "rope"],
     "--position-embedding-type rope is not bert's architecture here (--model gpt or llama has "
     "it)"),
    ("llama", ["--normalization", "LayerNorm"],
     "--normalization LayerNorm is not llama's architecture here (--model gpt or bert has it)"),
    ("llama", ["--qk-layernorm"], "--qk-layernorm is not llama's architecture here (--model gpt "
                                  "has it); remove it"),
    # Qwen2.5's QKV bias: GPT's (BERT has biases on every linear already), never Llama's.
    ("llama", ["--add-qkv-bias"], "--add-qkv-bias is not llama's architecture here (--model gpt "
                                  "or bert has it); remove it"),
    ("gpt", ["--rotary-percent", "1.0"],
     "--rotary-percent 1 sets rotary embeddings and --position-embedding-type is "
     "learned_absolute: add --position-embedding-type rope or remove it"),
    ("llama", ["--rotary-percent", "0.5"],
     "--rotary-percent 0.5 is not llama's architecture here (--model gpt has it)"),
    ("gpt", ["--norm-epsilon", "0"], "--norm-epsilon must be positive, got 0.0"),
    ("gpt", ["--transformer-impl", "local", "--attention-backend", "flash"],
     "--attention-backend flash is Transformer Engine's; drop it or --transformer-impl local"),
])
def test_another_models_architecture_is_one_line(monkeypatch, capsys, model, flags, expected):
    args, error = _parse(monkeypatch, capsys, model, *flags) if model != "bert" else \
        _parse_bert(monkeypatch, capsys, *flags)
    assert args is None and expected in error, error


def _parse_bert(monkeypatch, capsys, *flags):
    from _train_util import ensure_sample_data
    from megatron_dpp.arguments import parse_args

    sample = ensure_sample_data()
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    try:
        parse_args(["--data-path", str(sample / "sample_bert_text_sentence"), "--vocab-file",
                    str(sample / "bert-vocab.txt"), "--split", "98,2,0", *TINY, *flags],
                   prog="megatron_dpp.pretrain_bert", model="bert")
    except SystemExit:
        return None, capsys.readouterr().err.strip().splitlines()[-1]
    return True, None


def test_transformer_engine_layers_are_refused_where_it_is_missing(monkeypatch, capsys):
    from megatron_dpp.kernels import transformer_engine_available

    if transformer_engine_available():
        pytest.skip("Transformer Engine is installed here")
    _args, error = _parse(monkeypatch, capsys, "gpt", "--transformer-impl", "transformer_engine")
    assert "--transformer-impl transformer_engine needs Transformer Engine on a GPU" in error
    assert error.endswith("; use --transformer-impl local")


def test_the_flags_reach_the_transformer_config_and_the_kernel_lines(monkeypatch, capsys):
    from megatron_dpp.kernels import kernel_choices
    from megatron_dpp.training.config import transformer_config_from_args

    args, _ = _parse(monkeypatch, capsys, "llama", *LLAMA_SCRIPT, "--norm-epsilon", "1e-6",
                     "--attention-softmax-in-fp32", "--attention-backend", "local",
                     "--no-masked-softmax-fusion", "--transformer-impl", "local")
    config = transformer_config_from_args(args)
    # --attention-softmax-in-fp32 states what always holds here (Megatron-Core's default).
    assert config.layernorm_epsilon == 1e-6 and config.attention_softmax_in_fp32
    assert config.normalization == "RMSNorm" and config.num_query_groups == 2
    assert not config.masked_softmax_fusion
    choices = kernel_choices(args)
    assert choices.masked_softmax_fusion.line() == \
        "kernels: masked softmax fusion off: --no-masked-softmax-fusion: torch softmax"
    assert "unfused rotary embedding" in choices.rope_fusion.line()
    defaults, _ = _parse(monkeypatch, capsys, "gpt")
    config = transformer_config_from_args(defaults)
    assert config.layernorm_epsilon == 1e-5 and config.attention_softmax_in_fp32
    assert "learned absolute position embeddings" in kernel_choices(defaults).rope_fusion.line()


def _refused_flags():
    from megatron_dpp.arguments import REFUSED_FLAGS

    return sorted(REFUSED_FLAGS.items())


@pytest.mark.parametrize("flag, reason", _refused_flags())
def test_every_refused_flag_is_one_line_with_its_reason(monkeypatch, capsys, flag, reason):
    """Megatron-LM's flags that cannot apply here (its example scripts carry several: FP8,
    --apply-layernorm-1p, ...): one line, before launch, saying why."""
    args, error = _parse(monkeypatch, capsys, "gpt", flag)
    assert args is None and error.endswith(f"error: {flag} {reason}; remove it"), error
