"""--tokenizer-type GPTSentencePieceTokenizer and --tokenizer-type TikTokenizer, as Megatron-LM
reads them. A small SentencePiece model is trained here with the sentencepiece library, and a small
tiktoken vocabulary (256 bytes and a few hundred merges, learnt here over the text split by
Megatron-LM's v2 pattern) is written in Megatron-LM's JSON format; then the ids against
sentencepiece and tiktoken themselves and against megatron.core's own tokenizers (the ones
Megatron-LM's tools/preprocess_data.py builds), the vocabulary sizes and special ids, the flags'
one-line errors, tools/preprocess_data.py with each, and short 2-rank runs: GPT
(megatron_dpp.pretrain_gpt) on the tiktoken data, Llama (megatron_dpp.pretrain --model llama) on the
SentencePiece data."""
from __future__ import annotations

import argparse
import base64
import io
import json
import subprocess
import sys
from collections import Counter

import numpy
import pytest
import sentencepiece
import tiktoken

from _train_util import (PYTHON, REPO_ROOT, TINY_GPT_ARGS, _env, ensure_sample_data, flag_error,
                         run_training)
from megatron_dpp.data.errors import DataInputError
from megatron_dpp.data.tokenizer import (TIKTOKEN_PATTERNS, GPTSentencePieceTokenizer,
                                         TikTokenizer, build_tokenizer, check_tiktoken_flags,
                                         ignored_tiktoken_pattern, tokenizer_from_files)

SPM_VOCAB = 500
MERGES = 244
FILE_TOKENS = 256 + MERGES  # the tiktoken file's entries: 500
NUM_SPECIAL = 12
TIK_VOCAB = NUM_SPECIAL + FILE_TOKENS  # 512: the whole file after 12 special ids
TEXT = "Return the sum of two numbers.\nRaises ValueError when either is negative: <s> 3.14"
CORE_SPECIAL = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]  # megatron.core's


def _corpus_texts(limit: int = 400) -> list[str]:
    with open(ensure_sample_data() / "sample_corpus.jsonl", encoding="utf-8") as corpus:
        return [json.loads(line)["text"] for _, line in zip(range(limit), corpus)]


def _train_spm(path, **ids) -> str:
    written = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus_texts()), model_writer=written, vocab_size=SPM_VOCAB,
        model_type="bpe", byte_fallback=True, character_coverage=0.995,
        max_sentence_length=100000, num_threads=1, minloglevel=2, **ids)
    path.write_bytes(written.getvalue())
    return str(path)


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> str:
    """A SentencePiece BPE model: unk 0, <s> 1, </s> 2 and a padding piece, <pad> 3."""
    return _train_spm(tmp_path_factory.mktemp("spm") / "tokenizer.model", pad_id=3)


def _learn_merges(texts, merges: int, pattern: str) -> dict[bytes, int]:
    """Byte-level BPE ranks: the 256 bytes, then the most frequent adjacent pair within the
    pattern's pieces, merged, `merges` times."""
    import regex  # tiktoken's own dependency

    words = Counter(piece.encode("utf-8") for text in texts
                    for piece in regex.findall(pattern, text))
    pieces = {word: [bytes([b]) for b in word] for word in words}
    ranks = {bytes([i]): i for i in range(256)}
    while len(ranks) < 256 + merges:
        pairs = Counter()
        for word, count in words.items():
            parts = pieces[word]
            for pair in zip(parts, parts[1:]):
                pairs[pair] += count
        (left, right), _ = max(pairs.items(), key=lambda item: (item[1], item[0]))
        ranks.setdefault(left + right, len(ranks))
        for word, parts in pieces.items():
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == left and parts[i + 1] == right:
                    merged.append(left + right)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            pieces[word] = merged
    return ranks


def _write_vocabulary(path, ranks: dict[bytes, int]) -> str:
    entries = [{"rank": rank, "token_bytes": base64.b64encode(token).decode("ascii"),
                "token_str": token.decode("utf-8", errors="replace")}
               for token, rank in sorted(ranks.items(), key=lambda item: item[1])]
    path.write_text(json.dumps(entries))
    return str(path)


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    return _learn_merges(_corpus_texts(limit=150), MERGES, TIKTOKEN_PATTERNS["v2"])


@pytest.fixture(scope="module")
def tik_vocab(ranks, tmp_path_factory) -> str:
    return _write_vocabulary(tmp_path_factory.mktemp("tiktoken") / "vocab.json", ranks)


def _reference_encoding(ranks, pattern: str, num_special: int = NUM_SPECIAL,
                        size: int = FILE_TOKENS) -> tiktoken.Encoding:
    """tiktoken itself over the ranks: the file's first `size` tokens after the special ids."""
    kept = {token: rank + num_special for token, rank in ranks.items() if rank < size}
    special = {name: i for i, name in enumerate(["<unk>", "<s>", "</s>"] + [
        f"<SPECIAL_{i}>" for i in range(3, num_special)])}
    return tiktoken.Encoding(name="reference", pat_str=TIKTOKEN_PATTERNS[pattern],
                             mergeable_ranks=kept, special_tokens=special)


def _tik_args(tik_vocab, **flags) -> argparse.Namespace:
    values = dict(tokenizer_type="TikTokenizer", tokenizer_model=tik_vocab,
                  tiktoken_pattern="v2", vocab_size=TIK_VOCAB,
                  tiktoken_num_special_tokens=NUM_SPECIAL, make_vocab_size_divisible_by=128,
                  tensor_model_parallel_size=1)
    values.update(flags)
    return argparse.Namespace(**values)


def test_sentencepiece_ids_are_the_models_without_bos_and_eod_is_eos(spm_model):
    reference = sentencepiece.SentencePieceProcessor(model_file=spm_model)
    args = argparse.Namespace(tokenizer_type="GPTSentencePieceTokenizer",
                              tokenizer_model=spm_model, make_vocab_size_divisible_by=128,
                              tensor_model_parallel_size=1)
    tokenizer = build_tokenizer(args)
    assert isinstance(tokenizer, GPTSentencePieceTokenizer)
    assert tokenizer.vocab_size == SPM_VOCAB and args.padded_vocab_size == 512
    assert (tokenizer.bos, tokenizer.eos, tokenizer.eod, tokenizer.pad) == (1, 2, 2, 3)
    ids = tokenizer.tokenize(TEXT)
    assert ids == reference.encode(TEXT) and ids[0] != 1  # no BOS, unlike Llama2Tokenizer
    assert tokenizer.tokenize_batch([TEXT, "x"]) == [ids, reference.encode("x")]
    assert tokenizer.detokenize(ids) == reference.decode(ids)
    assert tokenizer.vocab["</s>"] == 2 and tokenizer.inv_vocab[3] == "<pad>"
    assert len(tokenizer.vocab) == SPM_VOCAB
    assert tokenizer.unique_identifiers["tokenizer_path"] == [spm_model]


def test_sentencepiece_equals_megatron_cores_tokenizer(spm_model):
    from megatron.core.tokenizers import MegatronTokenizer

    core = MegatronTokenizer.from_pretrained(tokenizer_path=spm_model,
                                             metadata_path={"library": "sentencepiece"})
    ours = GPTSentencePieceTokenizer(spm_model)
    assert (ours.vocab_size, ours.eod, ours.bos, ours.eos, ours.pad) == (
        core.vocab_size, core.eod, core.bos, core.eos, core.pad)
    for text in [TEXT, *_corpus_texts(limit=5)]:
        assert ours.tokenize(text) == list(core.tokenize(text))


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_tiktoken_ids_are_tiktokens_after_the_special_ids_and_eod_is_eos(ranks, tik_vocab,
                                                                         pattern):
    args = _tik_args(tik_vocab, tiktoken_pattern=pattern)
    tokenizer = build_tokenizer(args)
    assert isinstance(tokenizer, TikTokenizer)
    assert tokenizer.vocab_size == TIK_VOCAB and args.padded_vocab_size == 512
    assert (tokenizer.unk, tokenizer.bos, tokenizer.eos, tokenizer.eod) == (0, 1, 2, 2)
    assert tokenizer.pad == -1  # no <pad> among the special tokens
    reference = _reference_encoding(ranks, pattern)
    ids = tokenizer.tokenize(TEXT)
    # "<s>" in the text is ordinary text (Megatron-LM's TikTokenizer: encode_ordinary).
    assert ids == reference.encode_ordinary(TEXT) and min(ids) >= NUM_SPECIAL
    assert tokenizer.tokenize_batch([TEXT, "x"]) == [ids, reference.encode_ordinary("x")]
    assert tokenizer.detokenize(ids) == TEXT
    assert tokenizer.detokenize([1]) == "<s>"
    last = max(ranks, key=ranks.get)  # the last merge
    assert len(last) > 1 and tokenizer.vocab[last] == FILE_TOKENS - 1 + NUM_SPECIAL
    assert tokenizer.inv_vocab[NUM_SPECIAL + 65] == b"A"
    assert tokenizer.inv_vocab[NUM_SPECIAL - 1] == f"<SPECIAL_{NUM_SPECIAL - 1}>"
    assert len(tokenizer.vocab) == TIK_VOCAB
    assert tokenizer.unique_identifiers["tokenizer_path"] == [tik_vocab]
    assert tokenizer.unique_identifiers["pattern"] == pattern


def test_tiktoken_patterns_and_ids_equal_megatron_cores(tik_vocab):
    from megatron.core.tokenizers import MegatronTokenizer
    from megatron.core.tokenizers.text.libraries import tiktoken_tokenizer

    assert TIKTOKEN_PATTERNS == {"v1": tiktoken_tokenizer._PATTERN_TIKTOKEN_V1,
                                 "v2": tiktoken_tokenizer._PATTERN_TIKTOKEN_V2}
    for pattern in ("v1", "v2"):
        core = MegatronTokenizer.from_pretrained(
            tokenizer_path=tik_vocab, metadata_path={"library": "tiktoken"}, pattern=pattern,
            vocab_size=TIK_VOCAB, num_special_tokens=NUM_SPECIAL, special_tokens=CORE_SPECIAL)
        ours = build_tokenizer(_tik_args(tik_vocab, tiktoken_pattern=pattern,
                                         tiktoken_special_tokens=CORE_SPECIAL))
        assert (ours.vocab_size, ours.eod, ours.pad) == (core.vocab_size, core.eod, 4)
        for text in _corpus_texts(limit=5):
            assert ours.tokenize(text) == list(core.tokenize(text))


def test_tiktoken_vocab_size_cuts_the_file_and_special_tokens_come_first(ranks, tik_vocab):
    tokenizer = build_tokenizer(_tik_args(tik_vocab, vocab_size=4 + 300,
                                          tiktoken_num_special_tokens=4,
                                          tiktoken_special_tokens=["</s>", "<pad>", "<s>",
                                                                   "<unk>"]))
    assert tokenizer.vocab_size == 304 and len(tokenizer.vocab) == 304
    assert (tokenizer.eod, tokenizer.pad, tokenizer.bos, tokenizer.unk) == (0, 1, 2, 3)
    reference = _reference_encoding(ranks, "v2", num_special=4, size=300)
    assert tokenizer.tokenize(TEXT) == reference.encode_ordinary(TEXT)
    assert max(tokenizer.tokenize(" ".join(_corpus_texts(limit=3)))) < 304


def test_tokenizer_special_tokens_is_the_newer_name_of_tiktoken_special_tokens(tik_vocab):
    order = ["</s>", "<s>", "<unk>"]
    newer = build_tokenizer(_tik_args(tik_vocab, tokenizer_special_tokens=order))
    older = build_tokenizer(_tik_args(tik_vocab, tiktoken_special_tokens=order))
    assert (newer.eod, newer.bos, newer.unk) == (older.eod, older.bos, older.unk) == (0, 1, 2)
    assert newer.unique_identifiers == older.unique_identifiers
    with pytest.raises(DataInputError, match="^--tiktoken-special-tokens is Megatron-LM's older "
                                             "name of --tokenizer-special-tokens: give one of "
                                             "the two$"):
        build_tokenizer(_tik_args(tik_vocab, tokenizer_special_tokens=order,
                                  tiktoken_special_tokens=order))


# Each case: what it changes, and how the one line starts.
SPM_MISTAKES = {
    "missing flag": (dict(tokenizer_model=None),
                     "--tokenizer-model is required by GPTSentencePieceTokenizer; pass the "
                     "SentencePiece model"),
    "missing file": (dict(tokenizer_model="{tmp}/nope.model"),
                     "--tokenizer-model '{tmp}/nope.model' does not exist"),
    "not a model": (dict(tokenizer_model="{tmp}/bad.model"),
                    "--tokenizer-model '{tmp}/bad.model' is not a SentencePiece model"),
    "no eos": (dict(tokenizer_model="{tmp}/no_eos.model"),
               "--tokenizer-model '{tmp}/no_eos.model' has no EOS piece; "
               "GPTSentencePieceTokenizer takes it as the end-of-document token"),
    "vocab file too": (dict(vocab_file="{sample}/vocab.json"),
                       "--vocab-file is not read by --tokenizer-type GPTSentencePieceTokenizer "
                       "(it reads --tokenizer-model): remove it"),
    "vocab size": (dict(vocab_size=1000),
                   "--vocab-size is read by --tokenizer-type NullTokenizer and TikTokenizer "
                   "only (GPTSentencePieceTokenizer takes its vocabulary from its files)"),
    "tiktoken flag": (dict(tiktoken_num_special_tokens=100),
                      "--tiktoken-num-special-tokens is read by --tokenizer-type TikTokenizer "
                      "only, not GPTSentencePieceTokenizer: remove it"),
    "no sentencepiece": (dict(), "--tokenizer-type GPTSentencePieceTokenizer needs the "
                                 "sentencepiece package: pip install 'sentencepiece>=0.2,<1'"),
}


@pytest.mark.parametrize("case", list(SPM_MISTAKES))
def test_sentencepiece_mistakes_are_one_line_errors(spm_model, tmp_path, monkeypatch, case):
    changes, expected = SPM_MISTAKES[case]
    where = dict(tmp=tmp_path, sample=ensure_sample_data())
    (tmp_path / "bad.model").write_text("not protobuf")
    if case == "no eos":
        _train_spm(tmp_path / "no_eos.model", eos_id=-1)
    if case == "no sentencepiece":
        monkeypatch.setitem(sys.modules, "sentencepiece", None)  # import fails
    flags = dict(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=spm_model,
                 vocab_file=None, merge_file=None)
    flags.update({key: value.format(**where) if isinstance(value, str) else value
                  for key, value in changes.items()})
    with pytest.raises(DataInputError) as raised:
        build_tokenizer(argparse.Namespace(**flags))
    message = str(raised.value)
    assert "\n" not in message and message.startswith(expected.format(**where)), message


def test_a_tiktoken_pattern_beside_another_tokenizer_is_ignored_with_a_warning():
    """Megatron-LM ignores --tiktoken-pattern beside another tokenizer (its Llama 3 script passes
    v2 with NullTokenizer): accepted, and one warning line says so."""
    check_tiktoken_flags("NullTokenizer", tiktoken_pattern="v2")
    assert ignored_tiktoken_pattern("NullTokenizer", "v2") == (
        "--tiktoken-pattern v2 is read by --tokenizer-type TikTokenizer only: NullTokenizer "
        "ignores it, as in Megatron-LM")
    assert ignored_tiktoken_pattern("TikTokenizer", "v2") is None
    assert ignored_tiktoken_pattern("NullTokenizer", None) is None


def _entries(tik_vocab):
    with open(tik_vocab, encoding="utf-8") as handle:
        return json.load(handle)


TIK_MISTAKES = {
    "missing flag": (dict(tokenizer_model=None),
                     "--tokenizer-model is required by TikTokenizer; pass the tiktoken "
                     "vocabulary"),
    "missing file": (dict(tokenizer_model="{tmp}/nope.json"),
                     "--tokenizer-model '{tmp}/nope.json' does not exist"),
    "no pattern": (dict(tiktoken_pattern=None),
                   "--tokenizer-type TikTokenizer needs --tiktoken-pattern v1 or v2"),
    "unknown pattern": (dict(tiktoken_pattern="v3"),
                        "--tiktoken-pattern 'v3' is not one of v1, v2"),
    "not .json": (dict(tokenizer_model="{tmp}/vocab.tiktoken"),
                  "--tokenizer-model '{tmp}/vocab.tiktoken' is not a .json file; TikTokenizer "
                  "reads Megatron-LM's tiktoken vocabulary: a JSON list of"),
    "not JSON": (dict(tokenizer_model="{tmp}/broken.json"),
                 "--tokenizer-model '{tmp}/broken.json' is not JSON (Expecting value at line 1)"),
    "not a list": (dict(tokenizer_model="{tmp}/object.json"),
                   "--tokenizer-model '{tmp}/object.json' holds a JSON dict, not a list"),
    "wrong keys": (dict(tokenizer_model="{tmp}/keys.json"),
                   "--tokenizer-model '{tmp}/keys.json' entry 7 is not an object with exactly "
                   "the keys rank, token_bytes, token_str"),
    "wrong rank": (dict(tokenizer_model="{tmp}/rank.json"),
                   "--tokenizer-model '{tmp}/rank.json' entry 300 has rank 301; the i-th entry "
                   "has rank i"),
    "bytes out of order": (dict(tokenizer_model="{tmp}/bytes.json"),
                           "--tokenizer-model '{tmp}/bytes.json' entry 65 is b'B', not the byte "
                           "65; the first 256 entries are the single bytes 0..255 in order"),
    "too few tokens": (dict(vocab_size=None),
                       f"--tokenizer-model '{{vocab}}' holds {FILE_TOKENS} tokens, fewer than "
                       f"the {2 ** 17 - NUM_SPECIAL} that --vocab-size 131072 less "
                       f"--tiktoken-num-special-tokens {NUM_SPECIAL} needs; pass --vocab-size "
                       f"{FILE_TOKENS + NUM_SPECIAL} (its default, Megatron-LM's, is 131072)"),
    "special tokens lack eos": (dict(tiktoken_special_tokens=["<unk>", "<s>"]),
                                "--tiktoken-special-tokens lacks </s>; TikTokenizer needs "
                                "<unk> <s> </s> among them"),
    "special token twice": (dict(tiktoken_special_tokens=["<unk>", "<s>", "</s>", "<s>"]),
                            "--tiktoken-special-tokens names '<s>' more than once"),
    "too few special ids": (dict(tiktoken_num_special_tokens=2),
                            "--tiktoken-num-special-tokens 2 must be at least the 3 special "
                            "tokens and less than --vocab-size 512"),
    "no room for the bytes": (dict(vocab_size=NUM_SPECIAL + 255),
                              f"--vocab-size {NUM_SPECIAL + 255} less "
                              f"--tiktoken-num-special-tokens {NUM_SPECIAL} leaves 255 tokens; "
                              f"a tiktoken vocabulary starts with the 256 single bytes"),
    "vocab file too": (dict(vocab_file="{sample}/vocab.json"),
                       "--vocab-file is not read by --tokenizer-type TikTokenizer (it reads "
                       "--tokenizer-model): remove it"),
    "no tiktoken": (dict(), "--tokenizer-type TikTokenizer needs the tiktoken package: pip "
                            "install 'tiktoken>=0.7,<1'"),
}


@pytest.mark.parametrize("case", list(TIK_MISTAKES))
def test_tiktoken_mistakes_are_one_line_errors(tik_vocab, tmp_path, monkeypatch, case):
    changes, expected = TIK_MISTAKES[case]
    where = dict(tmp=tmp_path, sample=ensure_sample_data(), vocab=tik_vocab)
    entries = _entries(tik_vocab)
    (tmp_path / "vocab.tiktoken").write_text("")
    (tmp_path / "broken.json").write_text("vocabulary")
    (tmp_path / "object.json").write_text(json.dumps({"0": entries[0]}))
    (tmp_path / "keys.json").write_text(json.dumps(
        entries[:7] + [{"rank": 7, "bytes": entries[7]["token_bytes"]}] + entries[8:]))
    (tmp_path / "rank.json").write_text(json.dumps(
        entries[:300] + [dict(entries[300], rank=301)] + entries[301:]))
    (tmp_path / "bytes.json").write_text(json.dumps(
        entries[:65] + [dict(entries[65], token_bytes=entries[66]["token_bytes"])]
        + entries[66:]))
    if case == "no tiktoken":
        monkeypatch.setitem(sys.modules, "tiktoken", None)  # import fails
    args = _tik_args(tik_vocab, vocab_file=None, merge_file=None)
    for key, value in changes.items():
        setattr(args, key, value.format(**where) if isinstance(value, str) else value)
    with pytest.raises(DataInputError) as raised:
        build_tokenizer(args)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(expected.format(**where)), message


@pytest.mark.parametrize("flag, value", [("tiktoken_num_special_tokens", 8),
                                         ("tiktoken_special_tokens", ["<unk>", "<s>", "</s>"])])
def test_tiktoken_flags_with_another_tokenizer_are_refused(flag, value):
    sample = ensure_sample_data()
    with pytest.raises(DataInputError) as raised:
        tokenizer_from_files("GPT2BPETokenizer", str(sample / "vocab.json"),
                             str(sample / "merges.txt"), **{flag: value})
    assert str(raised.value) == (f"--{flag.replace('_', '-')} is read by --tokenizer-type "
                                 f"TikTokenizer only, not GPT2BPETokenizer: remove it")


@pytest.mark.parametrize("model", ["gpt", "llama"])
@pytest.mark.parametrize("flags, expected", [
    (["--tokenizer-type", "TikTokenizer", "--tokenizer-model", "{vocab}", "--vocab-size",
      str(TIK_VOCAB), "--tiktoken-num-special-tokens", str(NUM_SPECIAL)],
     "--tokenizer-type TikTokenizer needs --tiktoken-pattern v1 or v2"),
    (["--tokenizer-type", "TikTokenizer", "--tokenizer-model", "{vocab}",
      "--tiktoken-pattern", "v2", "--tiktoken-num-special-tokens", str(NUM_SPECIAL)],
     f"--tokenizer-model '{{vocab}}' holds {FILE_TOKENS} tokens, fewer than the "
     f"{2 ** 17 - NUM_SPECIAL} that --vocab-size 131072"),
    (["--tokenizer-type", "TikTokenizer", "--tokenizer-model", "{model}",
      "--tiktoken-pattern", "v2"], "--tokenizer-model '{model}' is not a .json file"),
    (["--tokenizer-type", "TikTokenizer", "--tokenizer-model", "{vocab}",
      "--tiktoken-pattern", "v3"], "argument --tiktoken-pattern: invalid choice: 'v3'"),
    (["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", "{vocab}"],
     "--tokenizer-model '{vocab}' is not a SentencePiece model"),
    (["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", "{model}",
      "--tiktoken-special-tokens", "<unk>", "<s>", "</s>"],
     "--tiktoken-special-tokens is read by --tokenizer-type TikTokenizer only, not "
     "GPTSentencePieceTokenizer: remove it"),
    (["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", "{model}",
      "--tokenizer-special-tokens", "<unk>", "<s>", "</s>"],
     "--tokenizer-special-tokens is read by --tokenizer-type TikTokenizer only here"),
    (["--tokenizer-type", "TikTokenizer", "--tokenizer-model", "{vocab}", "--tiktoken-pattern",
      "v2", "--vocab-size", str(TIK_VOCAB), "--tokenizer-special-tokens", "<unk>", "<s>", "</s>",
      "--tiktoken-special-tokens", "<unk>", "<s>", "</s>"],
     "--tiktoken-special-tokens is Megatron-LM's older name of --tokenizer-special-tokens"),
    (["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", "{model}",
      "--tokenizer-sentencepiece-legacy"],
     "--tokenizer-sentencepiece-legacy (megatron.core's SentencePiece wrapper reading special "
     "tokens' text) is not a choice here"),
])
def test_trainer_flags_name_the_mistake_before_anything_starts(capsys, monkeypatch, spm_model,
                                                               tik_vocab, model, flags,
                                                               expected):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    where = dict(vocab=tik_vocab, model=spm_model)
    sample = ensure_sample_data()
    argv = ["--data-path", str(sample / "sample_text_document"), "--split", "98,2,0",
            *TINY_GPT_ARGS, *(flag.format(**where) for flag in flags)]
    line = flag_error(capsys, argv, model=model)
    assert expected.format(**where) in line, line


def _preprocess(output_dir, name, texts, *flags) -> str:
    corpus = output_dir / f"{name}.jsonl"
    with open(corpus, "w", encoding="utf-8") as out:
        for text in texts:
            out.write(json.dumps({"text": text}) + "\n")
    done = subprocess.run(
        [PYTHON, "tools/preprocess_data.py", "--input", str(corpus), "--output-prefix",
         str(output_dir / name), "--append-eod", "--no-progress", *flags],
        capture_output=True, text=True, timeout=200, env=_env(), cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return str(output_dir / f"{name}_text_document")


@pytest.fixture(scope="module")
def tik_data(tik_vocab, tmp_path_factory) -> str:
    """The corpus through tools/preprocess_data.py with the tiktoken vocabulary: 2 workers,
    --append-eod, no --tiktoken-pattern (v2, Megatron-LM's tool's default)."""
    return _preprocess(tmp_path_factory.mktemp("tik_data"), "tik", _corpus_texts(),
                       "--tokenizer-type", "TikTokenizer", "--tokenizer-model", tik_vocab,
                       "--vocab-size", str(TIK_VOCAB), "--tiktoken-num-special-tokens",
                       str(NUM_SPECIAL), "--workers", "2")


@pytest.fixture(scope="module")
def spm_data(spm_model, tmp_path_factory) -> str:
    """The corpus through tools/preprocess_data.py with the SentencePiece model (--append-eod)."""
    return _preprocess(tmp_path_factory.mktemp("spm_data"), "spm", _corpus_texts(),
                       "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
                       spm_model)


@pytest.mark.timeout(300)
def test_preprocessed_documents_are_the_tokenizers_ids_and_end_with_eos(ranks, spm_model,
                                                                        tik_data, spm_data):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    texts = [text for text in _corpus_texts() if text.strip()]
    tik = _reference_encoding(ranks, "v2")
    spm = sentencepiece.SentencePieceProcessor(model_file=spm_model)
    for prefix, encode in ((tik_data, tik.encode_ordinary), (spm_data, spm.encode)):
        dataset = IndexedDataset(prefix)
        assert len(dataset) == len(texts)
        for index in (0, 1, len(dataset) // 2, len(dataset) - 1):
            assert numpy.asarray(dataset[index]).tolist() == encode(texts[index]) + [2]


def test_preprocessing_refuses_a_tiktoken_flag_for_another_tokenizer(spm_model, tmp_path,
                                                                     capsys):
    from megatron_dpp.data.preprocess_data import main

    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"text": TEXT}) + "\n")
    with pytest.raises(SystemExit) as exit_:
        main(["--input", str(corpus), "--output-prefix", str(tmp_path / "c"),
              "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", spm_model,
              "--tiktoken-num-special-tokens", "8", "--no-progress"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_.value.code == 2 and lines == [
        "error: --tiktoken-num-special-tokens is read by --tokenizer-type TikTokenizer only, not "
        "GPTSentencePieceTokenizer: remove it"], lines
    assert not list(tmp_path.glob("c_text_document*"))


def _train(entry: str, data_flags: list[str], *model_flags: str) -> str:
    rc, losses, _norms, out = run_training(
        [*model_flags, "--data-path", *data_flags, "--split", "98,2,0", "--train-iters", "6"],
        nproc=2, timeout=240, with_data=False, entry=entry)
    assert rc == 0, out[-3000:]
    assert len(losses) == 6 and losses[-1] < losses[0], (losses, out[-3000:])
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpt_trains_on_tiktoken_data(tik_vocab, tik_data):
    out = _train("megatron_dpp.pretrain_gpt",
                 [tik_data, "--tokenizer-type", "TikTokenizer", "--tokenizer-model", tik_vocab,
                  "--tiktoken-pattern", "v2", "--vocab-size", str(TIK_VOCAB),
                  "--tiktoken-num-special-tokens", str(NUM_SPECIAL)],
                 "--pipeline-model-parallel-size", "2")
    assert ("> TikTokenizer vocab (size: 512) padded with 0 dummy tokens (new size: 512)"
            in out), out[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_llama_trains_on_sentencepiece_data(spm_model, spm_data):
    out = _train("megatron_dpp.pretrain",
                 [spm_data, "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
                  spm_model], "--model", "llama")
    assert ("> GPTSentencePieceTokenizer vocab (size: 500) padded with 12 dummy tokens (new "
            "size: 512)" in out), out[-3000:]
