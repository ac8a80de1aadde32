"""--tokenizer-type Llama2Tokenizer: Llama 2's SentencePiece model (--tokenizer-model), as
Megatron-LM reads it. A small SentencePiece model is trained here on the sample corpus with Llama
2's special ids (unk 0, <s> 1, </s> 2, no padding piece); then the tokenizer against sentencepiece
itself, the flags' one-line errors, tools/preprocess_data.py with it, and a Llama run of the
launcher on the data it wrote."""
from __future__ import annotations

import argparse
import io
import json
import subprocess

import numpy
import pytest
import sentencepiece

from _train_util import (PYTHON, REPO_ROOT, _env, ensure_sample_data,
                         train_llama_through_the_launcher)
from megatron_dpp.data.errors import DataInputError
from megatron_dpp.data.tokenizer import Llama2Tokenizer, build_tokenizer

VOCAB = 1000
TEXT = "Return the sum of two numbers.\nRaises ValueError when either is negative."


def _corpus_texts(limit: int = 3000) -> list[str]:
    with open(ensure_sample_data() / "sample_corpus.jsonl", encoding="utf-8") as corpus:
        return [json.loads(line)["text"] for _, line in zip(range(limit), corpus)]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> str:
    """A SentencePiece BPE model with Llama 2's special ids, trained on the sample corpus."""
    written = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus_texts()), model_writer=written, vocab_size=VOCAB,
        model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, byte_fallback=True,
        max_sentence_length=100000, num_threads=1, minloglevel=2)
    path = tmp_path_factory.mktemp("spm") / "tokenizer.model"
    path.write_bytes(written.getvalue())
    return str(path)


def test_tokens_are_sentencepieces_after_bos_and_eod_is_eos(model_file):
    reference = sentencepiece.SentencePieceProcessor(model_file=model_file)
    args = argparse.Namespace(tokenizer_type="Llama2Tokenizer", tokenizer_model=model_file,
                              make_vocab_size_divisible_by=128, tensor_model_parallel_size=1)
    tokenizer = build_tokenizer(args)
    assert isinstance(tokenizer, Llama2Tokenizer)
    assert tokenizer.vocab_size == VOCAB and args.padded_vocab_size == 1024
    assert (tokenizer.bos, tokenizer.eos, tokenizer.eod, tokenizer.pad) == (1, 2, 2, -1)
    ids = tokenizer.tokenize(TEXT)
    assert ids == [1] + reference.encode(TEXT)  # Megatron-LM's Llama2Tokenizer: BOS, no EOS
    assert tokenizer.tokenize_batch([TEXT, "x"]) == [ids, [1] + reference.encode("x")]
    assert tokenizer.detokenize(ids + [2]) == reference.decode(ids[1:])
    assert tokenizer.vocab["<s>"] == 1 and tokenizer.inv_vocab[2] == "</s>"
    assert len(tokenizer.vocab) == VOCAB
    assert tokenizer.unique_identifiers["tokenizer_path"] == [model_file]


@pytest.mark.parametrize("case", ["missing flag", "missing file", "not a model", "vocab file too",
                                  "model for gpt2 bpe"])
def test_tokenizer_file_mistakes_are_one_line_errors(model_file, tmp_path, case):
    sample = ensure_sample_data()
    files = {"vocab_file": None, "merge_file": None, "tokenizer_model": model_file}
    tokenizer_type, expected = "Llama2Tokenizer", None
    if case == "missing flag":
        files["tokenizer_model"] = None
        expected = "--tokenizer-model is required by Llama2Tokenizer; pass the SentencePiece model"
    elif case == "missing file":
        files["tokenizer_model"] = str(tmp_path / "nope.model")
        expected = f"--tokenizer-model '{tmp_path / 'nope.model'}' does not exist"
    elif case == "not a model":
        (tmp_path / "bad.model").write_text("not protobuf")
        files["tokenizer_model"] = str(tmp_path / "bad.model")
        expected = f"--tokenizer-model '{tmp_path / 'bad.model'}' is not a SentencePiece model"
    elif case == "vocab file too":
        files["vocab_file"] = str(sample / "vocab.json")
        expected = ("--vocab-file is not read by --tokenizer-type Llama2Tokenizer (it reads "
                    "--tokenizer-model): remove it")
    else:
        tokenizer_type = "GPT2BPETokenizer"
        files.update(vocab_file=str(sample / "vocab.json"), merge_file=str(sample / "merges.txt"))
        expected = ("--tokenizer-model is not read by --tokenizer-type GPT2BPETokenizer (it reads "
                    "--vocab-file and --merge-file): remove it")
    with pytest.raises(DataInputError) as raised:
        build_tokenizer(argparse.Namespace(tokenizer_type=tokenizer_type, **files))
    message = str(raised.value)
    assert "\n" not in message and message.startswith(expected), message


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tokenizer_type, missing", [("Llama2Tokenizer", "none.model"),
                                                     ("HuggingFaceTokenizer", "none")])
def test_trainer_flags_name_a_missing_model_before_anything_starts(tmp_path, tokenizer_type,
                                                                    missing):
    """Llama 2's model file, or a Hugging Face tokenizer directory (tests/test_hf_tokenizer.py)."""
    sample = ensure_sample_data()
    result = subprocess.run(
        [PYTHON, "-m", "megatron_dpp.pretrain", "--model", "llama", "--num-layers", "2",
         "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1",
         "--lr", "1e-3", "--data-path", str(sample / "sample_text_document"),
         "--tokenizer-type", tokenizer_type, "--tokenizer-model", str(tmp_path / missing)],
        capture_output=True, text=True, timeout=110, env=_env(), cwd=REPO_ROOT)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert f"--tokenizer-model '{tmp_path / missing}' does not exist" in lines[0]


@pytest.fixture(scope="module")
def llama_data(model_file, tmp_path_factory) -> str:
    """The sample corpus through tools/preprocess_data.py with the SentencePiece model (2
    workers, --append-eod); returns the dataset prefix."""
    directory = tmp_path_factory.mktemp("llama_data")
    corpus = directory / "corpus.jsonl"
    with open(corpus, "w", encoding="utf-8") as out:
        for text in _corpus_texts(limit=1500):
            out.write(json.dumps({"text": text}) + "\n")
    done = subprocess.run(
        [PYTHON, "tools/preprocess_data.py", "--input", str(corpus), "--output-prefix",
         str(directory / "llama"), "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model",
         model_file, "--append-eod", "--workers", "2", "--no-progress"],
        capture_output=True, text=True, timeout=200, env=_env(), cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return str(directory / "llama_text_document")


@pytest.mark.timeout(300)
def test_preprocessed_documents_start_with_bos_and_end_with_eos(model_file, llama_data):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    reference = sentencepiece.SentencePieceProcessor(model_file=model_file)
    dataset = IndexedDataset(llama_data)
    texts = [text for text in _corpus_texts(limit=1500) if text.strip()]
    assert len(dataset) == len(texts)
    for index in (0, 1, len(dataset) // 2, len(dataset) - 1):
        tokens = numpy.asarray(dataset[index]).tolist()
        assert tokens == [1] + reference.encode(texts[index]) + [2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_llama_trains_on_sentencepiece_data_through_the_launcher(model_file, llama_data):
    stdout = train_llama_through_the_launcher(
        f"--data-path {llama_data} --split 98,2,0 --tokenizer-type Llama2Tokenizer "
        f"--tokenizer-model {model_file}")
    # The embedding is sized for the SentencePiece vocabulary (1000, padded to 1024), not GPT-2's.
    assert ("> Llama2Tokenizer vocab (size: 1000) padded with 24 dummy tokens (new size: 1024)"
            in stdout), stdout[-3000:]
