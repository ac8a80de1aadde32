"""Sequence lengths of a batch with --variable-seq-lengths: the distribution the user gives, and
the padded length of each microbatch (Megatron's variable-length batches pad a microbatch to its
longest sequence; megatron_dpp/arguments.py, --variable-seq-lengths). With
--packed-document-distribution the same grammar gives document lengths instead: every microbatch
is micro-batch full windows of --seq-length tokens cut from one stream of those documents, attention
per document (`microbatch_documents`).

A distribution is written as one of
  uniform:MIN:MAX       lengths drawn uniformly from MIN..MAX (integers, inclusive)
  lognormal:MEAN:CV     lognormal lengths with that mean and coefficient of variation
  file:PATH             lengths read from PATH (whitespace-separated integers, e.g. one a line,
                        as measured on the dataset), drawn from with replacement
Every drawn sequence length is clipped to 1..--seq-length (a document length only to the tokens of
the whole batch: a long document runs on over several windows). Draws come from one seeded
generator, so a search is reproducible.
"""
from __future__ import annotations

import dataclasses
import math
import pathlib

import numpy as np

from megatron_dpp.search.errors import SearchInputError

DISTRIBUTION_KINDS = ("uniform", "lognormal", "file")
SAMPLE_SEED = 1234  # the generator's seed: one sampled batch per (micro-batch size, count)
SEQ_LENGTH_FLAG = "--seq-length-distribution"
PACKED_FLAG = "--packed-document-distribution"
DOCUMENT_DRAW = 256  # documents drawn at a time while windows are filled


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
    """Where sequence lengths come from."""

    spec: str  # what the user wrote (reported in the strategy)
    kind: str  # one of DISTRIBUTION_KINDS
    low: float = 0.0  # uniform: MIN; lognormal: MEAN
    high: float = 0.0  # uniform: MAX; lognormal: CV
    values: tuple[int, ...] = ()  # file: the lengths read

    def sample(self, count: int, seq_length: int, rng: np.random.Generator) -> np.ndarray:
        """`count` lengths, each clipped to 1..seq_length."""
        if self.kind == "uniform":
            drawn = rng.integers(int(self.low), int(self.high) + 1, size=count)
        elif self.kind == "lognormal":
            sigma = math.sqrt(math.log(1.0 + self.high ** 2))
            drawn = rng.lognormal(math.log(self.low) - sigma * sigma / 2.0, sigma, size=count)
        else:
            drawn = rng.choice(np.asarray(self.values), size=count, replace=True)
        return np.clip(np.rint(drawn), 1, seq_length).astype(int)


def parse_distribution(spec: str, flag: str = SEQ_LENGTH_FLAG) -> LengthDistribution:
    """Read a distribution as the module docstring writes it, given as `flag`; SearchInputError
    (one line, naming the flag) if bad."""
    kind, _, rest = spec.partition(":")
    usage = f"{flag} {spec!r}: expected uniform:MIN:MAX, lognormal:MEAN:CV or file:PATH"
    if kind not in DISTRIBUTION_KINDS or not rest:
        raise SearchInputError(usage)
    if kind == "file":
        path = pathlib.Path(rest)
        try:
            values = tuple(int(word) for word in path.read_text().split())
        except OSError as error:
            raise SearchInputError(f"{flag}: cannot read {path}: "
                                   f"{error.strerror}") from None
        except ValueError:
            raise SearchInputError(f"{flag}: {path} must hold whitespace-"
                                   "separated integer lengths") from None
        if not values or min(values) < 1:
            raise SearchInputError(f"{flag}: {path} needs at least one length, "
                                   "every one positive")
        return LengthDistribution(spec, kind, values=values)
    try:
        low, high = (float(part) for part in rest.split(":"))
    except ValueError:
        raise SearchInputError(usage) from None
    if kind == "uniform" and not 1 <= low <= high:
        raise SearchInputError(f"{flag} {spec!r}: needs 1 <= MIN <= MAX")
    if kind == "lognormal" and not (low >= 1 and high > 0):
        raise SearchInputError(f"{flag} {spec!r}: needs MEAN >= 1 and CV > 0")
    return LengthDistribution(spec, kind, low, high)


def microbatch_lengths(distribution: LengthDistribution | None, num_microbatches: int,
                       micro_batch_size: int, seq_length: int) -> list[int]:
    """The padded length of each microbatch of one pipeline's iteration: the longest of its
    micro_batch_size sequences; every microbatch is seq_length long without a distribution."""
    if distribution is None:
        return [seq_length] * num_microbatches
    rng = np.random.default_rng(SAMPLE_SEED)
    drawn = distribution.sample(num_microbatches * micro_batch_size, seq_length, rng)
    return drawn.reshape(num_microbatches, micro_batch_size).max(axis=1).tolist()


def microbatch_documents(distribution: LengthDistribution, num_microbatches: int,
                         micro_batch_size: int, seq_length: int,
                         seed: int = SAMPLE_SEED) -> list[tuple[int, ...]]:
    """--packed-document-distribution: the attention segments of each microbatch of one pipeline's
    iteration. Documents are drawn in order and concatenated, and the stream is cut into windows of
    seq_length tokens, as Megatron's GPT dataset builds its samples (a document that does not fit
    runs on in the next window; every window is full); a microbatch is micro_batch_size consecutive
    windows, and with --dataloader-inter-document-masking each piece of a document in a window is
    one attention segment. Seeded (`seed`), so a search is reproducible."""
    rng = np.random.default_rng(seed)
    count = num_microbatches * micro_batch_size
    windows: list[tuple[int, ...]] = []
    current: list[int] = []
    room = seq_length
    while len(windows) < count:
        for document in distribution.sample(DOCUMENT_DRAW, count * seq_length, rng).tolist():
            while document and len(windows) < count:
                piece = min(document, room)
                current.append(piece)
                document, room = document - piece, room - piece
                if room == 0:
                    windows.append(tuple(current))
                    current, room = [], seq_length
            if len(windows) == count:
                break
    return [sum(windows[index * micro_batch_size:(index + 1) * micro_batch_size], ())
            for index in range(num_microbatches)]
