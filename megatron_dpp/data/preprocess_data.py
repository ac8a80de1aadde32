"""Tokenize a JSONL corpus into Megatron indexed datasets (`<prefix>_<key>_<level>.{bin,idx}`).

Same command line as Megatron-LM's tools/preprocess_data.py for what this project supports:
    python -m megatron_dpp.data.preprocess_data --input corpus.jsonl --output-prefix data/my \
        --vocab-file vocab.json --merge-file merges.txt --tokenizer-type GPT2BPETokenizer \
        --append-eod --workers 2
    python -m megatron_dpp.data.preprocess_data --input corpus.jsonl --output-prefix data/my_bert \
        --vocab-file bert-vocab.txt --tokenizer-type BertWordPieceLowerCase --split-sentences
    python -m megatron_dpp.data.preprocess_data --input corpus.jsonl --output-prefix data/my_llama \
        --tokenizer-type Llama2Tokenizer --tokenizer-model tokenizer.model --append-eod
    python -m megatron_dpp.data.preprocess_data --input corpus.jsonl --output-prefix data/my_llama3 \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model llama3-tokenizer/ --append-eod
    python -m megatron_dpp.data.preprocess_data --input corpus.jsonl --output-prefix data/my_spm \
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tokenizer.model --append-eod
    python -m megatron_dpp.data.preprocess_data --input corpus.jsonl --output-prefix data/my_tik \
        --tokenizer-type TikTokenizer --tokenizer-model vocab.json --tiktoken-pattern v2 \
        --vocab-size 131072 --append-eod
Each JSON line is one document. Without --split-sentences each document is stored as one sequence
(level "document"); with it, each sentence is one sequence and the dataset's document index marks
where each document's sentences end (level "sentence"), which is what BERT's dataset reads.
Outputs are written under temporary names and renamed at the end, so a failed run leaves no partial
dataset.
"""
import argparse
import json
import multiprocessing
import os
import sys
import warnings
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy

from megatron_dpp.data.errors import DataInputError, exit_with_input_error
from megatron_dpp.data.sentences import split_sentences as split_into_sentences
from megatron_dpp.data.tokenizer import (DEFAULT_TIKTOKEN_NUM_SPECIAL_TOKENS,
                                         DEFAULT_TIKTOKEN_VOCAB_SIZE, DEFAULT_TOKENIZER_TYPE,
                                         SUPPORTED_TOKENIZER_TYPES, TIKTOKEN, TIKTOKEN_PATTERNS,
                                         TIKTOKEN_SPECIAL_TOKENS, WORDPIECE_LOWER_CASE,
                                         ignored_tiktoken_pattern, tiktoken_options,
                                         tokenizer_from_files)

# --tiktoken-pattern where TikTokenizer is not given one: Megatron-LM's tools/preprocess_data.py
# builds its tokenizer through megatron.core's TikTokenTokenizer, whose default this is (its
# trainer, like ours, needs the flag).
PREPROCESS_TIKTOKEN_PATTERN = "v2"

DOCUMENTS_PER_TASK = 256  # documents tokenized per worker task: big enough to amortize IPC
BATCH_TIMEOUT_S = 300.0  # a worker that died loses its task; never wait for it forever


def output_prefix_for(output_prefix: str, key: str, split_sentences: bool = False) -> str:
    """Megatron's naming: `<output-prefix>_<json key>_document`, or `..._sentence` when split."""
    level = "sentence" if split_sentences else "document"
    return f"{output_prefix}_{key}_{level}"


def read_jsonl_batches(path: str, json_keys: Sequence[str],
                       batch_size: int) -> Iterator[Tuple[int, List[List[str]]]]:
    """Yield (bytes read so far, batch) where batch[i] holds one document's text per json key.

    Blank lines are skipped. A line that is not a JSON object, lacks a key, or whose value is not a
    string raises DataInputError naming the file and line.
    """
    batch: List[List[str]] = []
    bytes_read = 0
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            bytes_read += len(raw)
            if not raw.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as e:
                raise DataInputError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); each "
                                     f"line must be one JSON object like {{\"text\": \"...\"}}"
                                     ) from None
            except UnicodeDecodeError:
                raise DataInputError(f"{where}: not UTF-8 text; convert the file to UTF-8") from None
            if not isinstance(record, dict):
                raise DataInputError(f"{where}: expected a JSON object, got {type(record).__name__}")
            texts = []
            for key in json_keys:
                if key not in record:
                    raise DataInputError(f"{where}: missing key {key!r} (present: "
                                         f"{', '.join(map(repr, record)) or 'none'}); "
                                         f"pick the key with --json-keys")
                if not isinstance(record[key], str):
                    raise DataInputError(f"{where}: key {key!r} holds a "
                                         f"{type(record[key]).__name__}, expected a string")
                texts.append(record[key])
            batch.append(texts)
            if len(batch) == batch_size:
                yield bytes_read, batch
                batch = []
    if batch:
        yield bytes_read, batch


# Worker-process state: each worker loads the tokenizer once.
_worker_tokenizer = None
_worker_split_sentences = False


def _init_worker(tokenizer_type: str, vocab_file: Optional[str], merge_file: Optional[str],
                 tokenizer_model: Optional[str], split_sentences: bool,
                 tokenizer_options: Optional[dict] = None) -> None:
    """tokenizer_options: tokenizer_from_files' keyword arguments beyond the files."""
    global _worker_tokenizer, _worker_split_sentences
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism
    _worker_tokenizer = tokenizer_from_files(tokenizer_type, vocab_file, merge_file,
                                             tokenizer_model, **(tokenizer_options or {}))
    _worker_split_sentences = split_sentences


def _sequences_of(text: str) -> List[str]:
    """The texts stored as one sequence each: the sentences, or the whole document."""
    return split_into_sentences(text) if _worker_split_sentences else [text]


def _tokenize_task(task: Tuple[int, List[List[str]]]) -> Tuple[int, List[List[List[List[int]]]]]:
    """(bytes read, batch) -> (bytes read, for each document and json key its sequences' ids)."""
    bytes_read, batch = task
    texts = [text for document in batch for text in document]  # document-major, then key
    pieces = [_sequences_of(text) for text in texts]
    # One batch call for every sequence of the task: the tokenizer's per-call cost is paid once.
    ids = iter(_worker_tokenizer.tokenize_batch([p for per_text in pieces for p in per_text]))
    sequences = [[next(ids) for _ in per_text] for per_text in pieces]
    keys = len(batch[0])  # batches are never empty
    return bytes_read, [sequences[start:start + keys] for start in range(0, len(sequences), keys)]


def _document_sequences(sequences: List[List[int]], eod: Optional[int]) -> List[List[int]]:
    """The sequences to store for one document: empty ones dropped, `eod` (if any) ending the last.

    As in Megatron-LM, a document with no tokens gets no end-of-document token: it is skipped.
    """
    kept = [ids for ids in sequences if ids]
    if kept and eod is not None:
        kept[-1] = kept[-1] + [eod]
    return kept


def _with_timeout(imap_results, timeout_s: float):
    """Yield pool.imap results, failing if the next one takes longer than timeout_s."""
    while True:
        try:
            yield imap_results.next(timeout_s)
        except StopIteration:
            return
        except multiprocessing.TimeoutError:
            raise RuntimeError(f"waited {timeout_s:.0f}s for the next tokenized batch from the "
                               f"worker pool; a worker may have died (out of memory?)") from None


def _end_of_document_token(tokenizer, tokenizer_type: str, append_eod: bool) -> Optional[int]:
    """The token --append-eod appends, None without the flag; BERT's tokenizers have none."""
    if not append_eod:
        return None
    if tokenizer_type in WORDPIECE_LOWER_CASE:
        raise DataInputError(f"--append-eod: {tokenizer_type} has no end-of-document token; BERT's "
                             f"documents end where the dataset's document index says, so drop "
                             f"--append-eod")
    return tokenizer.eod


def preprocess_jsonl(input_path: str, output_prefix: str, vocab_file: Optional[str],
                     merge_file: Optional[str], json_keys: Sequence[str] = ("text",),
                     append_eod: bool = False, workers: int = 1, show_progress: bool = True,
                     tokenizer_type: str = DEFAULT_TOKENIZER_TYPE,
                     split_sentences: bool = False,
                     tokenizer_model: Optional[str] = None,
                     include_special_tokens: bool = False, vocab_size: Optional[int] = None,
                     tiktoken_pattern: Optional[str] = None,
                     tiktoken_num_special_tokens: Optional[int] = None,
                     tiktoken_special_tokens: Optional[Sequence[str]] = None) -> Dict[str, dict]:
    """Tokenize input_path into one indexed dataset per json key.

    The tokenizer's files: vocab_file and merge_file (GPT2BPETokenizer), vocab_file (WordPiece),
    tokenizer_model (Llama2Tokenizer's and GPTSentencePieceTokenizer's model file,
    HuggingFaceTokenizer's directory, TikTokenizer's JSON vocabulary); the others None.
    include_special_tokens: HuggingFaceTokenizer's (its BOS and the like in every sequence);
    vocab_size and the tiktoken_* values: TikTokenizer's (None: Megatron-LM's defaults; the
    pattern is required here). With split_sentences each
    sentence is one sequence. Returns {key: {"prefix", "documents", "sequences", "tokens",
    "skipped_empty"}}.
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tqdm import tqdm

    if not os.path.isfile(input_path):
        raise DataInputError(f"--input {input_path!r} does not exist")
    # Validates the files (and the flags) up front, before any output exists.
    tokenizer_options = dict(include_special_tokens=include_special_tokens, vocab_size=vocab_size,
                             tiktoken_pattern=tiktoken_pattern,
                             tiktoken_num_special_tokens=tiktoken_num_special_tokens,
                             tiktoken_special_tokens=tiktoken_special_tokens)
    tokenizer = tokenizer_from_files(tokenizer_type, vocab_file, merge_file, tokenizer_model,
                                     **tokenizer_options)
    eod = _end_of_document_token(tokenizer, tokenizer_type, append_eod)
    output_dir = os.path.dirname(os.path.abspath(output_prefix))
    if not os.path.isdir(output_dir):
        raise DataInputError(f"--output-prefix {output_prefix!r}: directory {output_dir!r} "
                             f"does not exist; create it first")

    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    tmp_tag = f".tmp{os.getpid()}"
    final = {key: output_prefix_for(output_prefix, key, split_sentences) for key in json_keys}
    tmp = {key: prefix + tmp_tag for key, prefix in final.items()}
    builders = {key: IndexedDatasetBuilder(tmp[key] + ".bin", dtype=dtype) for key in json_keys}
    stats = {key: {"prefix": final[key], "documents": 0, "sequences": 0, "tokens": 0,
                   "skipped_empty": 0} for key in json_keys}
    worker_args = (tokenizer_type, vocab_file, merge_file, tokenizer_model, split_sentences,
                   tokenizer_options)

    pool = None
    try:
        batches = read_jsonl_batches(input_path, json_keys, DOCUMENTS_PER_TASK)
        if workers > 1:
            # fork, as Megatron-LM's tool does: workers start in milliseconds instead of
            # re-importing torch; nothing in this process has started threads yet.
            pool = multiprocessing.get_context("fork").Pool(
                workers, initializer=_init_worker, initargs=worker_args)
            # Parsing runs in this process (so errors name the line); a parse error surfaces,
            # in order, while iterating the results. imap keeps the document order.
            results = _with_timeout(pool.imap(_tokenize_task, batches), BATCH_TIMEOUT_S)
        else:
            _init_worker(*worker_args)
            results = map(_tokenize_task, batches)

        total_bytes = os.path.getsize(input_path)
        with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing",
                  disable=not show_progress, file=sys.stderr) as bar:
            for bytes_read, documents in results:
                for per_key in documents:
                    for key, sequences in zip(json_keys, per_key):
                        sequences = _document_sequences(sequences, eod)
                        if not sequences:
                            stats[key]["skipped_empty"] += 1  # an empty document has no sample
                            continue
                        lengths = [len(ids) for ids in sequences]
                        tokens = numpy.fromiter((i for ids in sequences for i in ids),
                                                dtype=dtype, count=sum(lengths))
                        builders[key].add_document(tokens, lengths)
                        stats[key]["documents"] += 1
                        stats[key]["sequences"] += len(lengths)
                        stats[key]["tokens"] += sum(lengths)
                bar.update(bytes_read - bar.n)
        for key in json_keys:
            builders[key].finalize(tmp[key] + ".idx")
            # .idx last: a prefix whose .idx exists is complete.
            os.replace(tmp[key] + ".bin", final[key] + ".bin")
            os.replace(tmp[key] + ".idx", final[key] + ".idx")
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        for key in json_keys:
            builders[key].data_file.close()
            for suffix in (".bin", ".idx"):
                if os.path.exists(tmp[key] + suffix):
                    os.remove(tmp[key] + suffix)
    return stats


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="Path to the input JSONL file.")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="Keys to extract from each JSON line (default: text).")
    group.add_argument("--split-sentences", action="store_true",
                       help="Store each sentence as its own sequence, the document index marking "
                            "where each document's sentences end (what BERT's dataset needs). "
                            "Sentences are split by rules (megatron_dpp/data/sentences.py), "
                            "no model download. Output files are <prefix>_<key>_sentence.*.")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", default=DEFAULT_TOKENIZER_TYPE,
                       choices=SUPPORTED_TOKENIZER_TYPES,
                       help=f"Tokenizer to use (default {DEFAULT_TOKENIZER_TYPE}). "
                            f"GPT2BPETokenizer: byte-level BPE, needs --vocab-file vocab.json and "
                            f"--merge-file. BertWordPieceLowerCase (lower-cases, strips accents) "
                            f"and BertWordPieceCase (keeps case): BERT's WordPiece, need "
                            f"--vocab-file vocab.txt. Llama2Tokenizer: Llama 2's SentencePiece "
                            f"model, needs --tokenizer-model; each document starts with its BOS "
                            f"token, as in Megatron-LM. HuggingFaceTokenizer: a local Hugging "
                            f"Face tokenizer directory (e.g. Llama 3's), needs --tokenizer-model "
                            f"DIR and the transformers package; the ids are the tokenizer's "
                            f"without its special tokens (no BOS) unless "
                            f"--tokenizer-hf-include-special-tokens, as in Megatron-LM. "
                            f"GPTSentencePieceTokenizer: a SentencePiece model, needs "
                            f"--tokenizer-model; the model's ids, no BOS, as in Megatron-LM. "
                            f"TikTokenizer: a tiktoken vocabulary in Megatron-LM's JSON format, "
                            f"needs --tokenizer-model FILE.json and the tiktoken package; "
                            f"special tokens' ids first (--tiktoken-num-special-tokens).")
    group.add_argument("--vocab-file", default=None,
                       help="Path to vocab.json (GPT2BPETokenizer) or vocab.txt (WordPiece).")
    group.add_argument("--merge-file", default=None,
                       help="Path to merges.txt (GPT2BPETokenizer only).")
    group.add_argument("--tokenizer-model", default=None,
                       help="Path to the SentencePiece model, e.g. Llama 2's tokenizer.model "
                            "(Llama2Tokenizer, GPTSentencePieceTokenizer), or to a Hugging "
                            "Face tokenizer's directory, e.g. Llama 3's tokenizer.json and "
                            "tokenizer_config.json (HuggingFaceTokenizer), or to the tiktoken "
                            "vocabulary's JSON file (TikTokenizer); local files only, nothing is "
                            "downloaded.")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="TikTokenizer only: the vocabulary's size, special tokens included "
                            f"(default {DEFAULT_TIKTOKEN_VOCAB_SIZE}, Megatron-LM's): the "
                            "file's first N - --tiktoken-num-special-tokens tokens.")
    group.add_argument("--tiktoken-pattern", choices=tuple(TIKTOKEN_PATTERNS), default=None,
                       help="TikTokenizer's (another tokenizer ignores it, with a warning): "
                            "the expression that splits the text before BPE, "
                            "Megatron-LM's v1 or v2 (default "
                            f"{PREPROCESS_TIKTOKEN_PATTERN}, as Megatron-LM's "
                            "tools/preprocess_data.py; training needs it given).")
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=None, metavar="N",
                       help="TikTokenizer only: ids 0..N-1 are special tokens (default "
                            f"{DEFAULT_TIKTOKEN_NUM_SPECIAL_TOKENS}, Megatron-LM's).")
    group.add_argument("--tiktoken-special-tokens", nargs="+", default=None, metavar="TOKEN",
                       help="TikTokenizer only: the first special tokens, in id order (default "
                            f"{' '.join(TIKTOKEN_SPECIAL_TOKENS)}, which must be among them).")
    group.add_argument("--tokenizer-special-tokens", nargs="+", default=None, metavar="TOKEN",
                       help="Megatron-LM's newer name of --tiktoken-special-tokens: TikTokenizer "
                            "only; give one of the two.")
    group.add_argument("--tokenizer-hf-include-special-tokens", action="store_true",
                       help="HuggingFaceTokenizer only: tokenize with the tokenizer's special "
                            "tokens, e.g. Llama 3's <|begin_of_text|> first in every document "
                            "(Megatron-LM's flag; without it, none).")
    group.add_argument("--append-eod", action="store_true",
                       help="Append the end-of-document token to each document (<|endoftext|> "
                            "for GPT2BPETokenizer, the model's EOS for Llama2Tokenizer, the "
                            "eos_token of HuggingFaceTokenizer's tokenizer_config.json, the "
                            "model's EOS for GPTSentencePieceTokenizer, </s> for TikTokenizer; "
                            "not for "
                            "WordPiece; with --split-sentences, to its last sentence).")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="Output prefix; files are <prefix>_<key>_document.{bin,idx}, or "
                            "<prefix>_<key>_sentence.{bin,idx} with --split-sentences.")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1,
                       help="Number of worker processes that tokenize.")
    group.add_argument("--no-progress", action="store_true", help="Do not show a progress bar.")
    return parser


def _tiktoken_pattern(args: argparse.Namespace) -> Optional[str]:
    """--tiktoken-pattern, defaulted for TikTokenizer as Megatron-LM's tool defaults it."""
    if args.tiktoken_pattern is None and args.tokenizer_type == TIKTOKEN:
        return PREPROCESS_TIKTOKEN_PATTERN
    return args.tiktoken_pattern


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    # megatron.core warns on import that it falls back to torch kernels; irrelevant here.
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed")
    try:
        if args.workers < 1:
            raise DataInputError(f"--workers must be >= 1, got {args.workers}")
        ignored = ignored_tiktoken_pattern(args.tokenizer_type, args.tiktoken_pattern)
        if ignored is not None:
            print(f"warning: {ignored}", file=sys.stderr, flush=True)
        stats = preprocess_jsonl(args.input, args.output_prefix, args.vocab_file, args.merge_file,
                                 json_keys=args.json_keys, append_eod=args.append_eod,
                                 workers=args.workers, show_progress=not args.no_progress,
                                 tokenizer_type=args.tokenizer_type,
                                 split_sentences=args.split_sentences,
                                 tokenizer_model=args.tokenizer_model,
                                 include_special_tokens=args.tokenizer_hf_include_special_tokens,
                                 vocab_size=args.vocab_size,
                                 **{**tiktoken_options(args),
                                    "tiktoken_pattern": _tiktoken_pattern(args)})
    except DataInputError as e:
        exit_with_input_error(e)
    for key, s in stats.items():
        skipped = f", skipped {s['skipped_empty']} empty" if s["skipped_empty"] else ""
        sentences = f" ({s['sequences']} sentences)" if args.split_sentences else ""
        print(f"{key}: wrote {s['documents']} documents{sentences}, {s['tokens']} tokens to "
              f"{s['prefix']}.{{bin,idx}}{skipped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
