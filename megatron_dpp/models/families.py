"""What each model is, as far as the tools that must not import torch need to know: its flags and
their checks, its tokenizer, its default vocabulary, whether its output layer is tied to the word
embedding, the trainer flags its shape adds. Standard library only (the search's command line and
the launchers' flag check import it); the torch side of a model is its ModelSpec (models/spec.py),
which carries its family.

MODEL_FAMILIES is the one registry of model names: `--model`'s choices, the search's, the
launchers' validation. To add a model, add its ModelFamily here and its ModelSpec module beside
(see docs/architecture.md, "Where to add a model").
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from megatron_dpp.data.tokenizer import (GPT2_BPE, HUGGINGFACE, LLAMA2_SENTENCEPIECE,
                                         NULL_TOKENIZER, WORDPIECE_LOWER_CASE)
from megatron_dpp.flag_errors import first_given
from megatron_dpp.one_line_errors import InputError

WORDPIECE_TOKENIZERS = tuple(WORDPIECE_LOWER_CASE)  # lower case first: BERT's default
# The causal LMs' tokenizers: GPT-2's BPE first (the sample data's), Llama 2's SentencePiece,
# a Hugging Face tokenizer directory (Llama 3's), Megatron-LM's NullTokenizer (ids without a
# vocabulary file: --mock-data's usual companion).
DECODER_TOKENIZERS = (GPT2_BPE, LLAMA2_SENTENCEPIECE, HUGGINGFACE, NULL_TOKENIZER)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InputError(message)


def _no_flags(parser: argparse.ArgumentParser) -> None:
    """A model without flags of its own."""


def _no_shape_flags(shape: Any) -> list[str]:
    return []


# ----------------------------------------------------------------------------------------------
# Megatron-LM's architecture flags (models/flags.py adds them): each model has its architecture,
# and a command line may state it (a Megatron-LM Llama script's --swiglu --normalization RMSNorm
# ... with --model llama), never change it.
# ----------------------------------------------------------------------------------------------
ARCHITECTURE_FLAGS: dict[str, Callable[[Any], str]] = {
    "normalization": lambda value: f"--normalization {value}",
    "swiglu": lambda value: "--swiglu",
    "position_embedding_type": lambda value: f"--position-embedding-type {value}",
    "add_position_embedding": lambda value: "--no-position-embedding",
    "add_bias_linear": lambda value: "--disable-bias-linear",
    "group_query_attention": lambda value: "--group-query-attention",
    "rotary_percent": lambda value: f"--rotary-percent {value:g}",
}
"""The parsed attribute of each flag (None when not given) -> the flag as written, for errors."""

GPT_ARCHITECTURE = {"normalization": "LayerNorm", "swiglu": False,
                    "position_embedding_type": "learned_absolute", "add_position_embedding": True,
                    "add_bias_linear": True, "group_query_attention": False,
                    "rotary_percent": None}  # no rotary embedding
LLAMA_ARCHITECTURE = {"normalization": "RMSNorm", "swiglu": True,
                      "position_embedding_type": "rope", "add_position_embedding": False,
                      "add_bias_linear": False, "group_query_attention": True,
                      "rotary_percent": 1.0}  # rotary over whole heads



@dataclass(frozen=True)
class ModelFamily:
    """One model as the flag parser, the data checks and the search see it."""

    name: str
    """`--model`'s value; the key of MODEL_FAMILIES and of models.MODEL_SPECS."""

    summary: str
    """One line for `--model`'s help."""

    spec: str
    """"module:attribute" of its ModelSpec (the torch side: chunks, forward step, layer spec),
    imported on first use of models.MODEL_SPECS."""

    default_vocab_size: int
    """Its tokenizer's vocabulary before Megatron pads it (the sample data's; the search's
    default --vocab-size)."""

    tokenizer_types: tuple[str, ...]
    """The --tokenizer-type values it trains with; the first is the default."""

    wrong_tokenizer_message: Callable[[str], str]
    """(--tokenizer-type given) -> the one-line error for a tokenizer it does not train with."""

    always_tied_output: bool
    """True when the output layer always shares the word embedding's weight (BERT's LM head);
    False: --untie-embeddings-and-output-weights decides."""

    check_data: Callable[[argparse.Namespace, Sequence[Any], list], None]
    """(args, the data's sources (megatron_dpp.data.datasets.DataSource: --data-path split by
    --split, or each split's own path), samples each split must give): raises
    megatron_dpp.data.errors.DataInputError when the data cannot give them (the model's samples
    are built its own way: GPT's token windows, BERT's packed sentences)."""

    always_untied_output: bool = False
    """True when the output layer always has its own weight (Llama's), with or without
    --untie-embeddings-and-output-weights."""

    add_shape_args: Callable[[Any], None] = _no_flags
    """Adds the flags of its model-specific shape (BERT's --bert-no-binary-head) to a parser or
    argument group: the trainer's, the search's and the profiler's take the same ones."""

    shape_fields: Callable[[argparse.Namespace], dict] = lambda args: {}
    """Parsed flags -> its models.memory_model.ModelShape fields beyond the shared ones."""

    add_args: Callable[[argparse.ArgumentParser], None] = _no_flags
    """Adds the trainer's flag group of the model (its shape flags and its data flags)."""

    validate_args: Callable[[argparse.Namespace], None] = lambda args: None
    """Its own checks beyond the tokenizer's; raises InputError. Runs before the shared ones."""

    shape_flags: Callable[[Any], list[str]] = _no_shape_flags
    """(models.memory_model.ModelShape) -> the trainer flags of its model-specific shape fields
    (the search's strategy file writes them after the shared ones)."""

    mlp_activation: str = "gelu"
    """Its MLP's activation as Megatron-LM's fusion flags name it: "gelu" (--no-bias-gelu-fusion
    applies) or "swiglu" (--no-bias-swiglu-fusion applies)."""

    architecture: dict = field(default_factory=lambda: GPT_ARCHITECTURE)
    """Its values of Megatron-LM's architecture flags (ARCHITECTURE_FLAGS: the parsed attribute ->
    its value here). A command line may state them; one stating another value is refused."""

    unshaped_settings: tuple[str, ...] = ("norm_epsilon",)
    """The parsed flags that change what the model computes but no tensor's shape: a checkpoint
    saved with other values still loads (a shape check cannot see them), and the load names the
    difference (checkpoint_setting_differences)."""

    def ties_output(self, untie_embeddings_and_output_weights: bool) -> bool:
        """Is the output layer's weight the word embedding's?"""
        if self.always_untied_output:
            return False
        return self.always_tied_output or not untie_embeddings_and_output_weights

    def validate(self, args: argparse.Namespace) -> None:
        """The tokenizer (defaulted to its first), Megatron-LM's architecture flags, and the
        model's own checks; raises InputError."""
        if args.tokenizer_type is None:
            args.tokenizer_type = self.tokenizer_types[0]
        _require(args.tokenizer_type in self.tokenizer_types,
                 self.wrong_tokenizer_message(args.tokenizer_type))
        self._check_architecture(args)
        self.validate_args(args)

    def _check_architecture(self, args: argparse.Namespace) -> None:
        ours = self.architecture
        for name, flag in ARCHITECTURE_FLAGS.items():
            given = getattr(args, name, None)
            if given is None or given == ours[name]:
                continue
            having = [family.name for family in MODEL_FAMILIES.values()
                      if family.architecture[name] == given]
            _require(False, f"{flag(given)} is not {self.name}'s architecture here ("
                     + (f"--model {' or '.join(having)} has it" if having else "no model here has it")
                     + f"); remove it")


# ----------------------------------------------------------------------------------------------
# GPT: token windows of the documents, causal LM loss
# ----------------------------------------------------------------------------------------------
def _check_token_windows(args, sources, samples) -> None:
    from megatron_dpp.data.datasets import check_splits_have_data

    for source in sources:
        check_splits_have_data(source, samples, args.variable_seq_lengths)


GPT = ModelFamily(
    name="gpt",
    spec="megatron_dpp.models.gpt:GPT_SPEC",
    summary="GPT: causal LM, learned absolute positions, LayerNorm, GeLU MLP",
    default_vocab_size=50257,  # GPT-2's BPE
    tokenizer_types=DECODER_TOKENIZERS,
    wrong_tokenizer_message=lambda given: (f"--tokenizer-type {given} is BERT's; GPT trains with "
                                           f"{' or '.join(DECODER_TOKENIZERS)}"),
    always_tied_output=False,
    check_data=_check_token_windows,
)


# ----------------------------------------------------------------------------------------------
# BERT: packed sentences, masked LM (+ sentence-order) loss
# ----------------------------------------------------------------------------------------------
def _add_bert_shape_args(group: Any) -> None:
    group.add_argument("--bert-no-binary-head", action="store_false", dest="bert_binary_head",
                       help="BERT without the sentence-order prediction (binary) head and its "
                            "token types: the masked-LM loss alone.")


def _add_bert_args(parser: argparse.ArgumentParser) -> None:
    from megatron_dpp.data.bert_datasets import BERT_ARG_DEFAULTS

    group = parser.add_argument_group("BERT")
    _add_bert_shape_args(group)
    group.add_argument("--mask-prob", type=float, default=BERT_ARG_DEFAULTS["mask_prob"],
                       help="Probability that a token is masked for the masked-LM loss "
                            "(default %(default)s).")
    group.add_argument("--short-seq-prob", type=float, default=BERT_ARG_DEFAULTS["short_seq_prob"],
                       help="Probability that a sample is made shorter than --seq-length "
                            "(default %(default)s).")


def _validate_bert_args(args: argparse.Namespace) -> None:
    _require(not getattr(args, "mock_data", False),
             "--mock-data is for GPT and Llama (Megatron-Core has no generated BERT documents); "
             "make BERT's sample data with `python -m megatron_dpp.data.prepare_sample "
             "--output-dir data`")
    given = first_given((
        ("--reset-position-ids", getattr(args, "reset_position_ids", False)),
        ("--reset-attention-mask", getattr(args, "reset_attention_mask", False)),
        ("--eod-mask-loss", getattr(args, "eod_mask_loss", False)),
        ("--no-create-attention-mask-in-dataloader",
         not getattr(args, "create_attention_mask_in_dataloader", True)),
        ("--no-mmap-bin-files", not getattr(args, "mmap_bin_files", True))))
    _require(given is None, f"{given} is a GPT data flag; BERT's samples are packed sentences "
                            f"(Megatron-Core's BERT dataset always maps its files and always has "
                            f"a padding mask): remove it")
    _require(not getattr(args, "calculate_per_token_loss", False),
             "--calculate-per-token-loss scales a loss by its token count, and BERT's loss "
             "(Megatron-LM's) averages the masked-LM and sentence-order losses per micro-batch: "
             "remove it")


def _check_packed_sentences(args, sources, samples) -> None:
    from megatron_dpp.data.bert_datasets import check_bert_args, check_bert_splits_have_data

    check_bert_args(args)
    for source in sources:
        check_bert_splits_have_data(source, samples, args.bert_binary_head)


def _bert_shape_flags(shape: Any) -> list[str]:
    return [] if shape.bert_binary_head else ["--bert-no-binary-head"]


BERT = ModelFamily(
    name="bert",
    spec="megatron_dpp.models.bert:BERT_SPEC",
    summary="BERT: masked LM and sentence-order heads, padding mask, LayerNorm, GeLU MLP",
    default_vocab_size=30522,  # BERT's uncased WordPiece
    tokenizer_types=WORDPIECE_TOKENIZERS,
    wrong_tokenizer_message=lambda given: (f"--tokenizer-type {given} is not BERT's; BERT trains with "
                                           f"{' or '.join(WORDPIECE_TOKENIZERS)} and a WordPiece "
                                           f"--vocab-file"),
    always_tied_output=True,
    check_data=_check_packed_sentences,
    add_shape_args=_add_bert_shape_args,
    shape_fields=lambda args: {"bert_binary_head": args.bert_binary_head},
    add_args=_add_bert_args,
    validate_args=_validate_bert_args,
    shape_flags=_bert_shape_flags,
)


# ----------------------------------------------------------------------------------------------
# Llama: GPT's token windows and causal LM loss; RMSNorm, SwiGLU, rotary positions, grouped-query
# attention, no biases, an untied output layer (all implied by --model llama, not flags)
# ----------------------------------------------------------------------------------------------
def _add_llama_shape_args(group: Any) -> None:
    """Megatron-LM's flag names for the two shape choices Llama has beyond GPT's flags."""
    group.add_argument("--num-query-groups", type=int, default=None,
                       help="Key/value head groups of grouped-query attention (Llama 2 70B: 8); "
                            "must divide --num-attention-heads (default: one per head, "
                            "multi-head attention).")
    group.add_argument("--rotary-base", type=int, default=10000,
                       help="Base period of the rotary position embeddings (default %(default)s, "
                            "Llama 2's).")


# Llama 3.1's rotary scaling factor (Megatron-LM's --rope-scaling-factor default).
DEFAULT_ROPE_SCALING_FACTOR = 8.0


def _add_llama_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Llama")
    _add_llama_shape_args(group)
    group.add_argument("--use-rope-scaling", action="store_true",
                       help="Scale the rotary frequencies as Llama 3.1 and later do (Megatron-"
                            "Core's rope_scaling: wavelengths beyond the original 8192-token "
                            "context divided by --rope-scaling-factor, a smooth blend between, "
                            "short ones kept); for Llama 3.1/3.2/3.3's checkpoints and recipes.")
    group.add_argument("--rope-scaling-factor", type=float, default=None,
                       help=f"The factor of --use-rope-scaling (default "
                            f"{DEFAULT_ROPE_SCALING_FACTOR:g}, Llama 3.1's; Llama 3.2's is 32).")


def _validate_llama_args(args: argparse.Namespace) -> None:
    heads = args.num_attention_heads
    groups = args.num_query_groups
    if groups is None:
        args.num_query_groups = groups = heads
    _require(groups > 0 and (heads is None or heads % groups == 0),
             f"--num-query-groups {groups} must be positive and divide --num-attention-heads "
             f"{heads}")
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    _require(groups % tp == 0, f"--num-query-groups {groups} is not divisible by "
                               f"--tensor-model-parallel-size {tp}; each rank needs whole groups")
    _require(args.rotary_base > 0, f"--rotary-base must be positive, got {args.rotary_base}")
    factor = args.rope_scaling_factor
    if factor is not None:
        _require(args.use_rope_scaling, f"--rope-scaling-factor {factor:g} scales nothing without "
                                        f"--use-rope-scaling: add it or remove the factor")
        _require(factor > 0, f"--rope-scaling-factor must be positive, got {factor:g}")
    elif args.use_rope_scaling:
        args.rope_scaling_factor = DEFAULT_ROPE_SCALING_FACTOR
    # Llama's output layer always has its own weight (always_untied_output): the flag is implied;
    # set it for the shared code that reads it.
    args.untie_embeddings_and_output_weights = True


def _llama_shape_fields(args: argparse.Namespace) -> dict:
    return {"num_query_groups": args.num_query_groups or args.num_attention_heads,
            "rotary_base": args.rotary_base}


def _llama_shape_flags(shape: Any) -> list[str]:
    return ["--num-query-groups", str(shape.num_query_groups or shape.num_attention_heads),
            "--rotary-base", str(shape.rotary_base)]


LLAMA = ModelFamily(
    name="llama",
    spec="megatron_dpp.models.llama:LLAMA_SPEC",
    summary="Llama: causal LM, rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention, "
            "no biases, untied output",
    # Llama 2's SentencePiece vocabulary (the search's default). The sample data here is tokenized
    # with GPT-2's BPE instead (50257), which the trainer reads from the tokenizer.
    default_vocab_size=32000,
    tokenizer_types=DECODER_TOKENIZERS,
    wrong_tokenizer_message=lambda given: (f"--tokenizer-type {given} is BERT's; Llama trains "
                                           f"with {' or '.join(DECODER_TOKENIZERS)}"),
    always_tied_output=False,
    always_untied_output=True,
    check_data=_check_token_windows,
    add_shape_args=_add_llama_shape_args,
    shape_fields=_llama_shape_fields,
    add_args=_add_llama_args,
    validate_args=_validate_llama_args,
    shape_flags=_llama_shape_flags,
    mlp_activation="swiglu",
    architecture=LLAMA_ARCHITECTURE,
    # Llama 3 and Llama 3.1 share every shape; their rotary settings tell them apart.
    unshaped_settings=("norm_epsilon", "rotary_base", "use_rope_scaling", "rope_scaling_factor"),
)


MODEL_FAMILIES: dict[str, ModelFamily] = {family.name: family
                                          for family in (GPT, BERT, LLAMA)}
"""Every model megatron_dpp trains, by name."""

DEFAULT_MODEL = GPT.name
"""The model of a command that names none (the search, the profiler, `megatron_dpp.arguments`)."""

TOKENIZER_TYPES = tuple(dict.fromkeys(t for f in MODEL_FAMILIES.values() for t in f.tokenizer_types))
"""Every --tokenizer-type some model trains with."""


def checkpoint_setting_differences(family: ModelFamily, saved: argparse.Namespace,
                                   run: argparse.Namespace) -> list[tuple[str, Any, Any]]:
    """(flag, the checkpoint's value, this run's) for each of family.unshaped_settings the saved
    args (a checkpoint's, as Megatron-LM keeps them) have and this run sets otherwise."""
    differences = []
    for name in family.unshaped_settings:
        if hasattr(saved, name) and getattr(saved, name) != getattr(run, name, None):
            differences.append((f"--{name.replace('_', '-')}", getattr(saved, name),
                                getattr(run, name, None)))
    return differences


def model_family(name: str) -> ModelFamily:
    """The family called `name`; InputError naming the known ones otherwise."""
    _require(name in MODEL_FAMILIES, f"unknown model {name!r}; one of {sorted(MODEL_FAMILIES)}")
    return MODEL_FAMILIES[name]
