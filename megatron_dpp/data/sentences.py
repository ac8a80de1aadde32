"""A rule-based sentence splitter for English prose (BERT's sentence-order data), with no downloads.

Megatron-LM splits with NLTK's punkt model, which must be downloaded; these few rules do well
enough on documentation text:
- a blank line always ends a sentence (paragraphs, lists and code examples in docstrings);
- `.`, `!` or `?` (with any closing quotes or brackets after it) followed by whitespace ends a
  sentence, unless the next word starts with a lower-case letter;
- `.` does not end a sentence after a known abbreviation (e.g., i.e., Mr., ...), a single letter
  (`J. Smith`), dotted initials (`U.S.`) or a number that starts a line (a list marker, `1.`).
Each sentence is the exact text between two boundaries, stripped of surrounding whitespace.
"""
import re
from typing import List

# Abbreviations that never end a sentence in practice. "etc." is left out on purpose: followed by
# a capital letter it usually does end one.
ABBREVIATIONS = frozenset({"e.g", "i.e", "cf", "vs", "viz", "mr", "mrs", "ms", "dr", "prof", "st",
                           "jr", "sr", "no", "fig", "al", "approx"})

_PARAGRAPH_BREAK = re.compile(r"\n[ \t\r\f\v]*\n")
# Terminal punctuation with its closing quotes/brackets; the lookahead captures the next word's
# first character (group "next") past the whitespace.
_CANDIDATE_END = re.compile(r"[.!?]+[\"')\]]*(?=\s+(?P<next>\S))")
_DOTTED_INITIALS = re.compile(r"(?:[A-Za-z]\.)+[A-Za-z]")


def _word_start(text: str, end: int) -> int:
    """Where the whitespace-delimited word that ends at `end` starts."""
    start = end
    while start > 0 and not text[start - 1].isspace():
        start -= 1
    return start


def _starts_a_line(text: str, position: int) -> bool:
    line_start = text.rfind("\n", 0, position) + 1
    return not text[line_start:position].strip()


def _period_ends_sentence(text: str, period: int) -> bool:
    """Whether the period at text[period] ends a sentence (not after abbreviations and markers)."""
    start = _word_start(text, period)
    word = text[start:period].lstrip("\"'([")
    if not word or (len(word) == 1 and word.isalpha()):  # an initial ("J. Smith") or "a."
        return False
    if word.lower() in ABBREVIATIONS or _DOTTED_INITIALS.fullmatch(word):
        return False
    return not (word.isdigit() and _starts_a_line(text, start))  # a list marker ("1. First")


def _is_sentence_end(text: str, match: re.Match) -> bool:
    terminator = match.group()
    if match.group("next").islower():
        return False
    if terminator.startswith(("!", "?")) or terminator.startswith(".."):
        return True  # "!", "?" and ellipses are never abbreviations
    return _period_ends_sentence(text, match.start())


def _split_paragraph(paragraph: str) -> List[str]:
    sentences, start = [], 0
    for match in _CANDIDATE_END.finditer(paragraph):
        if _is_sentence_end(paragraph, match):
            sentences.append(paragraph[start:match.end()].strip())
            start = match.end()
    sentences.append(paragraph[start:].strip())
    return [s for s in sentences if s]


def split_sentences(text: str) -> List[str]:
    """The sentences of `text`, in order; an empty or all-whitespace text has none."""
    sentences: List[str] = []
    for paragraph in _PARAGRAPH_BREAK.split(text):
        sentences.extend(_split_paragraph(paragraph))
    return sentences
