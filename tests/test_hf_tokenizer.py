"""--tokenizer-type HuggingFaceTokenizer: a local Hugging Face tokenizer directory (Llama 3's
tokenizer.json and tokenizer_config.json), read through transformers' AutoTokenizer as
Megatron-LM 0.16 reads it. A small byte-level BPE is trained here on the sample corpus and saved
as Llama 3's files are laid out (its special tokens, a post-processor that puts
<|begin_of_text|> first, PreTrainedTokenizerFast in tokenizer_config.json); then the ids against
the tokenizers library and Megatron-LM's route through transformers, the one-line errors,
tools/preprocess_data.py with it, and a Llama run of the launcher on the data it wrote."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from _train_util import (PYTHON, REPO_ROOT, _env, ensure_sample_data,
                         train_llama_through_the_launcher)
from megatron_dpp.data.errors import DataInputError
from megatron_dpp.data.tokenizer import HuggingFaceTokenizer, build_tokenizer

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SPECIAL = [BOS, EOS, "<|reserved_special_token_0|>"]  # ids 0, 1, 2
VOCAB = 700
TEXT = "Return the sum of two numbers.\nRaises ValueError when either is negative."


def _corpus_texts(limit: int = 2000) -> list[str]:
    with open(ensure_sample_data() / "sample_corpus.jsonl", encoding="utf-8") as corpus:
        return [json.loads(line)["text"] for _, line in zip(range(limit), corpus)]


def _write_config(directory, **config) -> None:
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 131072,
         "clean_up_tokenization_spaces": True, **config}))


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    """Llama 3's kind of tokenizer, small: byte-level BPE, special tokens first, BOS added."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(_corpus_texts(), trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
        special_tokens=[(BOS, tokenizer.token_to_id(BOS))])
    return tokenizer


@pytest.fixture(scope="module")
def directory(bpe, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "llama3-tokenizer"
    path.mkdir()
    bpe.save(str(path / "tokenizer.json"))
    _write_config(path, bos_token=BOS, eos_token=EOS)
    return path


def _build(directory, **flags):
    args = argparse.Namespace(tokenizer_type="HuggingFaceTokenizer",
                              tokenizer_model=str(directory), make_vocab_size_divisible_by=128,
                              tensor_model_parallel_size=1, **flags)
    return build_tokenizer(args), args


def test_ids_are_megatron_lms_without_special_tokens_and_eod_is_eos(bpe, directory):
    from transformers import AutoTokenizer

    tokenizer, args = _build(directory)
    assert isinstance(tokenizer, HuggingFaceTokenizer)
    reference = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    assert tokenizer.vocab_size == len(reference) == VOCAB and args.padded_vocab_size == 768
    assert (tokenizer.bos, tokenizer.eos, tokenizer.eod, tokenizer.pad) == (0, 1, 1, None)
    ids = tokenizer.tokenize(TEXT)
    # Megatron-LM 0.16's HuggingFaceTokenizer, by default: text -> tokens -> ids, no BOS.
    assert ids == reference.convert_tokens_to_ids(reference.tokenize(TEXT))
    assert ids == bpe.encode(TEXT, add_special_tokens=False).ids and ids[0] != 0
    assert tokenizer.tokenize_batch([TEXT, "x"]) == [ids, bpe.encode("x", add_special_tokens=False).ids]
    assert tokenizer.detokenize(ids) == TEXT
    assert tokenizer.vocab[EOS] == 1 and tokenizer.inv_vocab[0] == BOS
    assert tokenizer.unique_identifiers["tokenizer_path"] == [str(directory)]


def test_special_tokens_on_request_put_bos_first(bpe, directory):
    from transformers import AutoTokenizer

    tokenizer = HuggingFaceTokenizer(str(directory), include_special_tokens=True)
    reference = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    ids = tokenizer.tokenize(TEXT)
    assert ids == reference(TEXT).input_ids == bpe.encode(TEXT).ids  # Megatron-LM's with the flag
    assert ids[0] == 0 and ids[1:] == HuggingFaceTokenizer(str(directory)).tokenize(TEXT)
    assert tokenizer.unique_identifiers["include_special_tokens"] is True


@pytest.mark.parametrize("case", ["missing flag", "missing directory", "a file", "empty directory",
                                  "no eos token", "not a tokenizer", "no transformers",
                                  "vocab file too", "special tokens for gpt2 bpe"])
def test_tokenizer_directory_mistakes_are_one_line_errors(directory, tmp_path, monkeypatch, case):
    sample = ensure_sample_data()
    flags = dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(directory),
                 vocab_file=None, merge_file=None)
    expected = None
    if case == "missing flag":
        flags["tokenizer_model"] = None
        expected = ("--tokenizer-model is required by HuggingFaceTokenizer; pass the local "
                    "directory of a Hugging Face tokenizer")
    elif case == "missing directory":
        flags["tokenizer_model"] = str(tmp_path / "nope")
        expected = f"--tokenizer-model '{tmp_path / 'nope'}' does not exist; pass the local"
    elif case == "a file":
        flags["tokenizer_model"] = str(directory / "tokenizer.json")
        expected = (f"--tokenizer-model '{directory / 'tokenizer.json'}' is a file, not a "
                    f"directory")
    elif case == "empty directory":
        flags["tokenizer_model"] = str(tmp_path)
        expected = (f"--tokenizer-model '{tmp_path}' holds neither tokenizer.json nor "
                    f"tokenizer_config.json")
    elif case == "no eos token":
        (tmp_path / "tokenizer.json").write_text((directory / "tokenizer.json").read_text())
        _write_config(tmp_path, bos_token=BOS)
        flags["tokenizer_model"] = str(tmp_path)
        expected = f"--tokenizer-model '{tmp_path}' names no eos_token"
    elif case == "not a tokenizer":
        (tmp_path / "tokenizer.json").write_text("{}")
        _write_config(tmp_path, bos_token=BOS, eos_token=EOS)
        flags["tokenizer_model"] = str(tmp_path)
        expected = f"--tokenizer-model '{tmp_path}' is not a Hugging Face tokenizer directory"
    elif case == "no transformers":
        monkeypatch.setitem(sys.modules, "transformers", None)  # import fails
        expected = ("--tokenizer-type HuggingFaceTokenizer needs the transformers package: pip "
                    "install 'transformers>=4.40,<6'")
    elif case == "vocab file too":
        flags["vocab_file"] = str(sample / "vocab.json")
        expected = ("--vocab-file is not read by --tokenizer-type HuggingFaceTokenizer (it reads "
                    "--tokenizer-model): remove it")
    else:
        flags.update(tokenizer_type="GPT2BPETokenizer", tokenizer_model=None,
                     vocab_file=str(sample / "vocab.json"), merge_file=str(sample / "merges.txt"))
        with pytest.raises(DataInputError) as raised:
            from megatron_dpp.data.tokenizer import tokenizer_from_files

            tokenizer_from_files("GPT2BPETokenizer", flags["vocab_file"], flags["merge_file"],
                                 include_special_tokens=True)
        assert str(raised.value) == ("--tokenizer-hf-include-special-tokens is read by "
                                     "--tokenizer-type HuggingFaceTokenizer only, not "
                                     "GPT2BPETokenizer: remove it")
        return
    with pytest.raises(DataInputError) as raised:
        build_tokenizer(argparse.Namespace(**flags))
    message = str(raised.value)
    assert "\n" not in message and message.startswith(expected), message


def _preprocess(directory, output_dir, texts, *extra) -> str:
    corpus = output_dir / "corpus.jsonl"
    with open(corpus, "w", encoding="utf-8") as out:
        for text in texts:
            out.write(json.dumps({"text": text}) + "\n")
    done = subprocess.run(
        [PYTHON, "tools/preprocess_data.py", "--input", str(corpus), "--output-prefix",
         str(output_dir / "llama3"), "--tokenizer-type", "HuggingFaceTokenizer",
         "--tokenizer-model", str(directory), "--append-eod", "--no-progress", *extra],
        capture_output=True, text=True, timeout=200, env=_env(), cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return str(output_dir / "llama3_text_document")


@pytest.fixture(scope="module")
def llama3_data(directory, tmp_path_factory) -> str:
    """The sample corpus through tools/preprocess_data.py with the tokenizer directory (2 workers,
    --append-eod); returns the dataset prefix."""
    return _preprocess(directory, tmp_path_factory.mktemp("llama3_data"),
                       _corpus_texts(limit=1500), "--workers", "2")


@pytest.mark.timeout(300)
def test_preprocessed_documents_end_with_eos_and_start_with_bos_on_request(bpe, directory,
                                                                           llama3_data, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    texts = [text for text in _corpus_texts(limit=1500) if text.strip()]
    dataset = IndexedDataset(llama3_data)
    assert len(dataset) == len(texts)
    for index in (0, 1, len(dataset) // 2, len(dataset) - 1):
        tokens = numpy.asarray(dataset[index]).tolist()
        assert tokens == bpe.encode(texts[index], add_special_tokens=False).ids + [1]
    with_bos = IndexedDataset(_preprocess(directory, tmp_path, texts[:20],
                                          "--tokenizer-hf-include-special-tokens"))
    for index in (0, 19):
        assert numpy.asarray(with_bos[index]).tolist() == bpe.encode(texts[index]).ids + [1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_llama_trains_on_hugging_face_tokenized_data_through_the_launcher(directory, llama3_data):
    stdout = train_llama_through_the_launcher(
        f"--data-path {llama3_data} --split 98,2,0 --tokenizer-type HuggingFaceTokenizer "
        f"--tokenizer-model {directory}")
    # The embedding is sized for the tokenizer's vocabulary (700, padded to 768), not GPT-2's.
    assert ("> HuggingFaceTokenizer vocab (size: 700) padded with 68 dummy tokens (new size: 768)"
            in stdout), stdout[-3000:]
