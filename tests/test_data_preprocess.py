"""preprocess_data: JSONL -> indexed dataset round trip, and one-line errors with exit code 2."""
import os
import subprocess
import sys

import pytest

from _data_util import ROUND_TRIP_TEXTS, write_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory):
    """A byte-level BPE trained on the round-trip texts (tiny vocab: fast, still multi-byte)."""
    from megatron_dpp.data.tokenizer import train_bpe_tokenizer

    directory = tmp_path_factory.mktemp("tokenizer")
    train_bpe_tokenizer(ROUND_TRIP_TEXTS, str(directory), vocab_size=400)
    return str(directory / "vocab.json"), str(directory / "merges.txt")


def _read_documents(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))]


@pytest.mark.timeout(120)
def test_cli_round_trips_jsonl(tmp_path, small_tokenizer):
    """tools/preprocess_data.py with 2 workers: decode(ids) == text for every document, in order."""
    from megatron_dpp.data.tokenizer import GPT2BPETokenizer

    vocab, merges = small_tokenizer
    corpus = tmp_path / "corpus.jsonl"
    write_jsonl(corpus, [{"text": t, "id": i} for i, t in enumerate(ROUND_TRIP_TEXTS)])
    cmd = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"),
           "--input", str(corpus), "--output-prefix", str(tmp_path / "rt"),
           "--vocab-file", vocab, "--merge-file", merges, "--tokenizer-type", "GPT2BPETokenizer",
           "--append-eod", "--workers", "2"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=100,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert "tokenizing" in result.stderr  # the progress bar

    tokenizer = GPT2BPETokenizer(vocab, merges)
    documents = _read_documents(str(tmp_path / "rt_text_document"))
    assert len(documents) == len(ROUND_TRIP_TEXTS)
    for ids, text in zip(documents, ROUND_TRIP_TEXTS):
        assert ids[-1] == tokenizer.eod and tokenizer.eod not in ids[:-1]
        assert tokenizer.detokenize(ids[:-1]) == text
    assert not [n for n in os.listdir(tmp_path) if ".tmp" in n]  # temporaries renamed away


@pytest.mark.timeout(60)
def test_in_process_matches_workers_and_keys(tmp_path, small_tokenizer):
    """Without --append-eod each document is exactly its text's ids; several --json-keys work."""
    from megatron_dpp.data.preprocess_data import preprocess_jsonl
    from megatron_dpp.data.tokenizer import GPT2BPETokenizer

    vocab, merges = small_tokenizer
    corpus = tmp_path / "corpus.jsonl"
    records = [{"text": t, "title": t[:5] or "x"} for t in ROUND_TRIP_TEXTS]
    write_jsonl(corpus, records)
    stats = preprocess_jsonl(str(corpus), str(tmp_path / "kv"), vocab, merges,
                             json_keys=["text", "title"], workers=1, show_progress=False)
    tokenizer = GPT2BPETokenizer(vocab, merges)
    for key in ("text", "title"):
        documents = _read_documents(stats[key]["prefix"])
        assert [tokenizer.detokenize(ids) for ids in documents] == [r[key] for r in records]


def _run_main(capsys, argv):
    from megatron_dpp.data.preprocess_data import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err.strip()
    return exit_info.value.code, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["missing_input", "bad_json", "bad_json_2_workers",
                                  "missing_key", "not_string", "missing_vocab"])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, small_tokenizer, case):
    vocab, merges = small_tokenizer
    corpus = tmp_path / "corpus.jsonl"
    lines = ['{"text": "fine"}', '{"text": "also fine"}']
    expected = None
    workers = "2" if case == "bad_json_2_workers" else "1"
    if case.startswith("bad_json"):
        lines = lines * 300 if workers == "2" else lines  # the error comes after pool batches
        lines.append('{"text": "broken')
        expected = f"{corpus}:{len(lines)}: not valid JSON"
    elif case == "missing_key":
        lines.append('{"body": "no text key"}')
        expected = f"{corpus}:3: missing key 'text'"
    elif case == "not_string":
        lines.append('{"text": 17}')
        expected = f"{corpus}:3: key 'text' holds a int"
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    input_path = str(tmp_path / "absent.jsonl") if case == "missing_input" else str(corpus)
    if case == "missing_input":
        expected = "--input"
    if case == "missing_vocab":
        vocab = str(tmp_path / "absent_vocab.json")
        expected = "--vocab-file"

    code, err = _run_main(capsys, ["--input", input_path, "--output-prefix", str(tmp_path / "o"),
                                   "--vocab-file", vocab, "--merge-file", merges,
                                   "--workers", workers, "--no-progress"])
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: ") and expected in err, err
    assert not [n for n in os.listdir(tmp_path) if n.startswith("o_")]  # no partial output
