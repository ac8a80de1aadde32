"""The one entry point, `python -m megatron_dpp.pretrain --model NAME`: the model comes from
--model and brings its own flags; a missing or unknown model is one line, exit 2."""
from __future__ import annotations

import os
import subprocess

import pytest

from _train_util import PYTHON, REPO_ROOT, data_args

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--train-iters", "2", "--lr", "1e-3"]


def _pretrain(*argv, timeout=60):
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="1", RANK="0", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([PYTHON, "-m", "megatron_dpp.pretrain", *argv], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _bert_data_args() -> list[str]:
    sample = data_args()[1].rsplit("/", 1)[0]
    return ["--data-path", f"{sample}/sample_bert_text_sentence",
            "--vocab-file", f"{sample}/bert-vocab.txt"]


def test_parse_args_reads_the_model_from_the_command_line():
    from megatron_dpp.arguments import parse_args
    from megatron_dpp.models.families import MODEL_FAMILIES

    args = parse_args(["--model", "bert", *_bert_data_args(), *TINY], model=None)
    assert (args.model, args.tokenizer_type, args.bert_binary_head) == (
        "bert", MODEL_FAMILIES["bert"].tokenizer_types[0], True)
    args = parse_args(["--model=gpt", *data_args(), *TINY], model=None)
    assert (args.model, args.tokenizer_type) == ("gpt", MODEL_FAMILIES["gpt"].tokenizer_types[0])


@pytest.mark.timeout(90)
def test_help_with_a_model_lists_its_own_flags():
    bert = _pretrain("--model", "bert", "--help")
    assert bert.returncode == 0, bert.stderr
    assert "--bert-no-binary-head" in bert.stdout and "--model" in bert.stdout
    plain = _pretrain("--help")
    assert plain.returncode == 0, plain.stderr
    assert "--model" in plain.stdout and "--bert-no-binary-head" not in plain.stdout


@pytest.mark.timeout(90)
@pytest.mark.parametrize("argv, expected", [
    ([], "the following arguments are required: --model"),
    (["--model", "t5"], "argument --model: invalid choice: 't5'"),
    (["--model", "gpt", "--bert-no-binary-head"], "unrecognized arguments: --bert-no-binary-head"),
], ids=["missing", "unknown", "another_model_s_flag"])
def test_a_bad_model_is_one_line_exit_2(argv, expected):
    result = _pretrain(*argv, *data_args(), *TINY)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("megatron_dpp.pretrain: error: "), lines
    assert expected in lines[0], lines[0]
