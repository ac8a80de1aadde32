"""prepare_sample makes a usable corpus/tokenizer/dataset and a rerun changes nothing."""
import os
import subprocess
import sys
import time

import pytest

from _data_util import (BERT_OUTPUTS, GPT_OUTPUTS, ROUND_TRIP_TEXTS,  # noqa: F401 (fixture)
                        output_files, output_stamps, sample_data)


@pytest.mark.timeout(120)
def test_sample_outputs_are_usable(sample_data):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_dpp.data.tokenizer import EOD_TOKEN, GPT2BPETokenizer

    tokenizer = GPT2BPETokenizer(sample_data["vocab_file"], sample_data["merge_file"])
    assert tokenizer.vocab_size == 4096
    assert tokenizer.inv_vocab[tokenizer.eod] == EOD_TOKEN
    dataset = IndexedDataset(sample_data["data_prefix"])
    assert len(dataset) > 1000  # thousands of stdlib docstrings
    with open(sample_data["corpus"], encoding="utf-8") as f:
        import json
        first_text = json.loads(f.readline())["text"]
    first = dataset[0].tolist()
    assert first[-1] == tokenizer.eod  # prepare_sample appends end-of-document
    assert tokenizer.detokenize(first[:-1]) == first_text


@pytest.mark.timeout(120)
def test_rerun_is_a_fast_no_op(sample_data):
    """Second run through the real CLI: every output untouched, done in seconds."""
    before = output_stamps(sample_data)
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "megatron_dpp.data.prepare_sample",
         "--output-dir", sample_data["output_dir"]],
        capture_output=True, text=True, timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 30  # no corpus, tokenizer or dataset work (import only)
    assert output_stamps(sample_data) == before
    assert "exists" in result.stdout and f"--data-path {sample_data['data_prefix']}" in result.stdout


@pytest.mark.timeout(60)
def test_tokenizer_training_is_deterministic(tmp_path):
    from megatron_dpp.data.tokenizer import train_bpe_tokenizer

    outputs = []
    for name in ("a", "b"):
        directory = tmp_path / name
        directory.mkdir()
        train_bpe_tokenizer(ROUND_TRIP_TEXTS * 5, str(directory), vocab_size=500)
        outputs.append(((directory / "vocab.json").read_bytes(),
                        (directory / "merges.txt").read_bytes()))
    assert outputs[0] == outputs[1]


@pytest.mark.timeout(60)
def test_missing_tokenizer_output_is_rebuilt_downstream(sample_data, tmp_path):
    """Delete the merges file: the tokenizer and the dataset are remade, the corpus and the BERT
    outputs (which do not read the BPE tokenizer) are kept."""
    from megatron_dpp.data.prepare_sample import prepare_sample, sample_paths

    directory = str(tmp_path / "copy")
    os.makedirs(directory)
    paths = sample_paths(directory)
    with open(sample_data["corpus"], encoding="utf-8") as f:  # a small corpus keeps this fast
        head = [next(f) for _ in range(300)]
    with open(paths["corpus"], "w", encoding="utf-8") as f:
        f.writelines(head)
    prepare_sample(directory, vocab_size=600, show_progress=False)
    first = output_stamps(paths)
    with open(paths["data_prefix"] + ".bin", "rb") as f:
        first_bin = f.read()
    os.remove(paths["merge_file"])
    prepare_sample(directory, vocab_size=600, show_progress=False)
    second = output_stamps(paths)
    kept = output_files(paths, ("corpus",) + BERT_OUTPUTS)
    assert all(first[f] == second[f] for f in kept)  # corpus and BERT outputs untouched
    remade = output_files(paths, GPT_OUTPUTS)
    assert all(first[f][1] != second[f][1] for f in remade)  # the GPT outputs remade
    with open(paths["data_prefix"] + ".bin", "rb") as f:
        assert f.read() == first_bin  # and deterministically identical
