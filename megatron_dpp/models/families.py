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
from typing import Any, Callable, Optional, Sequence

from megatron_dpp.data.tokenizer import (GPT2_BPE, GPT_SENTENCEPIECE, HUGGINGFACE,
                                         LLAMA2_SENTENCEPIECE, NULL_TOKENIZER, TIKTOKEN,
                                         WORDPIECE_LOWER_CASE)
from megatron_dpp.flag_errors import first_given
from megatron_dpp.one_line_errors import InputError

WORDPIECE_TOKENIZERS = tuple(WORDPIECE_LOWER_CASE)  # lower case first: BERT's default
# The causal LMs' tokenizers: GPT-2's BPE first (the sample data's), Llama 2's SentencePiece,
# any SentencePiece model without Llama 2's BOS (GPTSentencePieceTokenizer), a Hugging Face
# tokenizer directory (Llama 3's), a tiktoken vocabulary in Megatron-LM's JSON format
# (TikTokenizer), Megatron-LM's NullTokenizer (ids without a vocabulary file: --mock-data's usual
# companion).
DECODER_TOKENIZERS = (GPT2_BPE, LLAMA2_SENTENCEPIECE, GPT_SENTENCEPIECE, HUGGINGFACE, TIKTOKEN,
                      NULL_TOKENIZER)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InputError(message)


def _no_flags(parser: argparse.ArgumentParser) -> None:
    """A model without flags of its own."""


def _no_shape_flags(shape: Any) -> list[str]:
    return []


# ----------------------------------------------------------------------------------------------
# Megatron-LM's architecture flags (models/flags.py adds them, add_architecture_shape_args the
# ones the search and the profiler take too). GPT takes each of them on its own, as Megatron-LM's
# pretrain_gpt.py does (Llama, Mistral, Qwen, Nemotron-style models are GPTModel plus flags); BERT
# and Llama have one architecture each (Llama's is a preset of these flags, which its checkpoints
# and its Hugging Face conversion assume): a command line may state it, never change it.
# ----------------------------------------------------------------------------------------------
ARCHITECTURE_FLAGS: dict[str, Callable[[Any], str]] = {
    "normalization": lambda value: f"--normalization {value}",
    "swiglu": lambda value: "--swiglu",
    "squared_relu": lambda value: "--squared-relu",
    "position_embedding_type": lambda value: f"--position-embedding-type {value}",
    "add_position_embedding": lambda value: "--no-position-embedding",
    "add_bias_linear": lambda value: "--disable-bias-linear",
    "add_qkv_bias": lambda value: "--add-qkv-bias",
    "group_query_attention": lambda value: "--group-query-attention",
    "num_query_groups": lambda value: f"--num-query-groups {value}",
    "rotary_percent": lambda value: f"--rotary-percent {value:g}",
    "rotary_base": lambda value: f"--rotary-base {value}",
    "qk_layernorm": lambda value: "--qk-layernorm",
    "kv_channels": lambda value: f"--kv-channels {value}",
    "apply_query_key_layer_scaling": lambda value: "--apply-query-key-layer-scaling",
    "use_rope_scaling": lambda value: "--use-rope-scaling",
    "rope_scaling_factor": lambda value: f"--rope-scaling-factor {value:g}",
}
"""The parsed attribute of each flag (None when not given) -> the flag as written, for errors."""

# Megatron-LM's defaults: GPT without any of the flags (num_query_groups None: one group per head;
# kv_channels None: --hidden-size / --num-attention-heads; add_qkv_bias: the flag's own default,
# which GPT's validation then sets to True where add_bias_linear already gives the projection a
# bias, as Megatron-LM's validate_args keeps the two in sync).
GPT_ARCHITECTURE = {"normalization": "LayerNorm", "swiglu": False, "squared_relu": False,
                    "position_embedding_type": "learned_absolute", "add_position_embedding": True,
                    "add_bias_linear": True, "add_qkv_bias": False,
                    "group_query_attention": False, "num_query_groups": None, "rotary_percent": 1.0, "rotary_base": 10000,
                    "qk_layernorm": False, "kv_channels": None,
                    "apply_query_key_layer_scaling": False, "use_rope_scaling": False,
                    "rope_scaling_factor": None}
BERT_ARCHITECTURE = {**GPT_ARCHITECTURE, "rotary_percent": None,  # no rotary embedding
                     "rotary_base": None,
                     "add_qkv_bias": True}  # a bias on every linear, the QKV projection's too
LLAMA_ARCHITECTURE = {**GPT_ARCHITECTURE, "normalization": "RMSNorm", "swiglu": True,
                      "position_embedding_type": "rope", "add_position_embedding": False,
                      "add_bias_linear": False, "group_query_attention": True,
                      "rotary_percent": 1.0}  # rotary over whole heads
ROTARY_FLAGS = ("rotary_percent", "rotary_base", "use_rope_scaling", "rope_scaling_factor")
"""The flags that set the rotary embedding (with --position-embedding-type rope only)."""


def head_size(args: argparse.Namespace) -> Optional[int]:
    """--kv-channels, else --hidden-size / --num-attention-heads where it divides (None: the
    sizes are missing or do not divide; the shared checks say so)."""
    if getattr(args, "kv_channels", None) is not None:
        return args.kv_channels
    hidden, heads = getattr(args, "hidden_size", None), getattr(args, "num_attention_heads", None)
    if not hidden or not heads or hidden <= 0 or heads <= 0 or hidden % heads:
        return None
    return hidden // heads


def add_architecture_shape_args(group: Any) -> None:
    """The architecture flags that change a layer's tensors or its saved activations, in
    Megatron-LM's names and with its defaults: the trainer's (models/flags.py), the search's and
    the profiler's parsers take the same ones. None: not given (the model's own value)."""
    group.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default=None,
                       help="The layers' norm: LayerNorm (GPT's and BERT's, with a bias) or "
                            "RMSNorm (Llama's, a weight only). Default: the --model's.")
    group.add_argument("--swiglu", action="store_const", const=True, default=None,
                       help="A gated MLP with SiLU (SwiGLU): fc1 gives gate and up projections "
                            "in one linear of twice --ffn-hidden-size, whose default becomes "
                            "Megatron-LM's 2/3 x 4h rounded down to a multiple of 64 (gpt).")
    group.add_argument("--squared-relu", action="store_const", const=True, default=None,
                       help="The MLP's activation is ReLU squared (Nemotron's) instead of GeLU; "
                            "not with --swiglu.")
    group.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"],
                       default=None,
                       help="learned_absolute: a trained table of --max-position-embeddings rows "
                            "(GPT's, BERT's); rope: rotary embeddings applied to queries and keys "
                            "(Llama's). Default: the --model's.")
    group.add_argument("--use-rotary-position-embeddings", action="store_const", const="rope",
                       dest="position_embedding_type",
                       help="Megatron-LM's older spelling of --position-embedding-type rope.")
    group.add_argument("--no-position-embedding", action="store_const", const=False,
                       dest="add_position_embedding", default=None,
                       help="Megatron-LM's older way to say there is no learned position table; "
                            "accepted with --position-embedding-type rope only, as there.")
    group.add_argument("--disable-bias-linear", action="store_const", const=False,
                       dest="add_bias_linear", default=None,
                       help="No biases in the attention and MLP linears (Llama's).")
    group.add_argument("--add-qkv-bias", action="store_const", const=True, default=None,
                       help="A bias on the query/key/value projection, with "
                            "--disable-bias-linear the only one (Qwen2's and Qwen2.5's; "
                            "Megatron-Core's add_qkv_bias). Without --disable-bias-linear every "
                            "linear has its bias already.")
    group.add_argument("--group-query-attention", action="store_const", const=True, default=None,
                       help="Grouped-query attention: heads share --num-query-groups key/value "
                            "heads (Megatron-LM's default with the flag alone: 1, multi-query "
                            "attention; llama: one per head).")
    group.add_argument("--num-query-groups", type=int, default=None,
                       help="Key/value head groups of --group-query-attention (Llama 2 70B: 8); "
                            "must divide --num-attention-heads and be divisible by "
                            "--tensor-model-parallel-size.")
    group.add_argument("--kv-channels", type=int, default=None,
                       help="Size of each attention head, the query/key/value projections being "
                            "--num-attention-heads (or groups) x this wide (Qwen3's 128 with "
                            "hidden 1024 and 16 heads). Default: --hidden-size / "
                            "--num-attention-heads.")
    group.add_argument("--qk-layernorm", action="store_const", const=True, default=None,
                       help="Normalize each head's queries and keys before attention (with "
                            "--normalization's norm over the head size), as Qwen3 and OLMo do.")
    group.add_argument("--rotary-percent", type=float, default=None,
                       help="With rope: the share of each head's channels that is rotated, in "
                            "(0, 1] (default 1: all; GPT-NeoX and Phi: partial).")
    group.add_argument("--rotary-base", type=int, default=None,
                       help="With rope: the base period of the rotary frequencies (default 10000; "
                            "Llama 3: 500000).")


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

    document_masking: bool = True
    """Whether --dataloader-inter-document-masking applies: attention per document inside a packed
    window (GPT's and Llama's token windows; BERT's packed sentences have no documents to mask)."""

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

    architecture: dict = field(default_factory=lambda: GPT_ARCHITECTURE)
    """Its values of Megatron-LM's architecture flags (ARCHITECTURE_FLAGS: the parsed attribute ->
    its value here): what a command line that gives none of them builds."""

    free_architecture: frozenset = frozenset()
    """The architecture flags a command line may set to another value (its validate_args checks
    the values); any other flag may only state the value of `architecture` (else refused)."""

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

    def accepts(self, name: str, value: Any, args: argparse.Namespace) -> bool:
        """Does this model build architecture flag `name` (ARCHITECTURE_FLAGS) with `value`?"""
        if name in self.free_architecture or value == self.architecture[name]:
            return True
        # --kv-channels equal to --hidden-size / --num-attention-heads states the default.
        return (name == "kv_channels" and self.architecture[name] is None
                and value == head_size(argparse.Namespace(**{**vars(args), "kv_channels": None})))

    def _check_architecture(self, args: argparse.Namespace) -> None:
        """Each architecture flag given is this model's (or free here); the others take the
        model's values (args then holds every flag's value)."""
        given_names = []
        for name, flag in ARCHITECTURE_FLAGS.items():
            given = getattr(args, name, None)
            if given is None:
                setattr(args, name, self.architecture[name])
                continue
            given_names.append(name)
            if self.accepts(name, given, args):
                continue
            having = [family.name for family in MODEL_FAMILIES.values()
                      if family.accepts(name, given, args)]
            _require(False, f"{flag(given)} is not {self.name}'s architecture here ("
                     + (f"--model {' or '.join(having)} has it" if having else "no model here has it")
                     + "); remove it")
        if args.position_embedding_type != "rope":
            # Megatron-LM reads them only for rotary embeddings; here a flag must do something.
            rotary = [name for name in ROTARY_FLAGS if name in given_names]
            _require(not rotary, f"{ARCHITECTURE_FLAGS[rotary[0]](getattr(args, rotary[0]))} "
                                 f"sets rotary embeddings and --position-embedding-type is "
                                 f"{args.position_embedding_type}: add --position-embedding-type "
                                 f"rope or remove it" if rotary else "")
            # Megatron-LM's own refusal (the flag is its deprecated spelling of rope's).
            _require(args.add_position_embedding,
                     "--no-position-embedding goes with --position-embedding-type rope (Megatron-"
                     "LM: deprecated, use --position-embedding-type); add it or remove the flag")


# ----------------------------------------------------------------------------------------------
# GPT: token windows of the documents, causal LM loss
# ----------------------------------------------------------------------------------------------
def _check_token_windows(args, sources, samples) -> None:
    from megatron_dpp.data.datasets import check_splits_have_data

    for source in sources:
        check_splits_have_data(source, samples, args.variable_seq_lengths)


def swiglu_ffn_hidden_size(hidden_size: int) -> int:
    """Megatron-LM's --ffn-hidden-size default with --swiglu: 2/3 of 4h (two fc1 projections keep
    the parameters near GeLU's), rounded down to a multiple of 64."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64


def default_ffn_hidden_size(args: argparse.Namespace) -> int:
    """--ffn-hidden-size's default for the model of these flags: 4h, or GPT with --swiglu
    Megatron-LM's 2/3 of it (swiglu_ffn_hidden_size; Llama keeps 4h, as its checkpoints)."""
    if (getattr(args, "model", None) or DEFAULT_MODEL) == "gpt" and getattr(args, "swiglu", None):
        return swiglu_ffn_hidden_size(args.hidden_size)
    return 4 * args.hidden_size


def check_query_groups(args: argparse.Namespace) -> None:
    """--num-query-groups (set) against the heads and the tensor-parallel size."""
    heads, groups = args.num_attention_heads, args.num_query_groups
    _require(groups > 0 and (heads is None or heads % groups == 0),
             f"--num-query-groups {groups} must be positive and divide --num-attention-heads "
             f"{heads}")
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    _require(groups % tp == 0, f"--num-query-groups {groups} is not divisible by "
                               f"--tensor-model-parallel-size {tp}; each rank needs whole groups")


def check_rotary(args: argparse.Namespace) -> None:
    """--rotary-percent and --rotary-base of a model with rotary embeddings."""
    percent = args.rotary_percent
    _require(0.0 < percent <= 1.0, f"--rotary-percent must be in (0, 1], got {percent:g}")
    _require(args.rotary_base > 0, f"--rotary-base must be positive, got {args.rotary_base}")
    size = head_size(args)
    if size is not None:
        rotated = int(size * percent) if percent < 1.0 else size
        _require(rotated >= 2 and rotated % 2 == 0,
                 f"--rotary-percent {percent:g} rotates {rotated} of each head's {size} channels; "
                 f"rotary embeddings turn channel pairs: pick a percent giving an even number")


# Llama 3.1's rotary scaling factor (Megatron-LM's --rope-scaling-factor default).
DEFAULT_ROPE_SCALING_FACTOR = 8.0


def add_rope_scaling_args(group: Any) -> None:
    """--use-rope-scaling and --rope-scaling-factor (ARCHITECTURE_FLAGS; None: not given), in
    Megatron-LM's names: the trainer's architecture flags (models/flags.py)."""
    group.add_argument("--use-rope-scaling", action="store_const", const=True, default=None,
                       help="With rope: scale the rotary frequencies as Llama 3.1 and later do "
                            "(Megatron-Core's rope_scaling: wavelengths beyond the original "
                            "8192-token context divided by --rope-scaling-factor, a smooth blend "
                            "between, short ones kept); for Llama 3.1/3.2/3.3's checkpoints and "
                            "recipes (llama, or gpt with --position-embedding-type rope).")
    group.add_argument("--rope-scaling-factor", type=float, default=None,
                       help=f"The factor of --use-rope-scaling (default "
                            f"{DEFAULT_ROPE_SCALING_FACTOR:g}, Llama 3.1's; Llama 3.2's is 32).")


def check_rope_scaling(args: argparse.Namespace) -> None:
    """--rope-scaling-factor of a model with rotary embeddings (with --use-rope-scaling only,
    positive); --use-rope-scaling alone takes Megatron-LM's default factor."""
    factor = args.rope_scaling_factor
    if factor is not None:
        _require(args.use_rope_scaling, f"--rope-scaling-factor {factor:g} scales nothing without "
                                        f"--use-rope-scaling: add it or remove the factor")
        _require(factor > 0, f"--rope-scaling-factor must be positive, got {factor:g}")
    elif args.use_rope_scaling:
        args.rope_scaling_factor = DEFAULT_ROPE_SCALING_FACTOR


def mlp_activation(args: argparse.Namespace) -> str:
    """The MLP of the (validated) flags: "swiglu", "squared_relu" or "gelu"."""
    architecture = MODEL_FAMILIES[getattr(args, "model", None) or DEFAULT_MODEL].architecture
    swiglu, squared_relu = (architecture[name] if getattr(args, name, None) is None
                            else getattr(args, name) for name in ("swiglu", "squared_relu"))
    return "swiglu" if swiglu else "squared_relu" if squared_relu else "gelu"


def _validate_gpt_architecture(args: argparse.Namespace) -> None:
    """The values of GPT's architecture flags, as Megatron-LM checks them (its asserts, its
    TransformerConfig's), before the shared checks; args then holds Megatron-LM's derived values
    (num_query_groups, kv_channels, the SwiGLU --ffn-hidden-size default)."""
    _require(not (args.swiglu and args.squared_relu),
             "--swiglu and --squared-relu are two MLP activations (Megatron-LM asserts one); "
             "remove one")
    if args.kv_channels is not None:
        _require(args.kv_channels > 0, f"--kv-channels must be positive, got {args.kv_channels}")
    heads = args.num_attention_heads
    if args.group_query_attention:
        if args.num_query_groups is None:
            args.num_query_groups = 1  # Megatron-LM's default with --group-query-attention
        check_query_groups(args)
    else:
        _require(args.num_query_groups is None,
                 f"--num-query-groups {args.num_query_groups} groups keys and values with "
                 f"--group-query-attention only (Megatron-LM ignores it without): add "
                 f"--group-query-attention or remove it")
        args.num_query_groups = heads  # multi-head attention: one group per head
    if args.position_embedding_type == "rope":
        check_rotary(args)
        check_rope_scaling(args)
    args.kv_channels = head_size(args)
    if args.ffn_hidden_size is None and args.hidden_size:
        args.ffn_hidden_size = default_ffn_hidden_size(args)
    # Megatron-LM's validate_args: biases on every linear give the QKV projection one too.
    args.add_qkv_bias = bool(args.add_qkv_bias or args.add_bias_linear)


_GPT_SHAPE_FIELDS = ("normalization", "add_bias_linear", "add_qkv_bias",
                     "position_embedding_type", "rotary_percent", "rotary_base", "qk_layernorm",
                     "kv_channels", "num_query_groups")


def _gpt_shape_fields(args: argparse.Namespace) -> dict:
    """GPT's architecture as models.memory_model.ModelShape fields."""
    fields = {name: getattr(args, name) for name in _GPT_SHAPE_FIELDS}
    fields["mlp"] = mlp_activation(args)
    if getattr(args, "group_query_attention", None) and fields["num_query_groups"] is None:
        fields["num_query_groups"] = 1  # Megatron-LM's default with --group-query-attention
    return fields


def _gpt_shape_flags(shape: Any) -> list[str]:
    """The trainer flags of a GPT shape's architecture (those that differ from GPT's defaults)."""
    flags = []
    if shape.normalization != "LayerNorm":
        flags += ["--normalization", shape.normalization]
    if shape.mlp == "swiglu":
        flags.append("--swiglu")
    elif shape.mlp == "squared_relu":
        flags.append("--squared-relu")
    if not shape.add_bias_linear:
        flags.append("--disable-bias-linear")
        if shape.add_qkv_bias:
            flags.append("--add-qkv-bias")
    if shape.query_groups != shape.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", str(shape.query_groups)]
    if shape.kv_channels != shape.hidden_size // shape.num_attention_heads \
            or shape.hidden_size % shape.num_attention_heads:
        flags += ["--kv-channels", str(shape.kv_channels)]
    if shape.qk_layernorm:
        flags.append("--qk-layernorm")
    if shape.position_embedding_type == "rope":
        flags += ["--position-embedding-type", "rope", "--rotary-percent", f"{shape.rotary_percent:g}",
                  "--rotary-base", str(shape.rotary_base)]
    return flags


GPT = ModelFamily(
    name="gpt",
    spec="megatron_dpp.models.gpt:GPT_SPEC",
    summary="GPT: causal LM; by default learned absolute positions, LayerNorm, GeLU MLP, "
            "multi-head attention (Megatron-LM's architecture flags build Llama-, Mistral-, "
            "Qwen- or Nemotron-style models from it)",
    default_vocab_size=50257,  # GPT-2's BPE
    tokenizer_types=DECODER_TOKENIZERS,
    wrong_tokenizer_message=lambda given: (f"--tokenizer-type {given} is BERT's; GPT trains with "
                                           f"{' or '.join(DECODER_TOKENIZERS)}"),
    always_tied_output=False,
    check_data=_check_token_windows,
    shape_fields=_gpt_shape_fields,
    validate_args=_validate_gpt_architecture,
    shape_flags=_gpt_shape_flags,
    free_architecture=frozenset(ARCHITECTURE_FLAGS),
    # Neither the rotary settings nor the activations' functions shape a tensor.
    unshaped_settings=("norm_epsilon", "rotary_base", "rotary_percent", "squared_relu",
                       "apply_query_key_layer_scaling"),
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
        ("--dataloader-inter-document-masking",
         getattr(args, "dataloader_inter_document_masking", False)),
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
    document_masking=False,
    architecture=BERT_ARCHITECTURE,
    check_data=_check_packed_sentences,
    add_shape_args=_add_bert_shape_args,
    shape_fields=lambda args: {"bert_binary_head": args.bert_binary_head},
    add_args=_add_bert_args,
    validate_args=_validate_bert_args,
    shape_flags=_bert_shape_flags,
)


# Llama: a preset of GPT's architecture flags (RMSNorm, SwiGLU, rotary positions, grouped-query
# attention, no biases) with an untied output layer, all implied by --model llama; of the flags
# it may set, Llama 3.1's rotary scaling (GPT's too, with rotary embeddings).
# ----------------------------------------------------------------------------------------------
def _validate_llama_args(args: argparse.Namespace) -> None:
    if args.num_query_groups is None:  # Llama's preset: one group per head unless given
        args.num_query_groups = args.num_attention_heads
    if args.num_query_groups is not None:
        check_query_groups(args)
    check_rotary(args)
    args.kv_channels = head_size(args)
    check_rope_scaling(args)
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
            "no biases, untied output (--model gpt with these flags, as a preset)",
    # Llama 2's SentencePiece vocabulary (the search's default). The sample data here is tokenized
    # with GPT-2's BPE instead (50257), which the trainer reads from the tokenizer.
    default_vocab_size=32000,
    tokenizer_types=DECODER_TOKENIZERS,
    wrong_tokenizer_message=lambda given: (f"--tokenizer-type {given} is BERT's; Llama trains "
                                           f"with {' or '.join(DECODER_TOKENIZERS)}"),
    always_tied_output=False,
    always_untied_output=True,
    check_data=_check_token_windows,
    shape_fields=_llama_shape_fields,
    validate_args=_validate_llama_args,
    shape_flags=_llama_shape_flags,
    architecture=LLAMA_ARCHITECTURE,
    free_architecture=frozenset({"num_query_groups", "rotary_base", "use_rope_scaling",
                                 "rope_scaling_factor"}),
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
