"""BERT data: WordPiece vocabulary and tokenizers, sentence splitting, sentence-level indexed
datasets, Megatron's BERT datasets (masking, binary head, seeds), batches and one-line errors."""
import argparse
import json
import os
import random
import subprocess
import sys

import numpy
import pytest
import torch

from _data_util import output_files, output_stamps, sample_data, write_jsonl  # noqa: F401

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE_KEYS = {"text", "types", "labels", "is_random", "padding_mask", "loss_mask", "truncated"}

# Sentences of the tiny corpus: plain words (so a small vocabulary has whole words and "##"
# pieces), accents (the cased/lower-case difference) and punctuation.
SENTENCES = [
    "The parser reads the next token from the stream.",
    "It returns a list of values, one for each field.",
    "Each value keeps its original spelling.",
    "When the stream ends, the parser raises an error.",
    "Tokens are grouped into words before they are counted.",
    "The Café on Main Street serves coffee until noon.",
    "Naïve readers often skip the footnotes!",
    "Why does the counter start at zero?",
    "Dr. Smith wrote the first version in 1999.",
    "Later versions added support for streaming input.",
    "Every document holds several sentences.",
    "The writer flushes its buffer after every record.",
]


def _document(rng: random.Random, sentences: int) -> str:
    return " ".join(rng.choice(SENTENCES) for _ in range(sentences))


def tiny_documents(count: int = 40, seed: int = 0):
    """Documents of 2 to 6 sentences, deterministic."""
    rng = random.Random(seed)
    return [_document(rng, rng.randint(2, 6)) for _ in range(count)]


TINY_VOCAB_SIZE = 200  # below what the tiny corpus can fill, so the trainer picks among merges


def _train_vocab(texts, directory, lower_case=True, vocab_size=TINY_VOCAB_SIZE):
    from megatron_dpp.data.tokenizer import train_wordpiece_vocab

    path = os.path.join(directory, f"vocab-{'lower' if lower_case else 'cased'}.txt")
    train_wordpiece_vocab(texts, path, vocab_size, lower_case=lower_case)
    return path


def _preprocess(documents, directory, vocab_file, name="tiny"):
    """Sentence-split, lower-case WordPiece dataset of `documents`; returns its prefix."""
    from megatron_dpp.data.preprocess_data import preprocess_jsonl

    corpus = os.path.join(directory, f"{name}.jsonl")
    write_jsonl(corpus, [{"text": text} for text in documents])
    stats = preprocess_jsonl(corpus, os.path.join(directory, name), vocab_file, None,
                             workers=1, show_progress=False,
                             tokenizer_type="BertWordPieceLowerCase", split_sentences=True)
    return stats["text"]["prefix"]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A lower-case WordPiece vocabulary and a sentence-split dataset of tiny_documents()."""
    directory = str(tmp_path_factory.mktemp("tiny_bert"))
    documents = tiny_documents()
    vocab_file = _train_vocab(documents, directory)
    return {"directory": directory, "documents": documents, "vocab_file": vocab_file,
            "data_prefix": _preprocess(documents, directory, vocab_file)}


def bert_args(tiny, tmp_path, **overrides):
    """The flags build_tokenizer and build_bert_datasets read (what parse_args produces)."""
    values = dict(
        data_path=[tiny["data_prefix"]], split="80,20,0", data_cache_path=str(tmp_path / "cache"),
        vocab_file=tiny["vocab_file"], merge_file=None, tokenizer_type="BertWordPieceLowerCase",
        seed=1234, seq_length=48, micro_batch_size=2, global_batch_size=4, train_iters=8,
        eval_iters=1, eval_interval=4, mask_prob=0.15, short_seq_prob=0.1, bert_binary_head=True,
        make_vocab_size_divisible_by=128, tensor_model_parallel_size=1, num_workers=0,
    )
    values.update(overrides)
    return argparse.Namespace(**values)


def _build(args):
    from megatron_dpp.data import build_bert_datasets, build_tokenizer

    tokenizer = build_tokenizer(args)
    return tokenizer, build_bert_datasets(args, tokenizer)


def _samples(dataset):
    return [dataset[i] for i in range(len(dataset))]


# ------------------------------------------------------------------------------------------------
# WordPiece vocabulary and tokenizers
# ------------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("lower_case", [True, False])
def test_vocab_is_deterministic_and_starts_with_special_tokens(tmp_path, lower_case):
    """Three trainings on the same texts write the same bytes (the trainer alone numbers its
    "##" pieces in hash-map order, which changes the merges of equal count)."""
    files = []
    for attempt in range(3):
        directory = tmp_path / str(attempt)
        directory.mkdir()
        files.append(open(_train_vocab(tiny_documents(), str(directory), lower_case), "rb").read())
    assert files[0] == files[1] == files[2]
    tokens = files[0].decode("utf-8").split("\n")
    assert tokens[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] and tokens[-1] == ""
    assert len(set(tokens[:-1])) == len(tokens) - 1 == TINY_VOCAB_SIZE
    assert any(t.startswith("##") for t in tokens)
    assert any("é" in t for t in tokens) != lower_case  # lower case strips accents


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lower_case", [True, False])
def test_tokenizer_round_trip(tiny_bert, tmp_path, lower_case):
    from megatron_dpp.data.tokenizer import BertWordPieceTokenizer

    vocab_file = (tiny_bert["vocab_file"] if lower_case
                  else _train_vocab(tiny_bert["documents"], str(tmp_path), lower_case=False))
    tokenizer = BertWordPieceTokenizer(vocab_file, lower_case=lower_case)
    text = "The Café on Main Street serves coffee until noon."
    expected = "the cafe on main street serves coffee until noon." if lower_case else text
    ids = tokenizer.tokenize(text)
    assert tokenizer.detokenize(ids) == expected
    assert tokenizer.cls not in ids and tokenizer.sep not in ids  # the dataset adds them
    assert tokenizer.unk not in ids
    for sentence in SENTENCES:  # detokenized text tokenizes back to the same ids
        ids = tokenizer.tokenize(sentence)
        assert tokenizer.tokenize(tokenizer.detokenize(ids)) == ids
    assert tokenizer.tokenize_batch(SENTENCES) == [tokenizer.tokenize(s) for s in SENTENCES]
    special = [tokenizer.pad, tokenizer.unk, tokenizer.cls, tokenizer.sep, tokenizer.mask]
    assert special == [0, 1, 2, 3, 4]
    assert [tokenizer.inv_vocab[i] for i in special] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]",
                                                         "[MASK]"]


@pytest.mark.timeout(60)
def test_build_tokenizer_dispatches_on_tokenizer_type(tiny_bert):
    from megatron_dpp.data import DataInputError, build_tokenizer
    from megatron_dpp.data.tokenizer import BertWordPieceTokenizer

    for tokenizer_type, lower_case in (("BertWordPieceLowerCase", True),
                                       ("BertWordPieceCase", False)):
        args = argparse.Namespace(tokenizer_type=tokenizer_type, vocab_file=tiny_bert["vocab_file"],
                                  make_vocab_size_divisible_by=128, tensor_model_parallel_size=2)
        tokenizer = build_tokenizer(args)
        assert isinstance(tokenizer, BertWordPieceTokenizer)
        assert tokenizer.lower_case is lower_case and tokenizer.vocab_size == TINY_VOCAB_SIZE
        assert args.padded_vocab_size == 256  # a multiple of 128 x 2
    # No --tokenizer-type: GPT2BPETokenizer, which wants a merges file.
    args = argparse.Namespace(vocab_file=tiny_bert["vocab_file"], merge_file=None)
    with pytest.raises(DataInputError, match="--merge-file is required by GPT2BPETokenizer"):
        build_tokenizer(args)
    args.tokenizer_type = "SentencePieceTokenizer"
    with pytest.raises(DataInputError, match="--tokenizer-type SentencePieceTokenizer is not"):
        build_tokenizer(args)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["missing", "no_mask", "pad_not_first", "repeated", "empty_line",
                                  "not_utf8", "gpt_vocab_json"])
def test_bad_vocab_file_is_one_line_error(tmp_path, case):
    from megatron_dpp.data import DataInputError
    from megatron_dpp.data.tokenizer import BertWordPieceTokenizer

    good = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "##s"]
    lines, expected = {
        "missing": (None, "does not exist"),
        "no_mask": ([t for t in good if t != "[MASK]"], "lacks [MASK]"),
        "pad_not_first": (good[1:] + ["[PAD]"], "[PAD] on line 7; it must be the first line"),
        "repeated": (good + ["the"], ":8: token 'the' repeats line 6"),
        "empty_line": (good[:5] + [""] + good[5:], ":6: empty line"),
        "not_utf8": (None, "not UTF-8"),
        "gpt_vocab_json": (['{"the": 0, "<|endoftext|>": 1}'], "lacks [PAD] [UNK] [CLS] [SEP]"),
    }[case]
    path = tmp_path / "vocab.txt"
    if lines is not None:
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    elif case == "not_utf8":
        path.write_bytes(b"[PAD]\n\xff\xfe\n")
    with pytest.raises(DataInputError) as error:
        BertWordPieceTokenizer(str(path), lower_case=True)
    message = str(error.value)
    assert expected in message and "\n" not in message, message


# ------------------------------------------------------------------------------------------------
# Sentence splitting and the sentence-level indexed dataset
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, sentences", [
    ("Return the sum. It is fast! Is it? Yes.",
     ["Return the sum.", "It is fast!", "Is it?", "Yes."]),
    ("Use e.g. Foo or i.e. Bar. Then stop.", ["Use e.g. Foo or i.e. Bar.", "Then stop."]),
    ("Written by J. Smith in the U.S. Today.", ["Written by J. Smith in the U.S. Today."]),
    ("Call os.path.join(). then go on.", ["Call os.path.join(). then go on."]),
    ('He said "Stop." Then he left.', ['He said "Stop."', "Then he left."]),
    ("It is 42. Next one. Wait... Done", ["It is 42.", "Next one.", "Wait...", "Done"]),
    ("A list:\n1. First item\n2. Second item", ["A list:\n1. First item\n2. Second item"]),
    ("Line one\nwrapped. Two.\n\n  Paragraph two\n\n\n", ["Line one\nwrapped.", "Two.",
                                                         "Paragraph two"]),
    ("Example:\n\n    >>> f(1)\n    2", ["Example:", ">>> f(1)\n    2"]),
    ("", []),
    (" \n\n ", []),
])
def test_split_sentences(text, sentences):
    from megatron_dpp.data.sentences import split_sentences

    assert split_sentences(text) == sentences


@pytest.mark.timeout(60)
def test_split_sentences_gives_one_sequence_per_sentence(tiny_bert):
    """Each sentence is one sequence with its own ids; the document index groups them."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_dpp.data.sentences import split_sentences
    from megatron_dpp.data.tokenizer import BertWordPieceTokenizer

    tokenizer = BertWordPieceTokenizer(tiny_bert["vocab_file"], lower_case=True)
    dataset = IndexedDataset(tiny_bert["data_prefix"])
    assert tiny_bert["data_prefix"].endswith("tiny_text_sentence")
    per_document = [split_sentences(text) for text in tiny_bert["documents"]]
    assert all(len(sentences) >= 2 for sentences in per_document)
    expected_boundaries = numpy.cumsum([0] + [len(sentences) for sentences in per_document])
    assert dataset.document_indices.tolist() == expected_boundaries.tolist()
    sentences = [s for document in per_document for s in document]
    assert len(dataset) == len(sentences)
    for index, sentence in enumerate(sentences):
        assert dataset[index].tolist() == tokenizer.tokenize(sentence)


@pytest.mark.timeout(120)
def test_cli_split_sentences_with_workers_matches_in_process(tiny_bert, tmp_path):
    """tools/preprocess_data.py --split-sentences --workers 2 writes the in-process bytes."""
    corpus = tmp_path / "tiny.jsonl"
    write_jsonl(corpus, [{"text": text} for text in tiny_bert["documents"]])
    cmd = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"),
           "--input", str(corpus), "--output-prefix", str(tmp_path / "tiny"),
           "--vocab-file", tiny_bert["vocab_file"], "--tokenizer-type", "BertWordPieceLowerCase",
           "--split-sentences", "--workers", "2", "--no-progress"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=100,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert "documents (" in result.stdout and "sentences)" in result.stdout
    for suffix in (".bin", ".idx"):
        with open(tiny_bert["data_prefix"] + suffix, "rb") as expected, \
                open(str(tmp_path / "tiny_text_sentence") + suffix, "rb") as written:
            assert written.read() == expected.read()


def _run_preprocess_main(capsys, argv):
    from megatron_dpp.data.preprocess_data import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code, capsys.readouterr()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["append_eod_with_wordpiece", "gpt_without_merge_file"])
def test_preprocess_flag_errors_are_one_line_exit_2(tiny_bert, tmp_path, capsys, case):
    corpus = tmp_path / "corpus.jsonl"
    write_jsonl(corpus, [{"text": "One sentence. Two sentences."}])
    argv = ["--input", str(corpus), "--output-prefix", str(tmp_path / "o"),
            "--vocab-file", tiny_bert["vocab_file"], "--no-progress"]
    if case == "append_eod_with_wordpiece":
        argv += ["--tokenizer-type", "BertWordPieceCase", "--append-eod"]
        expected = "--append-eod: BertWordPieceCase has no end-of-document token"
    else:
        expected = "--merge-file is required by GPT2BPETokenizer"
    code, captured = _run_preprocess_main(capsys, argv)
    err = captured.err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and expected in err, err
    assert not [n for n in os.listdir(tmp_path) if n.startswith("o_")]


def test_preprocess_help_explains_the_new_flags(capsys):
    code, captured = _run_preprocess_main(capsys, ["--help"])
    assert code == 0
    help_text = " ".join(captured.out.split())
    assert "--split-sentences Store each sentence as its own sequence" in help_text
    assert "BertWordPieceLowerCase (lower-cases, strips accents)" in help_text
    assert "--merge-file MERGE_FILE Path to merges.txt (GPT2BPETokenizer only)" in help_text


# ------------------------------------------------------------------------------------------------
# BERT datasets
# ------------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_samples_are_megatrons_bert_dicts(tiny_bert, tmp_path):
    args = bert_args(tiny_bert, tmp_path)
    tokenizer, (train, valid, test) = _build(args)
    assert test is None and len(train) >= 32 and len(valid) >= 12  # 8x4 train, (8//4+1)x1x4 valid
    samples = _samples(train)
    for sample in samples:
        assert set(sample) == SAMPLE_KEYS
        for key in ("text", "types", "labels", "padding_mask", "loss_mask"):
            assert sample[key].dtype == numpy.int64 and sample[key].shape == (48,), key
        assert sample["is_random"] in (0, 1) and sample["truncated"] in (0, 1)
        length = int(sample["padding_mask"].sum())
        assert sample["padding_mask"].tolist() == [1] * length + [0] * (48 - length)
        text = sample["text"].tolist()
        assert text[0] == tokenizer.cls and text[length - 1] == tokenizer.sep
        assert text[length:] == [tokenizer.pad] * (48 - length)
        assert text[:length].count(tokenizer.sep) == 2  # [CLS] A [SEP] B [SEP]
        # Token types: 0 up to the first [SEP], 1 for B and its [SEP], 0 on padding.
        first_sep = text.index(tokenizer.sep)
        assert sample["types"].tolist() == ([0] * (first_sep + 1) + [1] * (length - first_sep - 1)
                                            + [0] * (48 - length))
        masked = sample["loss_mask"] == 1
        assert masked.any() and masked.tolist() == (sample["labels"] != -1).tolist()
        assert not numpy.isin(sample["labels"][masked], [tokenizer.cls, tokenizer.sep]).any()
        assert tokenizer.mask not in text[:length] or masked[text.index(tokenizer.mask)]
    assert {s["is_random"] for s in samples} == {0, 1}  # sentence order: both labels occur
    masked_tokens = sum(int(s["loss_mask"].sum()) for s in samples)
    assert 0.08 < masked_tokens / sum(int(s["padding_mask"].sum()) for s in samples) < 0.2
    # Megatron shows [MASK] at 80% of the masked positions (10% random, 10% unchanged).
    shown_as_mask = sum(int((s["text"][s["loss_mask"] == 1] == tokenizer.mask).sum())
                        for s in samples)
    assert 0.6 < shown_as_mask / masked_tokens < 0.95


@pytest.mark.timeout(60)
def test_masking_is_deterministic_by_seed(tiny_bert, tmp_path):
    def build(seed, cache):
        _, (train, _, _) = _build(bert_args(tiny_bert, tmp_path, seed=seed,
                                            data_cache_path=str(tmp_path / cache)))
        return _samples(train)

    first, again, other = build(1234, "a"), build(1234, "b"), build(4321, "c")
    assert len(first) == len(again)
    for a, b in zip(first, again):
        assert all(numpy.array_equal(a[key], b[key]) for key in SAMPLE_KEYS)
    differs = [not numpy.array_equal(a["loss_mask"], b["loss_mask"])
               for a, b in zip(first, other)]
    assert sum(differs) > len(differs) // 2


@pytest.mark.timeout(60)
def test_without_binary_head_samples_are_one_segment(tiny_bert, tmp_path):
    args = bert_args(tiny_bert, tmp_path, bert_binary_head=False)
    tokenizer, (train, _, _) = _build(args)
    for sample in _samples(train):
        length = int(sample["padding_mask"].sum())
        text = sample["text"].tolist()
        assert text[0] == tokenizer.cls and text[:length].count(tokenizer.sep) == 1
        assert text[length - 1] == tokenizer.sep
        assert not sample["types"].any() and sample["is_random"] == 0


@pytest.mark.timeout(60)
def test_single_sentence_documents_need_no_binary_head(tiny_bert, tmp_path):
    """Sentence order needs two sentences per document: with only single-sentence documents the
    binary head is a one-line error (not Megatron's endless loop); without it they are samples."""
    from megatron_dpp.data import DataInputError

    prefix = _preprocess(SENTENCES * 3, str(tmp_path), tiny_bert["vocab_file"], name="single")
    args = bert_args(tiny_bert, tmp_path, data_path=[prefix])
    with pytest.raises(DataInputError, match=r"the train split of .*single_text_sentence has 29 "
                                             r"documents but none BERT can sample \(2\+ sentences"):
        _build(args)
    args.bert_binary_head = False
    _, (train, _, _) = _build(args)
    assert len(train) >= 32 and train[0]["text"].tolist().count(3) == 1  # [SEP] is id 3


@pytest.mark.timeout(60)
def test_guarded_dataset_refuses_unusable_split_without_precheck(tiny_bert, tmp_path):
    """The backstop inside the dataset class, for callers that skip the up-front check."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder)

    from megatron_dpp.data import DataInputError, build_tokenizer
    from megatron_dpp.data.bert_datasets import _guarded_bert_dataset_class, bert_dataset_config

    prefix = _preprocess(SENTENCES, str(tmp_path), tiny_bert["vocab_file"], name="single")
    args = bert_args(tiny_bert, tmp_path, data_path=[prefix])
    config = bert_dataset_config(args, build_tokenizer(args))
    builder = BlendedMegatronDatasetBuilder(_guarded_bert_dataset_class(), [8, 0, 0],
                                            lambda: True, config)
    with pytest.raises(DataInputError, match="train split .* none BERT can sample"):
        builder.build()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["short_seq_length", "mask_prob", "short_seq_prob", "bad_split",
                                  "empty_split", "odd_data_path"])
def test_bad_bert_inputs_are_one_line_errors(tiny_bert, tmp_path, case):
    from megatron_dpp.data import DataInputError

    overrides, expected = {
        "short_seq_length": ({"seq_length": 4}, "--seq-length 4 is too short for BERT"),
        "mask_prob": ({"mask_prob": 1.0}, "--mask-prob must be in (0, 1), got 1.0"),
        "short_seq_prob": ({"short_seq_prob": -0.1}, "--short-seq-prob must be in [0, 1]"),
        "bad_split": ({"split": "80,x"}, "--split '80,x' must be up to three"),
        # 1000:0:1 of 40 documents leaves the test split none: Megatron cannot build it.
        "empty_split": ({"split": "1000,0,1"}, "_text_sentence has no documents (40 in all)"),
        "odd_data_path": ({"data_path": ["0.5", tiny_bert["data_prefix"], "0.5"]},
                          "--data-path takes one PREFIX or pairs WEIGHT PREFIX"),
    }[case]
    with pytest.raises(DataInputError) as error:
        _build(bert_args(tiny_bert, tmp_path, **overrides))
    message = str(error.value)
    assert "\n" not in message and expected in message, message


@pytest.mark.timeout(60)
def test_iterators_batch_bert_samples(tiny_bert, tmp_path):
    from megatron_dpp.data import build_data_iterators

    args = bert_args(tiny_bert, tmp_path)
    _, (train, valid, test) = _build(args)
    train_iter, valid_iter, test_iter = build_data_iterators(args, train, valid, test)
    assert test_iter is None
    for step, batch in enumerate([next(train_iter) for _ in range(3)] + [next(valid_iter)]):
        assert set(batch) == SAMPLE_KEYS
        for key in ("text", "types", "labels", "padding_mask", "loss_mask"):
            assert batch[key].shape == (2, 48) and batch[key].dtype == torch.int64
        assert batch["is_random"].shape == (2,) and batch["truncated"].dtype == torch.int64
        if step < 3:
            for row in range(2):
                sample = train[step * 2 + row]
                assert torch.equal(batch["text"][row], torch.from_numpy(sample["text"]))
                assert int(batch["is_random"][row]) == sample["is_random"]


@pytest.mark.timeout(60)
def test_variable_seq_lengths_cut_each_micro_batch_to_its_longest_sample(tiny_bert, tmp_path):
    from megatron_dpp.data import build_data_iterators

    args = bert_args(tiny_bert, tmp_path, short_seq_prob=0.9, variable_seq_lengths=True)
    _, (train, valid, test) = _build(args)
    train_iter, _, _ = build_data_iterators(args, train, valid, test)
    lengths = []
    for step in range(len(train) // 2):
        batch = next(train_iter)
        rows = [train[step * 2 + row] for row in range(2)]
        longest = max(int(sample["padding_mask"].sum()) for sample in rows)
        lengths.append(longest)
        for key in ("text", "types", "labels", "padding_mask", "loss_mask"):
            assert batch[key].shape == (2, longest), key
            for row, sample in enumerate(rows):
                # Only padding is cut: every real token, label and mask is kept.
                assert torch.equal(batch[key][row], torch.from_numpy(sample[key][:longest]))
                assert not sample["padding_mask"][longest:].any()
        assert batch["is_random"].shape == (2,)
    assert len(set(lengths)) > 1 and max(lengths) <= 48  # the micro-batches differ in length


# ------------------------------------------------------------------------------------------------
# The sample data from prepare_sample
# ------------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_prepare_sample_makes_bert_data(sample_data, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_dpp.data.prepare_sample import BERT_TOKENIZER_TYPE
    from megatron_dpp.data.sentences import split_sentences
    from megatron_dpp.data.tokenizer import BertWordPieceTokenizer

    tokenizer = BertWordPieceTokenizer(sample_data["bert_vocab_file"], lower_case=True)
    assert tokenizer.vocab_size == 4096 and BERT_TOKENIZER_TYPE == "BertWordPieceLowerCase"
    dataset = IndexedDataset(sample_data["bert_data_prefix"])
    with open(sample_data["corpus"], encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    assert len(dataset.document_indices) - 1 == len(texts)
    assert len(dataset) > 2 * len(texts)  # docstrings hold several sentences on average
    first = split_sentences(texts[0])
    assert [dataset[i].tolist() for i in range(len(first))] == tokenizer.tokenize_batch(first)
    # Usable as is by build_bert_datasets.
    paths = {"data_prefix": sample_data["bert_data_prefix"],
             "vocab_file": sample_data["bert_vocab_file"]}
    tokenizer, (train, valid, _) = _build(bert_args(paths, tmp_path, seq_length=128))
    assert len(train) >= 32 and train[0]["text"].shape == (128,)


@pytest.mark.timeout(60)
def test_missing_bert_vocab_rebuilds_only_bert_outputs(sample_data, tmp_path):
    """Delete bert-vocab.txt: the vocabulary and the BERT dataset are remade, identical; the corpus
    and GPT's outputs are kept."""
    from megatron_dpp.data.prepare_sample import prepare_sample, sample_paths

    directory = str(tmp_path / "copy")
    os.makedirs(directory)
    paths = sample_paths(directory)
    with open(sample_data["corpus"], encoding="utf-8") as f:  # a small corpus keeps this fast
        head = [next(f) for _ in range(300)]
    with open(paths["corpus"], "w", encoding="utf-8") as f:
        f.writelines(head)
    prepare_sample(directory, vocab_size=600, bert_vocab_size=600, show_progress=False)
    first = output_stamps(paths)
    bert_files = output_files(paths, ("bert_vocab_file", "bert_data_prefix"))
    first_bytes = {f: open(f, "rb").read() for f in bert_files}
    os.remove(paths["bert_vocab_file"])
    prepare_sample(directory, vocab_size=600, bert_vocab_size=600, show_progress=False)
    second = output_stamps(paths)
    assert all(first[f][1] != second[f][1] for f in bert_files)  # remade
    assert all(open(f, "rb").read() == first_bytes[f] for f in bert_files)  # identically
    assert all(first[f] == second[f] for f in first if f not in bert_files)  # the rest kept
