"""A long-tailed corpus for the packed benchmarks: documents whose lengths follow a lognormal
distribution (the shape of web and code corpora: many short documents, a few long ones), written
as a Megatron indexed dataset beside the sample corpus, with the sample's tokenizer.

The sample corpus (stdlib docstrings) is short-document data: median 51 tokens, longest 1579, so a
2048-token window holds some twenty documents and per-document attention costs little in every
window. Long-context pretraining data is the other case: a window is one long document or many
short ones, and their attention differs (docs/scheduling.md, "The cost of a pack"). This corpus
is that case at CPU scale. Its tokens are the sample corpus's own token stream, cut into documents
of the drawn lengths, each ending in the end-of-document token, as preprocess_data.py
--append-eod writes them; so the tokenizer, the vocabulary and the data flags stay the sample's.

    python benchmarks/long_tailed_corpus.py --output-dir data/long_tailed --mean 512 --cv 1.5

writes DIR/long_tailed_text_document.{bin,idx} (deterministic: same flags, same bytes; an existing
one with the same settings is kept).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE_PREFIX = os.path.join(REPO, "data", "sample", "sample_text_document")
SAMPLE_VOCAB = os.path.join(REPO, "data", "sample", "vocab.json")
PREFIX_NAME = "long_tailed_text_document"
SETTINGS_NAME = "long_tailed_settings.json"  # what the dataset beside it was made with
EOD_TOKEN = "<|endoftext|>"  # GPT2BPETokenizer's end of document (the sample vocabulary has it)
DEFAULT_OUTPUT_DIR = os.path.join(REPO, "data", "long_tailed")
DEFAULT_PREFIX = os.path.join(DEFAULT_OUTPUT_DIR, PREFIX_NAME)
# The corpus's settings (write_corpus's keywords): this script's defaults, and the benchmarks'.
DEFAULTS = dict(documents=4000, mean=512.0, cv=1.5, longest=8192, seed=1234)


def lognormal_lengths(count: int, mean: float, cv: float, longest: int, seed: int) -> np.ndarray:
    """`count` lengths of a lognormal with that mean and coefficient of variation, rounded and
    clipped to 1..longest (the EOD token not counted)."""
    sigma = math.sqrt(math.log(1.0 + cv * cv))
    mu = math.log(mean) - sigma * sigma / 2.0
    drawn = np.random.default_rng(seed).lognormal(mu, sigma, size=count)
    return np.clip(np.rint(drawn), 1, longest).astype(np.int64)


def sample_token_stream(prefix: str, eod: int) -> np.ndarray:
    """The sample corpus's tokens in document order, its end-of-document tokens left out."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    stream = np.concatenate([np.asarray(dataset[i]) for i in range(len(dataset))])
    return stream[stream != eod]


def write_corpus(output_dir: str, documents: int, mean: float, cv: float, longest: int,
                 seed: int) -> str:
    """Write the corpus (unless one with these settings is there); returns its data prefix."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    settings = {"documents": documents, "mean": mean, "cv": cv, "longest": longest, "seed": seed,
                "tokens_from": os.path.basename(SAMPLE_PREFIX)}
    prefix = os.path.join(output_dir, PREFIX_NAME)
    settings_path = os.path.join(output_dir, SETTINGS_NAME)
    if all(os.path.isfile(prefix + ext) for ext in (".bin", ".idx")) and os.path.isfile(settings_path):
        with open(settings_path) as f:
            if json.load(f) == settings:
                return prefix
    with open(SAMPLE_VOCAB) as f:
        vocab = json.load(f)
    eod = vocab[EOD_TOKEN]
    stream = sample_token_stream(SAMPLE_PREFIX, eod)
    lengths = lognormal_lengths(documents, mean, cv, longest, seed)
    os.makedirs(output_dir, exist_ok=True)
    tmp = prefix + f".tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=DType.optimal_dtype(len(vocab)))
    position = 0
    for length in lengths:
        # The stream read cyclically from where the last document ended.
        indices = (position + np.arange(length)) % len(stream)
        position = int(indices[-1]) + 1
        builder.add_document(np.append(stream[indices], eod), [int(length) + 1])
    builder.finalize(tmp + ".idx")
    for ext in (".bin", ".idx"):
        os.replace(tmp + ext, prefix + ext)
    with open(settings_path + ".tmp", "w") as f:
        json.dump(settings, f)
    os.replace(settings_path + ".tmp", settings_path)
    return prefix


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR,
                        help="Where the dataset goes (default data/long_tailed).")
    parser.add_argument("--documents", type=int, default=DEFAULTS["documents"],
                        help="Documents (default %(default)s).")
    parser.add_argument("--mean", type=float, default=DEFAULTS["mean"],
                        help="Mean document length in tokens (default %(default)s).")
    parser.add_argument("--cv", type=float, default=DEFAULTS["cv"],
                        help="Coefficient of variation of the lengths (default %(default)s).")
    parser.add_argument("--longest", type=int, default=DEFAULTS["longest"],
                        help="Lengths are clipped to this many tokens (default %(default)s).")
    parser.add_argument("--seed", type=int, default=DEFAULTS["seed"],
                        help="Seed of the lengths (default %(default)s).")
    args = parser.parse_args(argv)
    if args.documents < 1 or args.mean < 1 or args.cv <= 0 or args.longest < 1:
        parser.error("--documents, --mean and --longest must be at least 1, --cv above 0")
    if not os.path.isfile(SAMPLE_PREFIX + ".idx"):
        parser.error(f"{SAMPLE_PREFIX}.idx is missing: run `python -m megatron_dpp.data.prepare_sample "
                     f"--output-dir data/sample` first (its tokens are this corpus's)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    prefix = write_corpus(args.output_dir, args.documents, args.mean, args.cv, args.longest, args.seed)
    print(f"long-tailed corpus: {prefix}.{{bin,idx}} ({args.documents} documents, lognormal mean "
          f"{args.mean:g} cv {args.cv:g}, at most {args.longest} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
