"""Helpers shared by the tests/test_data_*.py files.

`sample_data` is a session fixture: the sample corpus, tokenizer and indexed dataset made once
per pytest process (about 10 s on 2 cores) and shared by every data test that needs real data.
Import it into a test module (`from _data_util import sample_data`) to use it there.
"""
import argparse
import json
import os

import pytest

# Texts that exercise byte-level BPE: unicode, tabs, leading/trailing and repeated whitespace.
ROUND_TRIP_TEXTS = [
    "Return the sum of a and b.",
    "  leading spaces, trailing spaces  ",
    "Line one.\nLine two.\n\n\tIndented line three.",
    "Unicode: naïve café, Ελληνικά, 日本語, emoji 🙂.",
    "Quotes \" and backslashes \\ and braces {} survive JSON.",
    "x" * 300,
    "def f(x):\n    return x ** 2  # square\n",
] * 3


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def data_args(paths, **overrides):
    """A Namespace with the flags the data builders read (what arguments.parse_args produces)."""
    values = dict(
        data_path=[paths["data_prefix"]], split="90,10,0", data_cache_path=None,
        vocab_file=paths["vocab_file"], merge_file=paths["merge_file"],
        tokenizer_type="GPT2BPETokenizer", seed=1234, seq_length=64, micro_batch_size=1,
        global_batch_size=4, train_iters=8, eval_iters=1, eval_interval=4,
        variable_seq_lengths=False, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, num_workers=0, make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=1,
    )
    values.update(overrides)
    return argparse.Namespace(**values)


# Each test module that imports the fixture gets its own FixtureDef, so the session scope alone
# would prepare the data once per module; this cache makes it once per process.
_PREPARED: dict = {}


@pytest.fixture(scope="session")
def sample_data(tmp_path_factory):
    from megatron_dpp.data.prepare_sample import prepare_sample

    if not _PREPARED:
        output_dir = str(tmp_path_factory.mktemp("sample_data"))
        _PREPARED.update(prepare_sample(output_dir, show_progress=False), output_dir=output_dir)
    return dict(_PREPARED)


GPT_OUTPUTS = ("vocab_file", "merge_file", "data_prefix")
BERT_OUTPUTS = ("bert_vocab_file", "bert_data_prefix")


def output_files(paths, names):
    """The files behind sample_paths() entries (a data prefix stands for its .bin and .idx)."""
    files = []
    for name in names:
        files += ([paths[name] + ".bin", paths[name] + ".idx"] if name.endswith("_prefix")
                  else [paths[name]])
    return files


def output_stamps(paths, names=("corpus",) + GPT_OUTPUTS + BERT_OUTPUTS):
    """{path: (size, mtime_ns)} of outputs of prepare_sample (all by default), to show what a rerun
    changed."""
    return {f: (os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in output_files(paths, names)}
