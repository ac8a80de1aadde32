"""--padded-vocab-size, as Megatron-LM's: a given value is the embedding's and the output layer's
rows as it is (Qwen2.5's 151936); without it, the vocabulary padded by
--make-vocab-size-divisible-by x TP. A value smaller than the vocabulary, or not split evenly among
the tensor-parallel ranks, is one line."""
import argparse

import pytest

from _train_util import TINY_GPT_ARGS, data_args
from megatron_dpp.data.errors import DataInputError
from megatron_dpp.data.tokenizer import build_tokenizer


def _null(**flags):
    """NullTokenizer over ids 0..999: a vocabulary of 1001 (the end-of-document token is 1000)."""
    return argparse.Namespace(**{"tokenizer_type": "NullTokenizer", "vocab_size": 1000,
                                 "vocab_file": None, "merge_file": None, "tokenizer_model": None,
                                 "make_vocab_size_divisible_by": 128,
                                 "tensor_model_parallel_size": 1, **flags})


def test_a_given_size_is_used_as_it_is():
    args = _null(padded_vocab_size=1001)
    assert build_tokenizer(args).vocab_size == 1001 and args.padded_vocab_size == 1001
    args = _null(padded_vocab_size=4000, tensor_model_parallel_size=4)
    build_tokenizer(args)
    assert args.padded_vocab_size == 4000
    args = _null(padded_vocab_size=None)  # not given: Megatron-LM's padding, 1001 -> 1024
    build_tokenizer(args)
    assert args.padded_vocab_size == 1024


@pytest.mark.parametrize("size, tp, expected", [
    (1000, 1, "--padded-vocab-size 1000 is smaller than the tokenizer's vocabulary (1001 tokens): "
              "give at least 1001, or remove it to pad by --make-vocab-size-divisible-by"),
    (1002, 4, "--padded-vocab-size 1002 must be a positive multiple of "
              "--tensor-model-parallel-size 4"),
])
def test_a_size_that_cannot_hold_the_vocabulary_is_one_line(size, tp, expected):
    with pytest.raises(DataInputError) as raised:
        build_tokenizer(_null(padded_vocab_size=size, tensor_model_parallel_size=tp))
    assert str(raised.value) == expected


def test_the_flag_check_refuses_an_uneven_split_before_launch(monkeypatch, capsys):
    from megatron_dpp.arguments import parse_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_:
        parse_args([*data_args(), *TINY_GPT_ARGS, "--tensor-model-parallel-size", "2",
                    "--padded-vocab-size", "50001"], prog="megatron_dpp.pretrain_gpt")
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("megatron_dpp.pretrain_gpt: error: --padded-vocab-size 50001 must be a "
                          "positive multiple of --tensor-model-parallel-size 2"), err
