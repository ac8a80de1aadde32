"""The tokenizers, chosen by --tokenizer-type (Megatron-LM's names):

- GPT2BPETokenizer: GPT-2-style byte-level BPE over local vocab.json + merges.txt (`tokenizers`);
- BertWordPieceLowerCase / BertWordPieceCase: BERT's WordPiece over a local vocab.txt, with
  BERT's normalization (lower case and accents stripped, or case kept) and pre-tokenization
  (`tokenizers`);
- Llama2Tokenizer: Llama 2's SentencePiece model, a local tokenizer.model (`sentencepiece`);
- GPTSentencePieceTokenizer: any SentencePiece model for a GPT (`sentencepiece`): the model's ids
  without a BOS, its EOS the end-of-document token;
- HuggingFaceTokenizer: a local Hugging Face tokenizer directory (Llama 3's tokenizer.json and
  tokenizer_config.json, say), through `transformers`' AutoTokenizer as Megatron-LM reads it;
- TikTokenizer: a tiktoken BPE vocabulary in Megatron-LM's JSON format, a local .json file
  (`tiktoken`), special tokens first, with Megatron-LM's --tiktoken-* flags and --vocab-size;
- NullTokenizer (training only): no file, ids 0..N-1 with --vocab-size N and N as the
  end-of-document token, as Megatron-LM's; for --mock-data and data tokenized elsewhere.

These classes provide the interface Megatron-Core's datasets use (GPTDataset: vocab_size, eod,
tokenize, detokenize, unique_identifiers; BERTMaskedWordPieceDataset: also vocab, inv_vocab, cls,
sep, mask, pad). Which files each type reads is TOKENIZER_FILE_FLAGS, checked in one place
(check_tokenizer_files). Training a BPE or WordPiece tokenizer on a local corpus lives here too.
"""
import base64
import binascii
import json
import os
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Sequence

from megatron_dpp.data.errors import DataInputError

EOD_TOKEN = "<|endoftext|>"
GPT2_BPE = "GPT2BPETokenizer"
# WordPiece tokenizer type -> whether it lower-cases (and strips accents), as in Megatron-LM.
WORDPIECE_LOWER_CASE = {"BertWordPieceLowerCase": True, "BertWordPieceCase": False}
LLAMA2_SENTENCEPIECE = "Llama2Tokenizer"
HUGGINGFACE = "HuggingFaceTokenizer"
GPT_SENTENCEPIECE = "GPTSentencePieceTokenizer"
TIKTOKEN = "TikTokenizer"
SUPPORTED_TOKENIZER_TYPES = (GPT2_BPE, *WORDPIECE_LOWER_CASE, LLAMA2_SENTENCEPIECE,
                             GPT_SENTENCEPIECE, HUGGINGFACE, TIKTOKEN)
# Reads no file and tokenizes nothing (no preprocessing): for training only.
NULL_TOKENIZER = "NullTokenizer"
DEFAULT_TOKENIZER_TYPE = GPT2_BPE
# The files each tokenizer type reads: (flag, attribute of the parsed flags). A tokenizer-file flag
# that the type does not read is refused (it would do nothing).
TOKENIZER_FILE_FLAGS = {
    GPT2_BPE: (("--vocab-file", "vocab_file"), ("--merge-file", "merge_file")),
    **{name: (("--vocab-file", "vocab_file"),) for name in WORDPIECE_LOWER_CASE},
    LLAMA2_SENTENCEPIECE: (("--tokenizer-model", "tokenizer_model"),),
    GPT_SENTENCEPIECE: (("--tokenizer-model", "tokenizer_model"),),
    HUGGINGFACE: (("--tokenizer-model", "tokenizer_model"),),
    TIKTOKEN: (("--tokenizer-model", "tokenizer_model"),),
    NULL_TOKENIZER: (),
}
# The types whose --tokenizer-model is a directory, not a file, and what such a directory holds
# (AutoTokenizer needs one of them).
DIRECTORY_TOKENIZER_TYPES = (HUGGINGFACE,)
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# The transformers HuggingFaceTokenizer reads its directory with (an optional dependency: the
# tests' extra has it), said where it is missing.
TRANSFORMERS_REQUIREMENT = "transformers>=4.40,<6"
SENTENCEPIECE_REQUIREMENT = "sentencepiece>=0.2,<1"
TIKTOKEN_REQUIREMENT = "tiktoken>=0.7,<1"
# Megatron-LM's TikTokenizer: --tiktoken-pattern's regular expressions (the split of the text into
# pieces before BPE; v1 and v2 as megatron/training/tokenizer/tokenizer.py defines them, which
# tests/test_tiktoken_and_sentencepiece_tokenizers.py checks against megatron.core's), and its
# defaults: --vocab-size 2**17, --tiktoken-num-special-tokens 1000, and the special tokens that
# come first (ids 0, 1, 2: unknown, BOS, EOS) when --tiktoken-special-tokens names none; the
# remaining special ids are fillers named <SPECIAL_i>.
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
           r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
           r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
DEFAULT_TIKTOKEN_VOCAB_SIZE = 2 ** 17
DEFAULT_TIKTOKEN_NUM_SPECIAL_TOKENS = 1000
TIKTOKEN_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
TIKTOKEN_FILLER_TOKEN = "<SPECIAL_{}>"
TIKTOKEN_PAD_TOKEN = "<pad>"
# A TikTokenizer vocabulary's entries, in Megatron-LM's JSON file: a list of these objects, the
# i-th with rank i, its token's bytes in base64, the first 256 the single bytes 0..255.
TIKTOKEN_ENTRY_KEYS = ("rank", "token_bytes", "token_str")
# The flags only TikTokenizer reads: (flag, the parsed flags' attribute).
TIKTOKEN_FLAGS = (("--tiktoken-pattern", "tiktoken_pattern"),
                  ("--tiktoken-num-special-tokens", "tiktoken_num_special_tokens"),
                  ("--tiktoken-special-tokens", "tiktoken_special_tokens"))
_ALL_FILE_FLAGS = tuple(dict.fromkeys(flag for flags in TOKENIZER_FILE_FLAGS.values()
                                      for flag in flags))
# BERT's special tokens. [PAD] must be id 0: Megatron's BERT dataset pads the token types and the
# padding mask with the pad id, so only id 0 gives them their 0 meaning.
PAD_TOKEN, UNK_TOKEN, CLS_TOKEN, SEP_TOKEN, MASK_TOKEN = ("[PAD]", "[UNK]", "[CLS]", "[SEP]",
                                                        "[MASK]")
BERT_SPECIAL_TOKENS = (PAD_TOKEN, UNK_TOKEN, CLS_TOKEN, SEP_TOKEN, MASK_TOKEN)
WORDPIECE_PREFIX = "##"  # marks a piece that continues a word


class _EndOfDocument:
    """eod, and eos as Megatron-LM's tokenizers also name it, from the subclass's self._eod."""

    _eod: int

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod


class GPT2BPETokenizer(_EndOfDocument):
    """Byte-level BPE with `<|endoftext|>` as end-of-document; decode(encode(text)) == text."""

    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import ByteLevelBPETokenizer

        check_tokenizer_files(GPT2_BPE, {"vocab_file": vocab_file, "merge_file": merge_file})
        self._bpe = ByteLevelBPETokenizer.from_file(vocab_file, merge_file)
        self._vocab = self._bpe.get_vocab()
        if EOD_TOKEN not in self._vocab:
            raise DataInputError(f"--vocab-file {vocab_file!r} has no {EOD_TOKEN!r} token; a GPT-2 "
                                 f"vocabulary needs it as end-of-document")
        self._inv_vocab = {index: token for token, index in self._vocab.items()}
        self._eod = self._vocab[EOD_TOKEN]
        # GPTDataset hashes these into its index-cache file names (json.dumps of the config).
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("tokenizer_path", [vocab_file, merge_file])]
        )

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def vocab(self) -> dict:
        return self._vocab

    @property
    def inv_vocab(self) -> dict:
        return self._inv_vocab

    def tokenize(self, text: str) -> List[int]:
        return self._bpe.encode(text).ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [encoding.ids for encoding in self._bpe.encode_batch(list(texts))]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._bpe.decode([int(i) for i in ids], skip_special_tokens=False)


def vocab_size_with_padding(vocab_size: int, divisible_by: int, tensor_parallel_size: int) -> int:
    """Megatron's rule: pad the embedding rows to a multiple of divisible_by * TP size."""
    multiple = divisible_by * tensor_parallel_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


def check_padded_vocab_size(padded_vocab_size: Optional[int], tensor_parallel_size: int,
                            vocab_size: Optional[int] = None) -> None:
    """A given --padded-vocab-size (None: not given): positive, split evenly among the tensor-
    parallel ranks (the vocabulary-parallel embedding's rows), and, where the tokenizer's vocabulary
    is known (vocab_size), at least that. Raises DataInputError."""
    if padded_vocab_size is None:
        return
    if padded_vocab_size <= 0 or padded_vocab_size % tensor_parallel_size:
        raise DataInputError(f"--padded-vocab-size {padded_vocab_size} must be a positive "
                             f"multiple of --tensor-model-parallel-size {tensor_parallel_size}")
    if vocab_size is not None and padded_vocab_size < vocab_size:
        raise DataInputError(f"--padded-vocab-size {padded_vocab_size} is smaller than the "
                             f"tokenizer's vocabulary ({vocab_size} tokens): give at least "
                             f"{vocab_size}, or remove it to pad by "
                             f"--make-vocab-size-divisible-by")


def check_tokenizer_files(tokenizer_type: str, files: Dict[str, Optional[str]]) -> None:
    """Raises DataInputError, in one line, unless `files` ({attribute: path or None}, e.g.
    {"vocab_file": ..., "merge_file": ..., "tokenizer_model": ...}) gives every file that
    `tokenizer_type` reads, each an existing file, and none that it does not read."""
    if tokenizer_type not in TOKENIZER_FILE_FLAGS:
        raise DataInputError(f"--tokenizer-type {tokenizer_type} is not supported; "
                             f"use one of {', '.join(SUPPORTED_TOKENIZER_TYPES)}")
    reads = TOKENIZER_FILE_FLAGS[tokenizer_type]
    for flag, attribute in _ALL_FILE_FLAGS:
        path = files.get(attribute)
        if (flag, attribute) not in reads:
            if path is not None:
                reading = (f"it reads {' and '.join(f for f, _ in reads)}" if reads
                           else "it reads no file")
                raise DataInputError(f"{flag} is not read by --tokenizer-type {tokenizer_type} "
                                     f"({reading}): remove it")
        elif path is None:
            raise DataInputError(f"{flag} is required by {tokenizer_type}; "
                                 f"{_where_to_get(flag, tokenizer_type)}")
        elif tokenizer_type in DIRECTORY_TOKENIZER_TYPES:
            if not os.path.isdir(path):
                what = "is a file, not a directory" if os.path.isfile(path) else "does not exist"
                raise DataInputError(f"{flag} {path!r} {what}; "
                                     f"{_where_to_get(flag, tokenizer_type)}")
            if not any(os.path.isfile(os.path.join(path, name)) for name in HF_TOKENIZER_FILES):
                raise DataInputError(f"{flag} {path!r} holds neither "
                                     f"{' nor '.join(HF_TOKENIZER_FILES)}; "
                                     f"{_where_to_get(flag, tokenizer_type)}")
        elif not os.path.isfile(path):
            raise DataInputError(f"{flag} {path!r} does not exist; "
                                 f"{_where_to_get(flag, tokenizer_type)}")


def _where_to_get(flag: str, tokenizer_type: str) -> str:
    if tokenizer_type == HUGGINGFACE:
        return ("pass the local directory of a Hugging Face tokenizer (tokenizer.json and "
                "tokenizer_config.json; nothing is downloaded at run time), e.g. made by `hf "
                "download meta-llama/Meta-Llama-3-8B --include 'tokenizer*' --local-dir DIR`")
    if tokenizer_type == TIKTOKEN:
        return ("pass the tiktoken vocabulary the data was tokenized with, in Megatron-LM's JSON "
                "format (a list of {\"rank\", \"token_bytes\", \"token_str\"})")
    if tokenizer_type == GPT_SENTENCEPIECE:
        return "pass the SentencePiece model the data was tokenized with (a tokenizer.model)"
    if flag == "--tokenizer-model":
        return "pass the SentencePiece model the data was tokenized with (Llama 2's tokenizer.model)"
    return ("`python -m megatron_dpp.data.prepare_sample --output-dir DIR` makes GPT's and "
            "BERT's, or pass the right path")


def check_vocab_size(tokenizer_type: str, vocab_size: Optional[int]) -> None:
    """--vocab-size: NullTokenizer's vocabulary, which it needs, and TikTokenizer's (special tokens
    included; default 2**17, Megatron-LM's); no other tokenizer reads it."""
    if tokenizer_type == NULL_TOKENIZER:
        if vocab_size is None or vocab_size <= 0:
            raise DataInputError(f"--tokenizer-type {NULL_TOKENIZER} needs --vocab-size N > 0 "
                                 f"(token ids 0..N-1; N is the end-of-document token)")
    elif tokenizer_type == TIKTOKEN:
        if vocab_size is not None and vocab_size <= 0:
            raise DataInputError(f"--vocab-size must be > 0, got {vocab_size} (the {TIKTOKEN} "
                                 f"vocabulary's size, special tokens included)")
    elif vocab_size is not None:
        raise DataInputError(f"--vocab-size is read by --tokenizer-type {NULL_TOKENIZER} and "
                             f"{TIKTOKEN} only ({tokenizer_type} takes its vocabulary from its "
                             f"files): remove it")


def check_tiktoken_flags(tokenizer_type: str, tiktoken_pattern: Optional[str] = None,
                         tiktoken_num_special_tokens: Optional[int] = None,
                         tiktoken_special_tokens: Optional[Sequence[str]] = None) -> None:
    """--tiktoken-pattern, --tiktoken-num-special-tokens, --tiktoken-special-tokens: TikTokenizer's,
    and only its (None: not given); TikTokenizer needs the pattern. The pattern beside another
    tokenizer is ignored, as Megatron-LM ignores it (ignored_tiktoken_pattern: the warning). The
    values' own checks are TikTokenizer's (with the vocabulary size they depend on)."""
    given = {"tiktoken_pattern": tiktoken_pattern,
             "tiktoken_num_special_tokens": tiktoken_num_special_tokens,
             "tiktoken_special_tokens": tiktoken_special_tokens}
    if tokenizer_type != TIKTOKEN:
        for flag, attribute in TIKTOKEN_FLAGS:
            if given[attribute] is not None and attribute != "tiktoken_pattern":
                raise DataInputError(f"{flag} is read by --tokenizer-type {TIKTOKEN} only, not "
                                     f"{tokenizer_type}: remove it")
    elif tiktoken_pattern is None:
        raise DataInputError(f"--tokenizer-type {TIKTOKEN} needs --tiktoken-pattern v1 or v2 (the "
                             f"expression that splits the text before BPE, the one the vocabulary "
                             f"was made with), as Megatron-LM does")
    elif tiktoken_pattern not in TIKTOKEN_PATTERNS:
        raise DataInputError(f"--tiktoken-pattern {tiktoken_pattern!r} is not one of "
                             f"{', '.join(TIKTOKEN_PATTERNS)}")


def ignored_tiktoken_pattern(tokenizer_type: Optional[str],
                             tiktoken_pattern: Optional[str]) -> Optional[str]:
    """The warning (one line) for --tiktoken-pattern beside a tokenizer other than TikTokenizer,
    which alone reads it: Megatron-LM ignores it there (its Llama 3 script passes --tiktoken-pattern
    v2 with NullTokenizer). None where there is nothing to say."""
    tokenizer_type = tokenizer_type or DEFAULT_TOKENIZER_TYPE
    if tiktoken_pattern is None or tokenizer_type == TIKTOKEN:
        return None
    return (f"--tiktoken-pattern {tiktoken_pattern} is read by --tokenizer-type {TIKTOKEN} only: "
            f"{tokenizer_type} ignores it, as in Megatron-LM")


# The tokenizer types whose files the flag check reads through (check_tokenizer_args): loading
# them takes a fraction of a second, so a wrong file is one line before any rank starts.
TOKENIZERS_OPENED_BY_THE_FLAG_CHECK = (GPT_SENTENCEPIECE, TIKTOKEN)


def tiktoken_options(args) -> dict:
    """The parsed flags' TikTokenizer values (None where absent), as tokenizer_from_files takes
    them; --tokenizer-special-tokens (Megatron-LM's newer name of --tiktoken-special-tokens,
    which its trainer copies there) gives the special tokens too: DataInputError where both
    are given, or where args.tokenizer_type is another tokenizer's."""
    options = {attribute: getattr(args, attribute, None) for _, attribute in TIKTOKEN_FLAGS}
    newer = getattr(args, "tokenizer_special_tokens", None)
    if newer is not None:
        tokenizer_type = getattr(args, "tokenizer_type", None) or DEFAULT_TOKENIZER_TYPE
        if tokenizer_type != TIKTOKEN:
            raise DataInputError(f"--tokenizer-special-tokens is read by --tokenizer-type "
                                 f"{TIKTOKEN} only here (its special tokens, as Megatron-LM's "
                                 f"trainer reads it), not {tokenizer_type}: remove it")
        if options["tiktoken_special_tokens"] is not None:
            raise DataInputError("--tiktoken-special-tokens is Megatron-LM's older name of "
                                 "--tokenizer-special-tokens: give one of the two")
        options["tiktoken_special_tokens"] = newer
    return options


def check_tokenizer_args(tokenizer_type: str, args) -> None:
    """The tokenizer flags beyond the files' existence (check_tokenizer_files) and --vocab-size
    (check_vocab_size): the TikTokenizer flags (check_tiktoken_flags), and for the types in
    TOKENIZERS_OPENED_BY_THE_FLAG_CHECK the file itself, read as the trainer will read it.
    Raises DataInputError."""
    check_tiktoken_flags(tokenizer_type, **tiktoken_options(args))
    if tokenizer_type in TOKENIZERS_OPENED_BY_THE_FLAG_CHECK:
        tokenizer_from_files(tokenizer_type, getattr(args, "vocab_file", None),
                             getattr(args, "merge_file", None),
                             getattr(args, "tokenizer_model", None),
                             getattr(args, "vocab_size", None), **tiktoken_options(args))


def check_include_special_tokens(tokenizer_type: str, include_special_tokens: bool) -> None:
    """--tokenizer-hf-include-special-tokens: HuggingFaceTokenizer's, and only its."""
    if include_special_tokens and tokenizer_type != HUGGINGFACE:
        raise DataInputError(f"--tokenizer-hf-include-special-tokens is read by --tokenizer-type "
                             f"{HUGGINGFACE} only, not {tokenizer_type}: remove it")


def tokenizer_from_files(tokenizer_type: str, vocab_file: Optional[str] = None,
                         merge_file: Optional[str] = None, tokenizer_model: Optional[str] = None,
                         vocab_size: Optional[int] = None, include_special_tokens: bool = False,
                         tiktoken_pattern: Optional[str] = None,
                         tiktoken_num_special_tokens: Optional[int] = None,
                         tiktoken_special_tokens: Optional[Sequence[str]] = None):
    """The tokenizer of `tokenizer_type` over its files (TOKENIZER_FILE_FLAGS says which it reads;
    the others must be None); vocab_size: NullTokenizer's and TikTokenizer's, and only theirs;
    include_special_tokens: HuggingFaceTokenizer's, and only its; the tiktoken_* values (None: not
    given): TikTokenizer's, and only its."""
    check_tokenizer_files(tokenizer_type, {"vocab_file": vocab_file, "merge_file": merge_file,
                                           "tokenizer_model": tokenizer_model})
    check_vocab_size(tokenizer_type, vocab_size)
    check_include_special_tokens(tokenizer_type, include_special_tokens)
    check_tiktoken_flags(tokenizer_type, tiktoken_pattern, tiktoken_num_special_tokens,
                         tiktoken_special_tokens)
    if tokenizer_type == NULL_TOKENIZER:
        return NullTokenizer(vocab_size)
    if tokenizer_type == HUGGINGFACE:
        return HuggingFaceTokenizer(tokenizer_model, include_special_tokens)
    if tokenizer_type == TIKTOKEN:
        return TikTokenizer(tokenizer_model, tiktoken_pattern, vocab_size,
                            tiktoken_num_special_tokens, tiktoken_special_tokens)
    if tokenizer_type == GPT_SENTENCEPIECE:
        return GPTSentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == GPT2_BPE:
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type in WORDPIECE_LOWER_CASE:
        return BertWordPieceTokenizer(vocab_file, lower_case=WORDPIECE_LOWER_CASE[tokenizer_type])
    return Llama2Tokenizer(tokenizer_model)


def build_tokenizer(args):
    """Build the tokenizer named by --tokenizer-type; sets args.padded_vocab_size like Megatron-LM.

    Reads args.tokenizer_type (None or absent: GPT2BPETokenizer), its files (args.vocab_file,
    args.merge_file, args.tokenizer_model: TOKENIZER_FILE_FLAGS; NullTokenizer's and
    TikTokenizer's args.vocab_size; TikTokenizer's args.tiktoken_pattern,
    args.tiktoken_num_special_tokens, args.tiktoken_special_tokens),
    args.make_vocab_size_divisible_by (default 128) and args.tensor_model_parallel_size
    (default 1); a given args.padded_vocab_size (--padded-vocab-size) is used as it is, as
    Megatron-LM's build_tokenizer does, once checked against the vocabulary.
    """
    tokenizer_type = getattr(args, "tokenizer_type", None) or DEFAULT_TOKENIZER_TYPE
    tokenizer = tokenizer_from_files(tokenizer_type, getattr(args, "vocab_file", None),
                                     getattr(args, "merge_file", None),
                                     getattr(args, "tokenizer_model", None),
                                     getattr(args, "vocab_size", None), **tiktoken_options(args))
    given = getattr(args, "padded_vocab_size", None)
    if given is not None:
        check_padded_vocab_size(given, getattr(args, "tensor_model_parallel_size", 1),
                                tokenizer.vocab_size)
        return tokenizer
    args.padded_vocab_size = vocab_size_with_padding(
        tokenizer.vocab_size,
        getattr(args, "make_vocab_size_divisible_by", 128),
        getattr(args, "tensor_model_parallel_size", 1),
    )
    return tokenizer


class NullTokenizer(_EndOfDocument):
    """Megatron-LM's NullTokenizer: a text is its space-separated token ids; ids 0..N-1 with
    --vocab-size N, and N the end-of-document token, so the vocabulary is N + 1."""

    def __init__(self, vocab_size: int):
        self._eod = int(vocab_size)
        # GPTDataset hashes these into its index-cache file names.
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("vocab_size", self._eod)])

    @property
    def vocab_size(self) -> int:
        return self._eod + 1

    def tokenize(self, text: str) -> List[int]:
        return [int(word) for word in text.split()]

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def _sentencepiece_model(tokenizer_type: str, model_file: str):
    """model_file through sentencepiece's SentencePieceProcessor; DataInputError (one line) when
    the package is missing or the file is not a SentencePiece model."""
    try:
        import sentencepiece
    except ImportError:
        raise DataInputError(f"--tokenizer-type {tokenizer_type} needs the sentencepiece "
                             f"package: pip install '{SENTENCEPIECE_REQUIREMENT}'") from None
    try:
        return sentencepiece.SentencePieceProcessor(model_file=model_file)
    except (OSError, RuntimeError) as error:
        raise DataInputError(f"--tokenizer-model {model_file!r} is not a SentencePiece model: "
                             f"{str(error).splitlines()[0]}") from None


class _SentencePieceVocabulary:
    """The vocabulary of a SentencePiece model in self._model (self._vocab: None until read)."""

    @property
    def vocab_size(self) -> int:
        return self._model.vocab_size()

    @property
    def vocab(self) -> Dict[str, int]:
        if self._vocab is None:
            self._vocab = {self._model.id_to_piece(i): i for i in range(self.vocab_size)}
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return {index: piece for piece, index in self.vocab.items()}


class Llama2Tokenizer(_SentencePieceVocabulary):
    """Llama 2's SentencePiece model as Megatron-LM's Llama2Tokenizer reads it: a document's tokens
    start with the model's BOS id, its EOS id is the end-of-document token (what --append-eod
    appends, and eod for the dataset's masks), and the vocabulary is the model's pieces."""

    def __init__(self, model_file: str):
        self._model = _sentencepiece_model(LLAMA2_SENTENCEPIECE, model_file)
        self._bos, self._eos = self._model.bos_id(), self._model.eos_id()
        if self._bos < 0 or self._eos < 0:
            raise DataInputError(f"--tokenizer-model {model_file!r} has no "
                                 f"{'BOS' if self._bos < 0 else 'EOS'} piece; Llama 2's model "
                                 f"has both (<s> and </s>)")
        self._vocab: Optional[Dict[str, int]] = None
        # GPTDataset hashes these into its index-cache file names (json.dumps of the config).
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("tokenizer_path", [model_file])])

    @property
    def bos(self) -> int:
        return self._bos

    @property
    def eos(self) -> int:
        return self._eos

    @property
    def eod(self) -> int:
        return self._eos

    @property
    def pad(self) -> int:
        return self._model.pad_id()  # -1 in Llama 2's model: it has no padding piece

    def tokenize(self, text: str) -> List[int]:
        return [self._bos] + self._model.encode(text)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [[self._bos] + ids for ids in self._model.encode(list(texts))]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._model.decode([int(i) for i in ids])


class GPTSentencePieceTokenizer(_SentencePieceVocabulary, _EndOfDocument):
    """A SentencePiece model as Megatron-LM's GPTSentencePieceTokenizer reads it: a text's ids are
    the model's own (no BOS, no EOS added), its EOS id is the end-of-document token (what
    --append-eod appends, and eod for the dataset's masks), bos and pad are the model's ids (-1
    where it has none: the dataset then masks no padding), and the vocabulary is the model's
    pieces."""

    def __init__(self, model_file: str):
        self._model = _sentencepiece_model(GPT_SENTENCEPIECE, model_file)
        self._eod = self._model.eos_id()  # eod and eos: _EndOfDocument
        if self._eod < 0:
            raise DataInputError(f"--tokenizer-model {model_file!r} has no EOS piece; "
                                 f"{GPT_SENTENCEPIECE} takes it as the end-of-document token")
        self._vocab: Optional[Dict[str, int]] = None
        # GPTDataset hashes these into its index-cache file names (json.dumps of the config).
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("tokenizer_path", [model_file])])

    @property
    def bos(self) -> int:
        return self._model.bos_id()

    @property
    def pad(self) -> int:
        return self._model.pad_id()

    def tokenize(self, text: str) -> List[int]:
        return self._model.encode(text)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self._model.encode(list(texts))

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._model.decode([int(i) for i in ids])


class HuggingFaceTokenizer(_EndOfDocument):
    """A local Hugging Face tokenizer directory through `transformers`' AutoTokenizer, as
    Megatron-LM 0.16's HuggingFaceTokenizer reads it: the vocabulary is len(tokenizer) (its added
    tokens included), the end-of-document token is its eos_token (what --append-eod appends, and
    eod for the dataset's masks), and a text's ids are the tokenizer's without its special tokens
    (no BOS), or with them (Llama 3's <|begin_of_text|> first) under include_special_tokens,
    Megatron-LM's --tokenizer-hf-include-special-tokens. Only local files are read
    (local_files_only): a Hub name is not fetched."""

    def __init__(self, directory: str, include_special_tokens: bool = False):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise DataInputError(f"--tokenizer-type {HUGGINGFACE} needs the transformers package: "
                                 f"pip install '{TRANSFORMERS_REQUIREMENT}'") from None
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as error:
            first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise DataInputError(f"--tokenizer-model {directory!r} is not a Hugging Face "
                                 f"tokenizer directory (tokenizer.json, tokenizer_config.json): "
                                 f"{first_line}") from None
        self._eod = self._tokenizer.eos_token_id  # eod and eos: _EndOfDocument
        if self._eod is None:
            raise DataInputError(f"--tokenizer-model {directory!r} names no eos_token (in its "
                                 f"tokenizer_config.json); {HUGGINGFACE} takes it as the "
                                 f"end-of-document token")
        self.include_special_tokens = bool(include_special_tokens)
        self._vocab: Optional[Dict[str, int]] = None
        # GPTDataset hashes these into its index-cache file names (json.dumps of the config).
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("tokenizer_path", [directory]),
             ("include_special_tokens", self.include_special_tokens)])

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    @property
    def vocab(self) -> Dict[str, int]:
        if self._vocab is None:
            self._vocab = self._tokenizer.get_vocab()
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return {index: token for token, index in self.vocab.items()}

    @property
    def bos(self) -> Optional[int]:
        return self._tokenizer.bos_token_id

    @property
    def pad(self) -> Optional[int]:
        return self._tokenizer.pad_token_id

    def tokenize(self, text: str) -> List[int]:
        return self.tokenize_batch([text])[0]

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        encoded = self._tokenizer(list(texts), add_special_tokens=self.include_special_tokens,
                                  verbose=False)
        return [list(ids) for ids in encoded["input_ids"]]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids])


def read_tiktoken_vocabulary(path: str, size: int, first_id: int) -> Dict[bytes, int]:
    """The first `size` tokens of a tiktoken vocabulary in Megatron-LM's JSON format (a list whose
    i-th entry is {"rank": i, "token_bytes": base64 of the token's bytes, "token_str": ...}, the
    first 256 the single bytes 0..255), as tiktoken's mergeable ranks {token bytes: id}, the ids
    from first_id on (after the special tokens). Raises DataInputError, in one line, for anything
    else."""
    where = f"--tokenizer-model {path!r}"
    what = (f"{TIKTOKEN} reads Megatron-LM's tiktoken vocabulary: a JSON list of "
            f"{{\"rank\": i, \"token_bytes\": base64, \"token_str\": ...}}")
    if not path.endswith(".json"):
        raise DataInputError(f"{where} is not a .json file; {what}")
    try:
        with open(path, encoding="utf-8") as handle:
            entries = json.load(handle)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        reason = f"{error.msg} at line {error.lineno}" if isinstance(
            error, json.JSONDecodeError) else "not UTF-8 text"
        raise DataInputError(f"{where} is not JSON ({reason}); {what}") from None
    if not isinstance(entries, list):
        raise DataInputError(f"{where} holds a JSON {type(entries).__name__}, not a list; {what}")
    if len(entries) < size:
        raise DataInputError(f"{where} holds {len(entries)} tokens, fewer than the {size} that "
                             f"--vocab-size {size + first_id} less --tiktoken-num-special-tokens "
                             f"{first_id} needs; pass --vocab-size {len(entries) + first_id} "
                             f"(its default, Megatron-LM's, is {DEFAULT_TIKTOKEN_VOCAB_SIZE})")
    ranks: Dict[bytes, int] = {}
    for index, entry in enumerate(entries[:size]):
        if not isinstance(entry, dict) or set(entry) != set(TIKTOKEN_ENTRY_KEYS):
            raise DataInputError(f"{where} entry {index} is not an object with exactly the keys "
                                 f"{', '.join(TIKTOKEN_ENTRY_KEYS)}; {what}")
        if entry["rank"] != index:
            raise DataInputError(f"{where} entry {index} has rank {entry['rank']!r}; the i-th "
                                 f"entry has rank i")
        try:
            token = base64.b64decode(entry["token_bytes"], validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise DataInputError(f"{where} entry {index}: token_bytes is not base64") from None
        if index < 256 and token != bytes([index]):
            raise DataInputError(f"{where} entry {index} is {token!r}, not the byte {index}; the "
                                 f"first 256 entries are the single bytes 0..255 in order")
        if token in ranks:
            raise DataInputError(f"{where} entry {index} repeats the token of entry "
                                 f"{ranks[token] - first_id} ({token!r})")
        ranks[token] = index + first_id
    return ranks


class TikTokenizer(_EndOfDocument):
    """A tiktoken BPE vocabulary in Megatron-LM's JSON format as Megatron-LM's TikTokenizer reads
    it: the ids 0..num_special_tokens-1 are the special tokens (special_tokens, default <unk> <s>
    </s>, then <SPECIAL_i> fillers), the file's first vocab_size - num_special_tokens tokens
    follow in rank order; a text's ids are tiktoken's ordinary encoding with --tiktoken-pattern's
    expression (no BOS added; special tokens' text in a document is ordinary text), the EOS </s>
    is the end-of-document token (what --append-eod appends, and eod for the dataset's masks),
    and the vocabulary is vocab_size (default 2**17). pad: the <pad> special token's id when
    special_tokens names one, else -1 (the dataset masks no padding)."""

    def __init__(self, path: str, pattern: str, vocab_size: Optional[int] = None,
                 num_special_tokens: Optional[int] = None,
                 special_tokens: Optional[Sequence[str]] = None):
        try:
            import tiktoken
        except ImportError:
            raise DataInputError(f"--tokenizer-type {TIKTOKEN} needs the tiktoken package: pip "
                                 f"install '{TIKTOKEN_REQUIREMENT}'") from None
        check_tiktoken_flags(TIKTOKEN, pattern)
        vocab_size = DEFAULT_TIKTOKEN_VOCAB_SIZE if vocab_size is None else int(vocab_size)
        num_special_tokens = (DEFAULT_TIKTOKEN_NUM_SPECIAL_TOKENS if num_special_tokens is None
                              else int(num_special_tokens))
        named = list(TIKTOKEN_SPECIAL_TOKENS if special_tokens is None else special_tokens)
        repeated = sorted({token for token in named if named.count(token) > 1})
        if repeated:
            raise DataInputError(f"--tiktoken-special-tokens names {repeated[0]!r} more than once")
        missing = [token for token in TIKTOKEN_SPECIAL_TOKENS if token not in named]
        if missing:
            raise DataInputError(f"--tiktoken-special-tokens lacks {' '.join(missing)}; "
                                 f"{TIKTOKEN} needs {' '.join(TIKTOKEN_SPECIAL_TOKENS)} among them "
                                 f"(unknown, BOS, EOS)")
        if not len(named) <= num_special_tokens < vocab_size:
            raise DataInputError(f"--tiktoken-num-special-tokens {num_special_tokens} must be at "
                                 f"least the {len(named)} special tokens and less than "
                                 f"--vocab-size {vocab_size}")
        inner_size = vocab_size - num_special_tokens
        if inner_size < 256:
            raise DataInputError(f"--vocab-size {vocab_size} less --tiktoken-num-special-tokens "
                                 f"{num_special_tokens} leaves {inner_size} tokens; a tiktoken "
                                 f"vocabulary starts with the 256 single bytes")
        ranks = read_tiktoken_vocabulary(path, inner_size, first_id=num_special_tokens)
        names = named + [TIKTOKEN_FILLER_TOKEN.format(i)
                         for i in range(len(named), num_special_tokens)]
        fillers = set(names[len(named):]) & set(named)
        if fillers:
            raise DataInputError(f"--tiktoken-special-tokens names {sorted(fillers)[0]!r}, the "
                                 f"name of a filler special token; rename it")
        self._special = {name: index for index, name in enumerate(names)}
        self._model = tiktoken.Encoding(name=os.path.splitext(os.path.basename(path))[0],
                                        pat_str=TIKTOKEN_PATTERNS[pattern],
                                        mergeable_ranks=ranks, special_tokens=self._special)
        self._ranks = ranks
        self._vocab_size = vocab_size
        self.num_special_tokens = num_special_tokens
        self._eod = self._special["</s>"]  # eod and eos: _EndOfDocument
        self._vocab: Optional[Dict] = None
        # GPTDataset hashes these into its index-cache file names (json.dumps of the config).
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("tokenizer_path", [path]), ("pattern", pattern),
             ("vocab_size", vocab_size), ("num_special_tokens", num_special_tokens),
             ("special_tokens", named)])

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def vocab(self) -> Dict:
        """{token bytes, or a special token's name: id}, as Megatron-LM's TikTokenizer has it."""
        if self._vocab is None:
            self._vocab = {**self._ranks, **self._special}
        return self._vocab

    @property
    def inv_vocab(self) -> Dict:
        return {index: token for token, index in self.vocab.items()}

    @property
    def bos(self) -> int:
        return self._special["<s>"]

    @property
    def unk(self) -> int:
        return self._special["<unk>"]

    @property
    def pad(self) -> int:
        return self._special.get(TIKTOKEN_PAD_TOKEN, -1)

    def tokenize(self, text: str) -> List[int]:
        return self._model.encode_ordinary(text)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [self._model.encode_ordinary(text) for text in texts]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._model.decode([int(i) for i in ids])


def train_bpe_tokenizer(texts: Iterable[str], output_dir: str, vocab_size: int) -> None:
    """Train a byte-level BPE on `texts`; writes output_dir/vocab.json and output_dir/merges.txt.

    The files are written under temporary names and renamed, so a crash never leaves half a
    tokenizer behind that a later run would take as finished.
    """
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2,
                            show_progress=False, special_tokens=[EOD_TOKEN])
    tmp_prefix = f"tmp{os.getpid()}"
    vocab_tmp, merges_tmp = bpe.save_model(output_dir, tmp_prefix)
    # Re-serialize the vocabulary with sorted keys so the file bytes are deterministic.
    with open(vocab_tmp, encoding="utf-8") as f:
        vocab = json.load(f)
    with open(vocab_tmp, "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False, sort_keys=True)
    os.replace(merges_tmp, os.path.join(output_dir, "merges.txt"))
    os.replace(vocab_tmp, os.path.join(output_dir, "vocab.json"))


def _bert_tokenizer_pipeline(model, lower_case: bool):
    """A `tokenizers` Tokenizer with BERT's normalizer, pre-tokenizer and WordPiece decoder.

    No post-processor: Megatron's BERT dataset adds [CLS] and [SEP] itself.
    """
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers

    tokenizer = Tokenizer(model)
    # strip_accents=None follows lowercase, as Google's BERT does (uncased strips accents).
    tokenizer.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                      strip_accents=None, lowercase=lower_case)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix=WORDPIECE_PREFIX)
    return tokenizer


def load_wordpiece_vocab(vocab_file: str) -> Dict[str, int]:
    """Read a BERT vocab.txt (one token per line, id = line number) and check it.

    Raises DataInputError (one line) for a missing or non-UTF-8 file, an empty or repeated token,
    a missing special token, or [PAD] not at id 0.
    """
    if not vocab_file or not os.path.isfile(vocab_file):
        raise DataInputError(
            f"--vocab-file {vocab_file!r} does not exist; run `python -m megatron_dpp.data."
            f"prepare_sample --output-dir DIR` to make DIR/bert-vocab.txt, or pass the right path")
    try:
        with open(vocab_file, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except UnicodeDecodeError:
        raise DataInputError(f"--vocab-file {vocab_file!r} is not UTF-8 text; a WordPiece "
                             f"vocab.txt has one token per line") from None
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    vocab: Dict[str, int] = {}
    for index, line in enumerate(lines):
        token = line.strip()  # as Google's and Megatron-LM's loaders do
        if not token:
            raise DataInputError(f"--vocab-file {vocab_file}:{index + 1}: empty line; a WordPiece "
                                 f"vocab.txt has one token per line")
        if token in vocab:
            raise DataInputError(f"--vocab-file {vocab_file}:{index + 1}: token {token!r} repeats "
                                 f"line {vocab[token] + 1}")
        vocab[token] = index
    missing = [token for token in BERT_SPECIAL_TOKENS if token not in vocab]
    if missing:
        raise DataInputError(f"--vocab-file {vocab_file!r} lacks {' '.join(missing)}; a BERT "
                             f"WordPiece vocab.txt needs {' '.join(BERT_SPECIAL_TOKENS)}")
    if vocab[PAD_TOKEN] != 0:
        raise DataInputError(f"--vocab-file {vocab_file!r} has {PAD_TOKEN} on line "
                             f"{vocab[PAD_TOKEN] + 1}; it must be the first line (id 0), as "
                             f"Megatron's BERT dataset pads with id 0")
    return vocab


class BertWordPieceTokenizer:
    """BERT's WordPiece tokenizer (Megatron-LM's BertWordPieceLowerCase / BertWordPieceCase).

    tokenize() gives the ids without [CLS]/[SEP]; detokenize() joins the pieces back into words
    (lower-cased and accent-stripped text when lower_case). Literal "[MASK]" in the text is not the
    mask token: the brackets split off as punctuation, as with Google's BERT tokenizer.
    BERT has no end-of-document token: the indexed dataset's document boundaries mark documents.
    """

    def __init__(self, vocab_file: str, lower_case: bool):
        from tokenizers import models

        self._vocab = load_wordpiece_vocab(vocab_file)
        self._inv_vocab = {index: token for token, index in self._vocab.items()}
        self.lower_case = lower_case
        self._wordpiece = _bert_tokenizer_pipeline(
            models.WordPiece(vocab=self._vocab, unk_token=UNK_TOKEN,
                             continuing_subword_prefix=WORDPIECE_PREFIX), lower_case)
        # Megatron's datasets hash these into their index-cache file names.
        self.unique_identifiers = OrderedDict([("class", type(self).__name__),
                                               ("tokenizer_path", [vocab_file]),
                                               ("lower_case", lower_case)])

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def vocab(self) -> Dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return self._inv_vocab

    @property
    def cls(self) -> int:
        return self._vocab[CLS_TOKEN]

    @property
    def sep(self) -> int:
        return self._vocab[SEP_TOKEN]

    @property
    def pad(self) -> int:
        return self._vocab[PAD_TOKEN]

    @property
    def mask(self) -> int:
        return self._vocab[MASK_TOKEN]

    @property
    def unk(self) -> int:
        return self._vocab[UNK_TOKEN]

    def tokenize(self, text: str) -> List[int]:
        return self._wordpiece.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        encodings = self._wordpiece.encode_batch(list(texts), add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._wordpiece.decode([int(i) for i in ids], skip_special_tokens=False)


def _continuation_characters(texts: Sequence[str], lower_case: bool) -> List[str]:
    """Characters that occur inside a word (not first) after BERT's normalization, sorted."""
    from tokenizers import normalizers, pre_tokenizers

    normalizer = normalizers.BertNormalizer(strip_accents=None, lowercase=lower_case)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    characters = set()
    for text in texts:
        for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text)):
            characters.update(word[1:])
    return sorted(characters)


def train_wordpiece_vocab(texts: Iterable[str], vocab_file: str, vocab_size: int,
                          lower_case: bool = True) -> None:
    """Train a BERT WordPiece vocabulary on `texts` and write it as vocab_file (BERT's vocab.txt).

    The first lines are [PAD] [UNK] [CLS] [SEP] [MASK]. The same texts always give the same file:
    the trainer numbers the "##c" continuation pieces in hash-map order, and merges of equal count
    are ordered by those numbers, so the pieces are given fixed numbers first (as leading special
    tokens, in sorted order). Written under a temporary name and renamed.
    """
    from tokenizers import models, trainers

    if vocab_size <= len(BERT_SPECIAL_TOKENS):
        raise DataInputError(f"the WordPiece vocabulary size must exceed the "
                             f"{len(BERT_SPECIAL_TOKENS)} special tokens, got {vocab_size}")
    texts = list(texts)  # read twice: continuation characters, then training
    pinned = [WORDPIECE_PREFIX + c for c in _continuation_characters(texts, lower_case)]
    tokenizer = _bert_tokenizer_pipeline(models.WordPiece(unk_token=UNK_TOKEN), lower_case)
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                        special_tokens=[*BERT_SPECIAL_TOKENS, *pinned],
                                        continuing_subword_prefix=WORDPIECE_PREFIX)
    tokenizer.train_from_iterator(texts, trainer)
    by_id = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    tokens = [token for token, _ in by_id]
    tmp_file = f"{vocab_file}.tmp{os.getpid()}"
    with open(tmp_file, "w", encoding="utf-8") as f:
        f.write("".join(token + "\n" for token in tokens))
    os.replace(tmp_file, vocab_file)
