"""Make the sample corpus, tokenizer and indexed dataset on this machine, with no download.

    python -m megatron_dpp.data.prepare_sample --output-dir data

writes DIR/sample_corpus.jsonl (stdlib docstrings), and from it
- for GPT: DIR/vocab.json + DIR/merges.txt (byte-level BPE trained on it) and
  DIR/sample_text_document.{bin,idx} (one sequence per document);
- for BERT: DIR/bert-vocab.txt (lower-case WordPiece trained on it, for BertWordPieceLowerCase) and
  DIR/sample_bert_text_sentence.{bin,idx} (one sequence per sentence, grouped by document).
Idempotent: a step whose outputs exist is skipped, and once a step runs every step that reads its
output runs too (its input changed). Each output is written under a temporary name and renamed, so
an existing file is complete. A lock file makes concurrent runs on the same directory take turns.
"""
import argparse
import json
import os
import sys
import time
import warnings
from typing import Iterator, Optional, Sequence

from megatron_dpp.data.corpus import write_stdlib_corpus
from megatron_dpp.data.dir_lock import DirectoryLock
from megatron_dpp.data.errors import DataInputError, exit_with_input_error
from megatron_dpp.data.preprocess_data import output_prefix_for, preprocess_jsonl
from megatron_dpp.data.tokenizer import train_bpe_tokenizer, train_wordpiece_vocab

CORPUS_NAME = "sample_corpus.jsonl"
DATASET_PREFIX_NAME = "sample"  # -> sample_text_document.{bin,idx}, as Megatron names it
BERT_DATASET_PREFIX_NAME = "sample_bert"  # -> sample_bert_text_sentence.{bin,idx}
BERT_VOCAB_NAME = "bert-vocab.txt"
BERT_TOKENIZER_TYPE = "BertWordPieceLowerCase"  # the sample BERT vocabulary is lower case
DEFAULT_VOCAB_SIZE = 4096
DEFAULT_BERT_VOCAB_SIZE = 4096
# Room for the special tokens, the corpus's characters and their "##" forms.
MIN_BERT_VOCAB_SIZE = 256
LOCK_TIMEOUT_S = 300.0
LOCK_NAME = ".prepare_sample.lock"


def sample_paths(output_dir: str) -> dict:
    """Where each output of the sample preparation lives (the data prefixes have no extension).

    GPT: vocab_file, merge_file, data_prefix. BERT (--tokenizer-type BertWordPieceLowerCase):
    bert_vocab_file, bert_data_prefix.
    """
    return {
        "corpus": os.path.join(output_dir, CORPUS_NAME),
        "vocab_file": os.path.join(output_dir, "vocab.json"),
        "merge_file": os.path.join(output_dir, "merges.txt"),
        "data_prefix": output_prefix_for(os.path.join(output_dir, DATASET_PREFIX_NAME), "text"),
        "bert_vocab_file": os.path.join(output_dir, BERT_VOCAB_NAME),
        "bert_data_prefix": output_prefix_for(os.path.join(output_dir, BERT_DATASET_PREFIX_NAME),
                                              "text", split_sentences=True),
    }


def _dataset_exists(prefix: str) -> bool:
    return os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")


def _corpus_texts(corpus_path: str) -> Iterator[str]:
    with open(corpus_path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def _log(message: str) -> None:
    print(f"[prepare_sample] {message}", flush=True)


def _write_corpus(paths: dict, show_progress: bool) -> None:
    started = time.monotonic()
    last_shown = [0.0]

    def progress(done, total):
        now = time.monotonic()
        if show_progress and (now - last_shown[0] > 1.0 or done == total):
            last_shown[0] = now
            print(f"\r  {done}/{total} source files", end="\n" if done == total else "",
                  file=sys.stderr, flush=True)
    documents, characters = write_stdlib_corpus(paths["corpus"], progress)
    _log(f"  {documents} documents, {characters / 1e6:.1f} MB of text "
         f"in {time.monotonic() - started:.1f}s -> {paths['corpus']}")


def _train_bpe(paths: dict, output_dir: str, vocab_size: int) -> None:
    started = time.monotonic()
    train_bpe_tokenizer(_corpus_texts(paths["corpus"]), output_dir, vocab_size)
    _log(f"  done in {time.monotonic() - started:.1f}s -> {paths['vocab_file']}, "
         f"{paths['merge_file']}")


def _write_gpt_dataset(paths: dict, output_dir: str, workers: int, show_progress: bool) -> None:
    started = time.monotonic()
    stats = preprocess_jsonl(paths["corpus"], os.path.join(output_dir, DATASET_PREFIX_NAME),
                             paths["vocab_file"], paths["merge_file"], json_keys=["text"],
                             append_eod=True, workers=workers, show_progress=show_progress)
    s = stats["text"]
    _log(f"  {s['documents']} documents, {s['tokens']} tokens in "
         f"{time.monotonic() - started:.1f}s -> {paths['data_prefix']}.{{bin,idx}}")


def _train_wordpiece(paths: dict, vocab_size: int) -> None:
    started = time.monotonic()
    train_wordpiece_vocab(_corpus_texts(paths["corpus"]), paths["bert_vocab_file"], vocab_size,
                          lower_case=True)
    _log(f"  done in {time.monotonic() - started:.1f}s -> {paths['bert_vocab_file']}")


def _write_bert_dataset(paths: dict, output_dir: str, workers: int, show_progress: bool) -> None:
    started = time.monotonic()
    stats = preprocess_jsonl(paths["corpus"], os.path.join(output_dir, BERT_DATASET_PREFIX_NAME),
                             paths["bert_vocab_file"], None, json_keys=["text"], workers=workers,
                             show_progress=show_progress, tokenizer_type=BERT_TOKENIZER_TYPE,
                             split_sentences=True)
    s = stats["text"]
    _log(f"  {s['documents']} documents, {s['sequences']} sentences, {s['tokens']} tokens in "
         f"{time.monotonic() - started:.1f}s -> {paths['bert_data_prefix']}.{{bin,idx}}")


def prepare_sample(output_dir: str, vocab_size: int = DEFAULT_VOCAB_SIZE,
                   workers: int = 1, show_progress: bool = True,
                   bert_vocab_size: int = DEFAULT_BERT_VOCAB_SIZE) -> dict:
    """Make whatever of the sample data is missing under output_dir; returns sample_paths()."""
    os.makedirs(output_dir, exist_ok=True)
    paths = sample_paths(output_dir)
    with DirectoryLock(os.path.join(output_dir, LOCK_NAME), LOCK_TIMEOUT_S,
                       "another prepare_sample run", _log):
        # Each flag: whether the step's input was (re)made, so the step must run again.
        corpus_made = not os.path.isfile(paths["corpus"])
        if corpus_made:
            _log("step 1/5: writing the corpus from the Python standard library's docstrings")
            _write_corpus(paths, show_progress)
        else:
            _log(f"step 1/5: corpus exists: {paths['corpus']}")

        bpe_made = corpus_made or not (os.path.isfile(paths["vocab_file"])
                                       and os.path.isfile(paths["merge_file"]))
        if bpe_made:
            _log(f"step 2/5: training a byte-level BPE tokenizer (vocab {vocab_size})")
            _train_bpe(paths, output_dir, vocab_size)
        else:
            _log("step 2/5: tokenizer exists: vocab.json, merges.txt")

        if bpe_made or not _dataset_exists(paths["data_prefix"]):
            _log("step 3/5: tokenizing the corpus into an indexed dataset (GPT)")
            _write_gpt_dataset(paths, output_dir, workers, show_progress)
        else:
            _log(f"step 3/5: indexed dataset exists: {paths['data_prefix']}.{{bin,idx}}")

        wordpiece_made = corpus_made or not os.path.isfile(paths["bert_vocab_file"])
        if wordpiece_made:
            _log(f"step 4/5: training a lower-case WordPiece vocabulary for BERT "
                 f"(vocab {bert_vocab_size})")
            _train_wordpiece(paths, bert_vocab_size)
        else:
            _log(f"step 4/5: BERT vocabulary exists: {BERT_VOCAB_NAME}")

        if wordpiece_made or not _dataset_exists(paths["bert_data_prefix"]):
            _log("step 5/5: splitting the corpus into sentences and tokenizing them (BERT)")
            _write_bert_dataset(paths, output_dir, workers, show_progress)
        else:
            _log(f"step 5/5: BERT indexed dataset exists: {paths['bert_data_prefix']}.{{bin,idx}}")
    return paths


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True, help="Directory for the sample data.")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                        help=f"BPE vocabulary size (default {DEFAULT_VOCAB_SIZE}).")
    parser.add_argument("--bert-vocab-size", type=int, default=DEFAULT_BERT_VOCAB_SIZE,
                        help=f"BERT WordPiece vocabulary size (default {DEFAULT_BERT_VOCAB_SIZE}).")
    parser.add_argument("--workers", type=int, default=1,
                        help="Worker processes for tokenizing the corpus.")
    parser.add_argument("--no-progress", action="store_true", help="Do not show progress bars.")
    args = parser.parse_args(argv)
    # megatron.core warns on import that it falls back to torch kernels; irrelevant here.
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed")
    try:
        if args.vocab_size < 257:
            raise DataInputError(f"--vocab-size must be >= 257 (256 bytes + <|endoftext|>), "
                                 f"got {args.vocab_size}")
        if args.bert_vocab_size < MIN_BERT_VOCAB_SIZE:
            raise DataInputError(f"--bert-vocab-size must be >= {MIN_BERT_VOCAB_SIZE} (the "
                                 f"special tokens and the characters), got {args.bert_vocab_size}")
        if args.workers < 1:
            raise DataInputError(f"--workers must be >= 1, got {args.workers}")
        paths = prepare_sample(args.output_dir, args.vocab_size, args.workers,
                               show_progress=not args.no_progress,
                               bert_vocab_size=args.bert_vocab_size)
    except DataInputError as e:
        exit_with_input_error(e)
    _log(f"ready: --data-path {paths['data_prefix']} --vocab-file {paths['vocab_file']} "
         f"--merge-file {paths['merge_file']}")
    _log(f"ready for BERT: --data-path {paths['bert_data_prefix']} --tokenizer-type "
         f"{BERT_TOKENIZER_TYPE} --vocab-file {paths['bert_vocab_file']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
