"""Tokenize a JSONL corpus into Megatron indexed datasets (`<prefix>_<key>_document.{bin,idx}`).

Same command line as Megatron-LM's tools/preprocess_data.py for what this project supports:
    python -m megatron_dpp.data.preprocess_data --input corpus.jsonl --output-prefix data/my \
        --vocab-file vocab.json --merge-file merges.txt --tokenizer-type GPT2BPETokenizer \
        --append-eod --workers 2
Each JSON line is one document; each document is stored as one sequence. Outputs are written
under temporary names and renamed at the end, so a failed run leaves no partial dataset.
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
from megatron_dpp.data.tokenizer import SUPPORTED_TOKENIZER_TYPES, GPT2BPETokenizer

DOCUMENTS_PER_TASK = 256  # documents tokenized per worker task: big enough to amortize IPC
BATCH_TIMEOUT_S = 300.0  # a worker that died loses its task; never wait for it forever


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron's naming: `<output-prefix>_<json key>_document`."""
    return f"{output_prefix}_{key}_document"


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
_worker_tokenizer: Optional[GPT2BPETokenizer] = None


def _init_worker(vocab_file: str, merge_file: str) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism
    _worker_tokenizer = GPT2BPETokenizer(vocab_file, merge_file)


def _tokenize_task(task: Tuple[int, List[List[str]]]) -> Tuple[int, List[List[List[int]]]]:
    """(bytes read, batch) -> (bytes read, for each document the token ids per json key)."""
    bytes_read, batch = task
    columns = list(zip(*batch))
    ids_per_key = [_worker_tokenizer.tokenize_batch(column) for column in columns]
    return bytes_read, [list(per_doc) for per_doc in zip(*ids_per_key)]


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


def preprocess_jsonl(input_path: str, output_prefix: str, vocab_file: str, merge_file: str,
                     json_keys: Sequence[str] = ("text",), append_eod: bool = False,
                     workers: int = 1, show_progress: bool = True) -> Dict[str, dict]:
    """Tokenize input_path into one indexed dataset per json key.

    Returns {key: {"prefix", "documents", "tokens", "skipped_empty"}}.
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tqdm import tqdm

    if not os.path.isfile(input_path):
        raise DataInputError(f"--input {input_path!r} does not exist")
    tokenizer = GPT2BPETokenizer(vocab_file, merge_file)  # validates the files up front
    output_dir = os.path.dirname(os.path.abspath(output_prefix))
    if not os.path.isdir(output_dir):
        raise DataInputError(f"--output-prefix {output_prefix!r}: directory {output_dir!r} "
                             f"does not exist; create it first")

    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    tmp_tag = f".tmp{os.getpid()}"
    final = {key: output_prefix_for(output_prefix, key) for key in json_keys}
    tmp = {key: prefix + tmp_tag for key, prefix in final.items()}
    builders = {key: IndexedDatasetBuilder(tmp[key] + ".bin", dtype=dtype) for key in json_keys}
    stats = {key: {"prefix": final[key], "documents": 0, "tokens": 0, "skipped_empty": 0}
             for key in json_keys}

    pool = None
    try:
        batches = read_jsonl_batches(input_path, json_keys, DOCUMENTS_PER_TASK)
        if workers > 1:
            # fork, as Megatron-LM's tool does: workers start in milliseconds instead of
            # re-importing torch; nothing in this process has started threads yet.
            pool = multiprocessing.get_context("fork").Pool(
                workers, initializer=_init_worker, initargs=(vocab_file, merge_file))
            # Parsing runs in this process (so errors name the line); a parse error surfaces,
            # in order, while iterating the results. imap keeps the document order.
            results = _with_timeout(pool.imap(_tokenize_task, batches), BATCH_TIMEOUT_S)
        else:
            _init_worker(vocab_file, merge_file)
            results = map(_tokenize_task, batches)

        total_bytes = os.path.getsize(input_path)
        with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing",
                  disable=not show_progress, file=sys.stderr) as bar:
            for bytes_read, documents in results:
                for per_key in documents:
                    for key, ids in zip(json_keys, per_key):
                        if append_eod:
                            ids = ids + [tokenizer.eod]
                        if not ids:
                            stats[key]["skipped_empty"] += 1  # an empty sequence has no sample
                            continue
                        builders[key].add_document(numpy.asarray(ids, dtype=dtype), [len(ids)])
                        stats[key]["documents"] += 1
                        stats[key]["tokens"] += len(ids)
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
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", default="GPT2BPETokenizer",
                       choices=SUPPORTED_TOKENIZER_TYPES, help="Tokenizer to use.")
    group.add_argument("--vocab-file", required=True, help="Path to vocab.json.")
    group.add_argument("--merge-file", required=True, help="Path to merges.txt.")
    group.add_argument("--append-eod", action="store_true",
                       help="Append <|endoftext|> to the end of each document.")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="Output prefix; files are <prefix>_<key>_document.{bin,idx}.")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1,
                       help="Number of worker processes that tokenize.")
    group.add_argument("--no-progress", action="store_true", help="Do not show a progress bar.")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    # megatron.core warns on import that it falls back to torch kernels; irrelevant here.
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed")
    try:
        if args.workers < 1:
            raise DataInputError(f"--workers must be >= 1, got {args.workers}")
        stats = preprocess_jsonl(args.input, args.output_prefix, args.vocab_file, args.merge_file,
                                 json_keys=args.json_keys, append_eod=args.append_eod,
                                 workers=args.workers, show_progress=not args.no_progress)
    except DataInputError as e:
        exit_with_input_error(e)
    for key, s in stats.items():
        skipped = f", skipped {s['skipped_empty']} empty" if s["skipped_empty"] else ""
        print(f"{key}: wrote {s['documents']} documents, {s['tokens']} tokens to "
              f"{s['prefix']}.{{bin,idx}}{skipped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
