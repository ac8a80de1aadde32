"""Every flag of Megatron-LM's training parser (core_v0.16.1's megatron/training/arguments.py, the
release of Megatron-Core 0.16.1; tests/data/megatron_lm_core_v0.16.1_flags.txt, made by
tools/megatron_lm_flags.py) is one of three classes here, and none is "unrecognized":

- works: it does what Megatron-LM's does (parses on a minimal valid command line, with what it
  needs beside it: NEEDS);
- accepted: it asks for what always holds here, and its --help says so ("always so here"); a value
  whose meaning does not hold is refused in one line (flag_errors.StatedFlag);
- refused: one line naming the reason and what to use instead (REFUSED_FLAGS).

Flags another piece of work is building (HANDLED_ELSEWHERE) need only be recognized, or refused in
one line. Parsing runs in this process: one parser per model, validate_args on each command line.
"""
import argparse
from pathlib import Path

import pytest
import torch

from _train_util import data_args, ensure_sample_data

FLAG_FILE = Path(__file__).parent / "data" / "megatron_lm_core_v0.16.1_flags.txt"


def _read_flag_list() -> dict[str, list[str]]:
    """flag -> the example value the list gives it ([] for a flag without a value)."""
    flags = {}
    for line in FLAG_FILE.read_text().splitlines():
        if line.startswith("--"):
            flag, *value = line.split(" ", 1)
            flags[flag] = value
    return flags


MEGATRON_LM_FLAGS = _read_flag_list()

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--micro-batch-size", "1", "--global-batch-size", "2",
        "--train-iters", "5", "--lr", "1e-3"]

HANDLED_ELSEWHERE = {
    "architecture": ["--position-embedding-type", "--rotary-percent", "--rotary-base",
                     "--no-rope-fusion", "--swiglu", "--squared-relu", "--normalization",
                     "--disable-bias-linear", "--group-query-attention", "--num-query-groups",
                     "--qk-layernorm", "--kv-channels", "--untie-embeddings-and-output-weights",
                     "--apply-query-key-layer-scaling", "--no-position-embedding",
                     "--use-rotary-position-embeddings"],
    "evaluation without training": ["--skip-train"],
}
ELSEWHERE = {flag for flags in HANDLED_ELSEWHERE.values() for flag in flags}

# Class (b) flags that are ordinary argparse flags (the StatedFlag tables hold the others).
ACCEPTED_FLAGS = ["--attention-softmax-in-fp32", "--accumulate-allreduce-grads-in-fp32",
                  "--auto-detect-ckpt-format", "--use-mcore-models", "--exit-signal-handler",
                  "--no-scatter-gather-tensors-in-pipeline",
                  "--no-create-attention-mask-in-dataloader", "--local-rank"]

PP2 = ["--pipeline-model-parallel-size", "2"]
FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", "1"]
PROFILE = ["--profile", "--use-pytorch-profiler", "--profile-step-start", "1",
           "--profile-step-end", "3"]
# Working flags that need a CUDA GPU: (world size, command line, what the refusal says on CPU).
GPU_ONLY = {
    "--use-flash-attn": (1, ["--use-flash-attn"], "--use-flash-attn needs a CUDA GPU"),
    "--distribute-saved-activations": (
        2, ["--tensor-model-parallel-size", "2", *FULL_RECOMPUTE,
            "--distribute-saved-activations"], "--distribute-saved-activations needs CUDA GPUs"),
}


def _sample(name: str) -> str:
    return str(ensure_sample_data() / name)


# (model, world size, command line) of a working flag where the flag alone with the list's example
# value is not a valid command line; a flag without an entry runs as `FLAG [VALUE]` on gpt.
def _needs() -> dict:
    sample_data = _sample("sample_text_document")
    return {
        # model
        "--ffn-hidden-size": ("gpt", 1, ["--ffn-hidden-size", "128"]),
        "--max-position-embeddings": ("gpt", 1, ["--max-position-embeddings", "128"]),
        "--seq-length": ("gpt", 1, ["--seq-length", "32"]),
        "--num-layers": ("gpt", 1, ["--num-layers", "2"]),
        "--hidden-size": ("gpt", 1, ["--hidden-size", "64"]),
        "--num-attention-heads": ("gpt", 1, ["--num-attention-heads", "4"]),
        "--hidden-dropout": ("gpt", 1, ["--hidden-dropout", "0.0"]),
        "--attention-dropout": ("gpt", 1, ["--attention-dropout", "0.0"]),
        "--transformer-impl": ("gpt", 1, ["--transformer-impl", "local"]),
        "--attention-backend": ("gpt", 1, ["--attention-backend", "local"]),
        "--cross-entropy-fusion-impl": ("gpt", 1, ["--cross-entropy-loss-fusion",
                                                   "--cross-entropy-fusion-impl", "native"]),
        "--recompute-granularity": ("gpt", 1, FULL_RECOMPUTE),
        "--recompute-method": ("gpt", 1, FULL_RECOMPUTE),
        "--recompute-num-layers": ("gpt", 1, FULL_RECOMPUTE),
        "--cuda-graph-impl": ("gpt", 1, ["--cuda-graph-impl", "none"]),
        "--norm-epsilon": ("gpt", 1, ["--norm-epsilon", "1e-6"]),
        "--init-method-std": ("gpt", 1, ["--init-method-std", "0.01"]),
        "--make-vocab-size-divisible-by": ("gpt", 1, ["--make-vocab-size-divisible-by", "64"]),
        "--use-rope-scaling": ("llama", 1, ["--use-rope-scaling"]),
        "--rope-scaling-factor": ("llama", 1, ["--use-rope-scaling", "--rope-scaling-factor",
                                               "32"]),
        "--bert-no-binary-head": ("bert", 1, ["--bert-no-binary-head"]),
        "--mask-prob": ("bert", 1, ["--mask-prob", "0.15"]),
        "--short-seq-prob": ("bert", 1, ["--short-seq-prob", "0.1"]),
        # parallelism
        "--tensor-model-parallel-size": ("gpt", 2, ["--tensor-model-parallel-size", "2"]),
        "--pipeline-model-parallel-size": ("gpt", 2, PP2),
        "--num-layers-per-virtual-pipeline-stage": (
            "gpt", 2, [*PP2, "--num-layers-per-virtual-pipeline-stage", "1"]),
        "--num-virtual-stages-per-pipeline-rank": (
            "gpt", 2, [*PP2, "--num-virtual-stages-per-pipeline-rank", "2", "--num-layers", "4"]),
        "--decoder-first-pipeline-num-layers": (
            "gpt", 2, [*PP2, "--num-layers", "3", "--decoder-first-pipeline-num-layers", "1"]),
        "--decoder-last-pipeline-num-layers": (
            "gpt", 2, [*PP2, "--num-layers", "3", "--decoder-last-pipeline-num-layers", "1"]),
        "--account-for-embedding-in-pipeline-split": (
            "gpt", 2, [*PP2, "--num-layers", "3", "--account-for-embedding-in-pipeline-split"]),
        "--account-for-loss-in-pipeline-split": (
            "gpt", 2, [*PP2, "--num-layers", "3", "--account-for-loss-in-pipeline-split"]),
        "--pipeline-model-parallel-layout": (
            "gpt", 2, [*PP2, "--pipeline-model-parallel-layout", "Et|tL"]),
        "--use-distributed-optimizer": ("gpt", 2, ["--use-distributed-optimizer"]),
        "--ddp-pad-buckets-for-high-nccl-busbw": (
            "gpt", 2, ["--use-distributed-optimizer", "--ddp-pad-buckets-for-high-nccl-busbw"]),
        "--overlap-param-gather": ("gpt", 2, ["--use-distributed-optimizer",
                                              "--overlap-grad-reduce", "--overlap-param-gather"]),
        "--ddp-bucket-size": ("gpt", 2, ["--overlap-grad-reduce", "--ddp-bucket-size", "1000"]),
        "--ddp-num-buckets": ("gpt", 2, ["--overlap-grad-reduce", "--ddp-num-buckets", "2"]),
        "--no-align-grad-reduce": ("gpt", 2, ["--overlap-grad-reduce", "--no-align-grad-reduce"]),
        "--no-overlap-p2p-communication": (
            "gpt", 2, [*PP2, "--num-layers-per-virtual-pipeline-stage", "1",
                       "--no-overlap-p2p-communication"]),
        # 3 micro-batches of pp=2 x vpp=2 in one group of 3 (the default group, 2, refuses them)
        "--microbatch-group-size-per-virtual-pipeline-stage": (
            "gpt", 2, [*PP2, "--num-virtual-stages-per-pipeline-rank", "2", "--num-layers", "4",
                       "--global-batch-size", "3",
                       "--microbatch-group-size-per-virtual-pipeline-stage", "3"]),
        "--distributed-backend": ("gpt", 1, ["--distributed-backend", "gloo"]),
        "--context-parallel-size": ("gpt", 1, ["--context-parallel-size", "1"]),
        "--empty-unused-memory-level": ("gpt", 1, ["--empty-unused-memory-level", "0"]),
        "--local-rank": ("gpt", 1, ["--local-rank", "0"]),
        # training
        "--global-batch-size": ("gpt", 1, ["--global-batch-size", "4"]),
        "--micro-batch-size": ("gpt", 1, ["--micro-batch-size", "2"]),
        "--train-iters": ("gpt", 1, ["--train-iters", "6"]),
        "--lr": ("gpt", 1, ["--lr", "1e-4"]),
        "--min-lr": ("gpt", 1, ["--min-lr", "1e-5"]),
        "--decoupled-min-lr": ("gpt", 1, ["--decoupled-lr", "1e-3", "--decoupled-min-lr",
                                          "1e-5"]),
        "--grad-reduce-in-bf16": ("gpt", 1, ["--bf16", "--grad-reduce-in-bf16"]),
        "--train-samples": ("gpt", 1, ["--train-samples", "10"], ["--train-iters"]),
        "--lr-decay-samples": ("gpt", 1, ["--train-samples", "10", "--lr-decay-samples", "8"],
                               ["--train-iters"]),
        "--lr-warmup-samples": ("gpt", 1, ["--train-samples", "10", "--lr-warmup-samples", "2"],
                                ["--train-iters"]),
        "--rampup-batch-size": ("gpt", 1, ["--train-samples", "20", "--global-batch-size", "4",
                                           "--rampup-batch-size", "2", "2", "8"],
                                ["--train-iters"]),
        "--lr-decay-iters": ("gpt", 1, ["--lr-decay-iters", "4"]),
        "--lr-warmup-iters": ("gpt", 1, ["--lr-warmup-iters", "1"]),
        "--lr-warmup-fraction": ("gpt", 1, ["--lr-warmup-fraction", "0.1"]),
        "--optimizer": ("gpt", 1, ["--optimizer", "sgd"]),
        "--sgd-momentum": ("gpt", 1, ["--optimizer", "sgd", "--sgd-momentum", "0.8"]),
        "--adam-beta1": ("gpt", 1, ["--adam-beta1", "0.9"]),
        "--adam-beta2": ("gpt", 1, ["--adam-beta2", "0.95"]),
        "--adam-eps": ("gpt", 1, ["--adam-eps", "1e-8"]),
        "--loss-scale": ("gpt", 1, ["--bf16", "--loss-scale", "1024"]),
        "--initial-loss-scale": ("gpt", 1, ["--fp16", "--initial-loss-scale", "1024"]),
        "--min-loss-scale": ("gpt", 1, ["--fp16", "--min-loss-scale", "1"]),
        "--loss-scale-window": ("gpt", 1, ["--fp16", "--loss-scale-window", "100"]),
        "--hysteresis": ("gpt", 1, ["--fp16", "--hysteresis", "2"]),
        "--manual-gc-interval": ("gpt", 1, ["--manual-gc", "--manual-gc-interval", "2"]),
        "--seed": ("gpt", 1, ["--seed", "7"]),
        "--weight-decay": ("gpt", 1, ["--weight-decay", "0.1"]),
        "--clip-grad": ("gpt", 1, ["--clip-grad", "0.5"]),
        "--exit-interval": ("gpt", 1, ["--exit-interval", "2"]),
        "--exit-duration-in-mins": ("gpt", 1, ["--exit-duration-in-mins", "5"]),
        "--lr-decay-style": ("gpt", 1, ["--lr-decay-style", "cosine"]),
        # checkpointing
        "--save": ("gpt", 1, ["--save", "{tmp}/save"]),
        "--save-interval": ("gpt", 1, ["--save", "{tmp}/save", "--save-interval", "2"]),
        "--load": ("gpt", 1, ["--save", "{tmp}/save", "--load", "{tmp}/save"]),
        "--no-load-optim": ("gpt", 1, ["--save", "{tmp}/save", "--load", "{tmp}/save",
                                       "--no-load-optim"]),
        "--no-load-rng": ("gpt", 1, ["--save", "{tmp}/save", "--load", "{tmp}/save",
                                     "--no-load-rng"]),
        "--finetune": ("gpt", 1, ["--save", "{tmp}/save", "--load", "{tmp}/save", "--finetune"]),
        "--exit-on-missing-checkpoint": ("gpt", 1, ["--load", "{checkpoint}",
                                                    "--exit-on-missing-checkpoint"]),
        "--ckpt-format": ("gpt", 1, ["--ckpt-format", "torch"]),
        # logging
        "--tensorboard-dir": None,  # needs the tensorboard package: its own tests
        "--tensorboard-log-interval": None,
        "--tensorboard-queue-size": None,
        "--log-world-size-to-tensorboard": None,
        "--log-validation-ppl-to-tensorboard": None,
        "--log-timers-to-tensorboard": None,
        "--log-memory-to-tensorboard": None,  # CUDA only
        "--no-log-loss-scale-to-tensorboard": None,
        "--disable-log-loss-scale-to-tensorboard": None,
        "--wandb-project": None,  # needs the wandb package: its own tests
        "--wandb-exp-name": None,
        "--wandb-save-dir": None,
        "--wandb-entity": None,
        "--log-interval": ("gpt", 1, ["--log-interval", "1"]),
        "--eval-interval": ("gpt", 1, ["--eval-interval", "2"]),
        "--eval-iters": ("gpt", 1, ["--eval-iters", "1"]),
        "--timing-log-level": ("gpt", 1, ["--timing-log-level", "1"]),
        "--timing-log-option": ("gpt", 1, ["--timing-log-option", "all"]),
        "--no-barrier-with-level-1-timing": ("gpt", 1, ["--timing-log-level", "1",
                                                        "--no-barrier-with-level-1-timing"]),
        # profiling
        "--profile": ("gpt", 1, PROFILE),
        "--use-pytorch-profiler": ("gpt", 1, PROFILE),
        "--profile-step-start": ("gpt", 1, PROFILE),
        "--profile-step-end": ("gpt", 1, PROFILE),
        "--profile-ranks": ("gpt", 1, [*PROFILE, "--profile-ranks", "0"]),
        # data
        "--data-path": ("gpt", 1, ["--data-path", sample_data]),
        "--split": ("gpt", 1, ["--split", "90,10,0"]),
        "--mock-data": ("gpt", 1, ["--mock-data"], ["--data-path", "--split"]),
        "--train-data-path": ("gpt", 1, ["--train-data-path", sample_data], ["--data-path",
                                                                             "--split"]),
        "--valid-data-path": ("gpt", 1, ["--train-data-path", sample_data, "--valid-data-path",
                                         sample_data], ["--data-path", "--split"]),
        "--test-data-path": ("gpt", 1, ["--train-data-path", sample_data, "--test-data-path",
                                        sample_data], ["--data-path", "--split"]),
        "--data-args-path": ("gpt", 1, ["--data-args-path", "{data_args_file}"], ["--data-path"]),
        "--per-split-data-args-path": ("gpt", 1, ["--per-split-data-args-path",
                                                  "{per_split_file}"], ["--data-path", "--split"]),
        "--data-cache-path": ("gpt", 1, ["--data-cache-path", "{tmp}/cache"]),
        "--tokenizer-type": ("gpt", 1, ["--tokenizer-type", "GPT2BPETokenizer"]),
        "--vocab-file": ("gpt", 1, ["--vocab-file", _sample("vocab.json")]),
        "--merge-file": ("gpt", 1, ["--merge-file", _sample("merges.txt")]),
        "--tokenizer-model": None,  # a SentencePiece or Hugging Face tokenizer: their own tests
        # TikTokenizer's, with its vocabulary: tests/test_tiktoken_and_sentencepiece_tokenizers.py
        "--tiktoken-pattern": None,
        "--tiktoken-num-special-tokens": None,
        "--tiktoken-special-tokens": None,
        "--tokenizer-special-tokens": None,
        "--vocab-size": ("gpt", 1, ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128"],
                         ["--vocab-file", "--merge-file"]),
        "--dataloader-type": ("gpt", 1, ["--dataloader-type", "single"]),
        "--num-workers": ("gpt", 1, ["--num-workers", "1"]),
        "--num-dataset-builder-threads": ("gpt", 1, ["--num-dataset-builder-threads", "2"]),
    }


@pytest.fixture(scope="module")
def parsers():
    """One parser per model, built once (each flag's command line only runs validate_args)."""
    from megatron_dpp.arguments import build_parser

    return {model: build_parser(prog=f"megatron_dpp.pretrain_{model}", model=model)
            for model in ("gpt", "bert", "llama")}


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """The paths the command lines name: a temporary directory, a checkpoint to load, data files."""
    tmp = tmp_path_factory.mktemp("flags")
    checkpoint = tmp / "checkpoint"
    (checkpoint / "iter_0000001").mkdir(parents=True)
    (checkpoint / "latest_checkpointed_iteration.txt").write_text("1")
    sample_data = _sample("sample_text_document")
    (tmp / "data_args.txt").write_text(sample_data)
    (tmp / "per_split.json").write_text('{"train": "%s"}' % sample_data)
    return {"tmp": str(tmp), "checkpoint": str(checkpoint),
            "data_args_file": str(tmp / "data_args.txt"),
            "per_split_file": str(tmp / "per_split.json")}


def _base(model: str) -> list[str]:
    if model == "bert":
        return ["--data-path", _sample("sample_bert_text_sentence"), "--vocab-file",
                _sample("bert-vocab.txt"), "--split", "98,2,0", *TINY]
    return [*data_args(), *TINY]


def _without(argv: list[str], flags: list[str]) -> list[str]:
    """argv without each of `flags` and its value."""
    kept, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item in flags:
            skip = True
        else:
            kept.append(item)
    return kept


def _validate(parsers, monkeypatch, capsys, model: str, world_size: int, argv: list[str]):
    """None when the command line validates; else the one error line (argparse's or ArgsError's)."""
    from megatron_dpp.arguments import validate_args
    from megatron_dpp.flag_errors import ArgsError

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    try:
        args = parsers[model].parse_args(argv)
    except SystemExit:
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1, lines
        return lines[0]
    try:
        validate_args(args)
    except ArgsError as error:
        message = str(error)
        assert "\n" not in message, message
        return message
    return None


def _command_line(flag: str, needs: dict, places: dict):
    """(model, world size, argv) of a working or accepted flag."""
    if flag in needs:
        model, world_size, extra, *drop = needs[flag]
        base = _without(_base(model), drop[0] if drop else [])
        return model, world_size, [*base, *[word.format(**places) for word in extra]]
    return "gpt", 1, [*_base("gpt"), flag, *MEGATRON_LM_FLAGS[flag]]


def _classes():
    from megatron_dpp.arguments import REFUSED_FLAGS, STATED_FLAGS

    refused = [flag for flag in MEGATRON_LM_FLAGS if flag in REFUSED_FLAGS]
    accepted = [flag for flag in MEGATRON_LM_FLAGS
                if flag in STATED_FLAGS or flag in ACCEPTED_FLAGS]
    elsewhere = [flag for flag in MEGATRON_LM_FLAGS if flag in ELSEWHERE]
    works = [flag for flag in MEGATRON_LM_FLAGS
             if flag not in {*refused, *accepted, *elsewhere}]
    return works, accepted, refused, elsewhere


def test_the_list_is_megatron_lm_s_whole_parser():
    """The list as tools/megatron_lm_flags.py writes it: every option string, the generated
    --no-... forms and the aliases included."""
    assert len(MEGATRON_LM_FLAGS) == 682
    for flag in ("--moe-router-topk", "--no-rl-skip-bos-token", "--disable-msc",
                 "--no-ckpt-fully-parallel-save", "--disable-ckpt-fully-parallel-save",
                 "--kitchen-config-file", "--use-mcore-models", "--deterministic-mode"):
        assert flag in MEGATRON_LM_FLAGS, flag
    assert MEGATRON_LM_FLAGS["--dist-ckpt-strictness"] == ["assume_ok_unexpected"]


def test_each_flag_has_one_class():
    from megatron_dpp.arguments import REFUSED_FLAGS, STATED_FLAGS

    assert not set(REFUSED_FLAGS) & (set(STATED_FLAGS) | set(ACCEPTED_FLAGS))
    assert ELSEWHERE <= set(MEGATRON_LM_FLAGS), sorted(ELSEWHERE - set(MEGATRON_LM_FLAGS))
    works, accepted, refused, elsewhere = _classes()
    assert len(works) + len(accepted) + len(refused) + len(elsewhere) == len(MEGATRON_LM_FLAGS)
    needs = _needs()
    assert set(needs) <= set(MEGATRON_LM_FLAGS), sorted(set(needs) - set(MEGATRON_LM_FLAGS))


def test_no_flag_is_unrecognized(parsers):
    known = {option for parser in parsers.values() for action in parser._actions
             for option in action.option_strings}
    missing = [flag for flag in MEGATRON_LM_FLAGS if flag not in known]
    assert not missing, f"unrecognized Megatron-LM flags: {missing}"


def test_working_and_accepted_flags_parse(parsers, places, monkeypatch, capsys):
    works, accepted, _refused, _elsewhere = _classes()
    needs = _needs()
    failures = []
    cuda = torch.cuda.is_available()
    for flag in [*works, *accepted]:
        if flag in needs and needs[flag] is None:
            continue  # needs an optional package (tensorboard, wandb) or files: its own tests
        if flag in GPU_ONLY:
            world_size, extra, refusal = GPU_ONLY[flag]
            error = _validate(parsers, monkeypatch, capsys, "gpt", world_size,
                              [*_base("gpt"), *extra])
            if (error is not None) if cuda else (error is None or refusal not in error):
                failures.append(f"{flag}: {error}")
            continue
        model, world_size, argv = _command_line(flag, needs, places)
        assert flag in argv, (flag, argv)
        error = _validate(parsers, monkeypatch, capsys, model, world_size, argv)
        if error is not None:
            failures.append(f"{flag}: {error}")
    assert not failures, "\n".join(failures)


def test_refused_flags_are_one_line_with_their_reason(parsers, monkeypatch, capsys):
    from megatron_dpp.arguments import REFUSED_FLAGS

    _works, _accepted, refused, _elsewhere = _classes()
    assert len(refused) > 400
    wrong = []
    for flag in refused:
        error = _validate(parsers, monkeypatch, capsys, "gpt", 1,
                          [*_base("gpt"), flag, *MEGATRON_LM_FLAGS[flag]])
        reason = REFUSED_FLAGS[flag]
        if error != f"{flag} {reason}; remove it" or len(reason) < 20:
            wrong.append(f"{flag}: {error}")
    assert not wrong, "\n".join(wrong)


def test_flags_handled_elsewhere_are_recognized_or_refused_in_one_line(parsers, places,
                                                                        monkeypatch, capsys):
    _works, _accepted, _refused, elsewhere = _classes()
    for flag in elsewhere:
        for model in ("gpt", "llama"):
            error = _validate(parsers, monkeypatch, capsys, model, 1,
                              [*_base(model), flag, *MEGATRON_LM_FLAGS[flag]])
            assert error is None or "unrecognized arguments" not in error, (flag, model, error)


def test_accepted_flags_help_says_it_always_holds(parsers):
    from megatron_dpp.arguments import STATED_FLAGS

    _works, accepted, _refused, _elsewhere = _classes()
    assert set(STATED_FLAGS) <= set(accepted)
    helps = {option: action.help or "" for parser in parsers.values()
             for action in parser._actions for option in action.option_strings}
    for flag in accepted:
        assert "always so here" in helps[flag], (flag, helps[flag])


@pytest.mark.parametrize("flag, value, expected", [
    ("--dist-ckpt-strictness", "log_all",
     "--dist-ckpt-strictness log_all (logging, returning or ignoring mismatched tensors"),
    ("--dist-ckpt-strictness", "raise_all", "; use --dist-ckpt-strictness assume_ok_unexpected"),
    ("--rerun-mode", "validate_results", "--rerun-mode validate_results (re-running iterations"),
    ("--softmax-type", "off-by-one", "--softmax-type off-by-one (off-by-one or learnable softmax)"),
    ("--data-parallel-sharding-strategy", "optim_grads_params",
     "--data-parallel-sharding-strategy optim_grads_params (FSDP) is not a layout here"),
    ("--data-parallel-sharding-strategy", "optim",
     "; use --data-parallel-sharding-strategy no_shard or remove it"),
])
def test_an_accepted_flags_other_values_are_refused_in_one_line(parsers, monkeypatch, capsys,
                                                                 flag, value, expected):
    error = _validate(parsers, monkeypatch, capsys, "gpt", 1, [*_base("gpt"), flag, value])
    assert error is not None and expected in error, error


def test_accepted_values_parse(parsers, monkeypatch, capsys):
    from megatron_dpp.arguments import STATED_FLAGS

    for flag, spec in STATED_FLAGS.items():
        for value in spec.values:
            assert _validate(parsers, monkeypatch, capsys, "gpt", 1,
                             [*_base("gpt"), flag, value]) is None, (flag, value)


def test_exit_on_missing_checkpoint_refuses_an_empty_save_directory(parsers, places, monkeypatch,
                                                                    capsys):
    """Without the flag, --load and --save naming one empty directory start from scratch."""
    empty = f"{places['tmp']}/empty"
    argv = [*_base("gpt"), "--save", empty, "--load", empty]
    assert _validate(parsers, monkeypatch, capsys, "gpt", 1, argv) is None
    error = _validate(parsers, monkeypatch, capsys, "gpt", 1,
                      [*argv, "--exit-on-missing-checkpoint"])
    assert error is not None and error.startswith(f"--load {empty}"), error
    error = _validate(parsers, monkeypatch, capsys, "gpt", 1,
                      [*_base("gpt"), "--exit-on-missing-checkpoint"])
    assert error == "--exit-on-missing-checkpoint needs --load DIR"


def test_local_rank_must_be_the_launchers(parsers, monkeypatch, capsys):
    error = _validate(parsers, monkeypatch, capsys, "gpt", 1,
                      [*_base("gpt"), "--local-rank", "1"])
    assert error is not None and error.startswith("--local-rank 1 is not this rank's LOCAL_RANK 0")


def test_pad_buckets_reaches_the_ddp_config(parsers, monkeypatch, capsys):
    from megatron_dpp.arguments import validate_args
    from megatron_dpp.training.config import ddp_config_from_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    args = parsers["gpt"].parse_args([*_base("gpt"), "--use-distributed-optimizer",
                                      "--ddp-pad-buckets-for-high-nccl-busbw"])
    validate_args(args)
    assert ddp_config_from_args(args).pad_buckets_for_high_nccl_busbw is True
    error = _validate(parsers, monkeypatch, capsys, "gpt", 2,
                      [*_base("gpt"), "--ddp-pad-buckets-for-high-nccl-busbw"])
    assert error is not None and "add --use-distributed-optimizer" in error, error


def test_megatron_lm_aliases_set_the_same_setting(parsers):
    parser = parsers["gpt"]
    base = _base("gpt")
    for alias, original in (("--disable-clone-scatter-output-in-embedding",
                             "--no-clone-scatter-output-in-embedding"),
                            ("--no-align-grad-reduce", "--no-delay-grad-reduce"),
                            ("--disable-manual-gc-eval", "--no-manual-gc-eval"),
                            ("--disable-log-loss-scale-to-tensorboard",
                             "--no-log-loss-scale-to-tensorboard")):
        plain = vars(parser.parse_args(base))
        assert vars(parser.parse_args([*base, alias])) == vars(parser.parse_args([*base, original]))
        assert vars(parser.parse_args([*base, alias])) != plain, alias


def test_removing_a_refusal_makes_its_flag_unrecognized(monkeypatch):
    """What the tests above catch: a flag taken out of its table is unrecognized again."""
    from megatron_dpp.models import flags as model_flags

    table = dict(model_flags.REFUSED_MODEL_FLAGS)
    del table["--moe-router-topk"]
    monkeypatch.setattr(model_flags, "REFUSED_MODEL_FLAGS", table)
    group = argparse.ArgumentParser(add_help=False)
    model_flags.add_model_args(group)
    known = {option for action in group._actions for option in action.option_strings}
    assert "--moe-router-topk" not in known and "--moe-router-score-function" in known
