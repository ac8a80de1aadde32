"""The analytical model of one GPT, BERT or Llama model: parameter counts, activation bytes, model-state
bytes and forward FLOPs, for sizes that cannot be run here. The strategy search prices layouts with
it (megatron_dpp.search.memory_model is this module), and the DPP runtime's memory budget counts
its activations per micro-batch (`chunk_activation_bytes`, each model's ModelSpec.activation_bytes).
Standard library only: the search's tools import it without torch.

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (per layer, 16-bit, no parallelism: sbh(34 + 5as/h); tensor parallel t:
sbh(10 + 24/t + 5as/(ht)); with sequence parallel: sbh/t(34 + 5as/h); selective recompute drops
the 5as/h attention term; full recompute keeps the layer input only), adapted term by term to
what Megatron-Core 0.16.1's local layer spec (the layers megatron_dpp.models build without
Transformer Engine) saves for backward on CPU, as traced with torch.autograd.graph's
saved_tensors_hooks:

- every tensor is counted at its element size (4 bytes in fp32, 2 in bf16/fp16);
- the layer norms also keep their fp32 mean and rstd (4 bytes per token each);
- the attention softmax runs in fp32 (attention_softmax_in_fp32) and keeps its fp32 output; the
  attention-times-V matmul keeps its own 16-bit copy of the probabilities (in fp32 it shares the
  softmax output);
- torch's CPU dropout keeps its mask in the input's dtype (element size, not 1 byte), and a
  dropout with probability 0 keeps nothing; the attention dropout's output is kept too;
- the attention mask is kept by the layer (1 byte per element; GPT: the s x s causal mask, which
  every layer makes anew; BERT: the model's b x s x s padding mask, which its layers share, counted
  here per layer);
- the MLP keeps its GeLU input and output (ffn_hidden_size wide, split by tensor parallelism).

With sequence parallelism every tensor kept outside the tensor-parallel region (layer-norm inputs,
their statistics, dropout masks, the column-parallel linears' inputs, which Megatron keeps as the
local shard and gathers again in backward) is split by t as well.
"""
from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence

# The search's input error (search/errors.py names it SearchInputError): a bad shape ends a search
# command as one line, exit 2; models/ must not import the search, so the class lives below both.
from megatron_dpp.models.families import MODEL_FAMILIES
from megatron_dpp.parallel.split import PipelineSplit
from megatron_dpp.one_line_errors import InputError

__all__ = [
    "BERT_TOKEN_TYPES", "ELEMENT_BYTES", "FP32_BYTES", "INDEX_BYTES", "MASK_BYTES", "MODELS",
    "RECOMPUTE_MODES", "CHECKPOINT_MASK_TYPE_BYTES", "InputError", "ModelShape",
    "CAUSAL_ATTENTION_SHARE", "causal_attention_work_per_token_pair", "chunk_activation_bytes",
    "config_dtype", "config_layer_shape", "layer_flop_terms",
    "embedding_activation_bytes", "embedding_parameter_count", "layer_activation_bytes",
    "layer_forward_flops", "layer_parameter_count", "layers_activation_bytes", "model_shape",
    "model_state_bytes", "output_activation_bytes", "output_parameter_count", "recompute_layers",
    "total_parameter_count",
]

MODELS = tuple(MODEL_FAMILIES)  # "gpt", "bert", "llama"
RECOMPUTE_MODES = ("none", "selective", "full")
MLPS = ("gelu", "swiglu", "squared_relu")
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
FP32_BYTES = 4
INDEX_BYTES = 8  # token, position and token-type ids are int64
MASK_BYTES = 1  # torch.bool attention masks
CHECKPOINT_MASK_TYPE_BYTES = 4  # the selective checkpoint keeps the mask type as one int32
BERT_TOKEN_TYPES = 2  # sentence-order prediction: two token types when the binary head is on


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """One model's shape, in Megatron's flag names."""

    model: str
    """"gpt", "bert" or "llama" (a name of models.families.MODEL_FAMILIES)."""
    num_layers: int
    """--num-layers: transformer layers of the whole model."""
    hidden_size: int
    """--hidden-size."""
    num_attention_heads: int
    """--num-attention-heads."""
    ffn_hidden_size: int
    """--ffn-hidden-size (Megatron's default 4 * hidden size: see `model_shape`)."""
    seq_length: int
    """--seq-length: tokens per sample."""
    padded_vocab_size: int
    """The vocabulary padded as Megatron-LM pads it (a multiple of divisible-by x tp)."""
    max_position_embeddings: int
    """--max-position-embeddings: rows of the learned position embedding."""
    untie_embeddings_and_output_weights: bool = False
    """--untie-embeddings-and-output-weights (GPT only; BERT always ties them, Llama never)."""
    dtype: str = "bf16"
    """"bf16", "fp16" or "fp32": the parameters' and activations' dtype."""
    bert_binary_head: bool = True
    """BERT's sentence-order head (and its two token-type embeddings); Megatron-LM's default on."""
    hidden_dropout: float = 0.1
    """--hidden-dropout (Megatron-LM's default 0.1); 0 keeps no hidden dropout masks."""
    attention_dropout: float = 0.1
    """--attention-dropout (Megatron-LM's default 0.1); 0 keeps no attention dropout mask."""
    num_query_groups: Optional[int] = None
    """--num-query-groups (grouped-query attention); None: one per head."""
    rotary_base: Optional[int] = None
    """--rotary-base (rotary position embeddings; no parameters, no memory). None, as each
    architecture field below: the model's own (models.families' architecture)."""
    normalization: Optional[str] = None
    """--normalization: "LayerNorm" or "RMSNorm"."""
    mlp: Optional[str] = None
    """The MLP: "gelu", "swiglu" (--swiglu) or "squared_relu" (--squared-relu)."""
    add_bias_linear: Optional[bool] = None
    """False: --disable-bias-linear."""
    add_qkv_bias: Optional[bool] = None
    """The QKV projection's bias: --add-qkv-bias, or add_bias_linear (Megatron-LM keeps the two in
    sync: True wherever add_bias_linear is)."""
    position_embedding_type: Optional[str] = None
    """--position-embedding-type: "learned_absolute" or "rope"."""
    rotary_percent: Optional[float] = None
    """--rotary-percent: the rotated share of each head (rope)."""
    kv_channels: Optional[int] = None
    """--kv-channels, the head size; None: hidden_size / num_attention_heads."""
    qk_layernorm: Optional[bool] = None
    """--qk-layernorm: each head's queries and keys normalized."""

    @property
    def query_groups(self) -> int:
        """Key/value head groups: num_query_groups, else one per attention head."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Channels of each head the rotary embedding turns (0 without rotary embeddings)."""
        if self.position_embedding_type != "rope":
            return 0
        if self.rotary_percent < 1.0:
            return int(self.kv_channels * self.rotary_percent)
        return self.kv_channels

    def __post_init__(self):
        if self.model not in MODELS:
            raise InputError(f"model must be one of {MODELS}, got {self.model!r}")
        preset = MODEL_FAMILIES[self.model].architecture
        defaults = {"normalization": preset["normalization"],
                    "mlp": ("swiglu" if preset["swiglu"] else
                            "squared_relu" if preset["squared_relu"] else "gelu"),
                    "add_bias_linear": preset["add_bias_linear"],
                    "position_embedding_type": preset["position_embedding_type"],
                    "rotary_percent": preset["rotary_percent"] or 1.0,
                    "rotary_base": preset["rotary_base"] or 10000,
                    "qk_layernorm": preset["qk_layernorm"]}
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)  # frozen: set once, here
        object.__setattr__(self, "add_qkv_bias", bool(
            self.add_bias_linear or (preset["add_qkv_bias"] if self.add_qkv_bias is None
                                     else self.add_qkv_bias)))
        if self.kv_channels is None and self.num_attention_heads > 0 \
                and self.hidden_size % self.num_attention_heads == 0:
            object.__setattr__(self, "kv_channels", self.hidden_size // self.num_attention_heads)
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise InputError(f"normalization must be LayerNorm or RMSNorm, got "
                             f"{self.normalization!r}")
        if self.mlp not in MLPS:
            raise InputError(f"mlp must be one of {MLPS}, got {self.mlp!r}")
        if self.position_embedding_type not in ("learned_absolute", "rope"):
            raise InputError(f"position_embedding_type must be learned_absolute or rope, got "
                             f"{self.position_embedding_type!r}")
        if self.dtype not in ELEMENT_BYTES:
            raise InputError(f"dtype must be one of {tuple(ELEMENT_BYTES)}, "
                                   f"got {self.dtype!r}")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                     "seq_length", "padded_vocab_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise InputError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kv_channels is None:
            raise InputError(f"hidden_size {self.hidden_size} is not divisible by "
                             f"num_attention_heads {self.num_attention_heads} (give kv_channels)")
        if self.kv_channels <= 0:
            raise InputError(f"kv_channels must be positive, got {self.kv_channels}")
        if self.position_embedding_type == "rope" and not 0.0 < self.rotary_percent <= 1.0:
            raise InputError(f"rotary_percent must be in (0, 1], got {self.rotary_percent}")
        if self.query_groups <= 0 or self.num_attention_heads % self.query_groups:
            raise InputError(f"num_query_groups {self.num_query_groups} must be positive and "
                             f"divide num_attention_heads {self.num_attention_heads}")


def model_shape(model: str, num_layers: int, hidden_size: int, num_attention_heads: int,
                seq_length: int, padded_vocab_size: int, ffn_hidden_size: int | None = None,
                max_position_embeddings: int | None = None, **others) -> ModelShape:
    """A ModelShape with Megatron-LM's defaults: ffn 4 * hidden, position embeddings = seq."""
    return ModelShape(model=model, num_layers=num_layers, hidden_size=hidden_size,
                      num_attention_heads=num_attention_heads,
                      ffn_hidden_size=ffn_hidden_size or 4 * hidden_size, seq_length=seq_length,
                      padded_vocab_size=padded_vocab_size,
                      max_position_embeddings=max_position_embeddings or seq_length, **others)


# ----------------------------------------------------------------------------------------------
# parameters (whole model, before tensor parallelism)
# ----------------------------------------------------------------------------------------------
def _norm_parameters(shape: ModelShape, width: int) -> int:
    """A LayerNorm's weight and bias, or an RMSNorm's weight."""
    return (2 if shape.normalization == "LayerNorm" else 1) * width


def layer_parameter_count(shape: ModelShape, tp: int = 1) -> int:
    """One transformer layer: two norms (LayerNorm: weight and bias; RMSNorm: weight), with
    --qk-layernorm two more over the head size; the fused QKV projection (h x (heads + 2 groups)
    x head size), the output projection and the two MLP linears (SwiGLU's fc1 twice as wide: gate
    and up), each with its bias unless --disable-bias-linear (the QKV projection's then with
    --add-qkv-bias). With tp > 1: one rank's share (the
    column-parallel weights and biases and the row-parallel weights are split; the norms and the
    row-parallel biases are replicated)."""
    h, f, d = shape.hidden_size, shape.ffn_hidden_size, shape.kv_channels
    query, qkv = shape.num_attention_heads * d, (shape.num_attention_heads + 2 * shape.query_groups) * d
    fc1 = 2 * f if shape.mlp == "swiglu" else f
    bias = 1 if shape.add_bias_linear else 0
    qkv_bias = 1 if shape.add_qkv_bias else 0
    norms = 2 * _norm_parameters(shape, h)
    if shape.qk_layernorm:
        norms += 2 * _norm_parameters(shape, d)
    attention = (h * qkv + qkv_bias * qkv) // tp + query * h // tp + bias * h
    mlp = (h * fc1 + bias * fc1) // tp + f * h // tp + bias * h
    return norms + attention + mlp


def embedding_parameter_count(shape: ModelShape, tp: int = 1) -> int:
    """The first stage's extra parameters: word and learned position embeddings (BERT: and token
    types; rotary positions have no parameters). With tp > 1: one rank's share (the word
    embedding is split over the vocabulary)."""
    h = shape.hidden_size
    count = shape.padded_vocab_size * h // tp
    if shape.position_embedding_type == "learned_absolute":
        count += shape.max_position_embeddings * h
    if shape.model == "bert" and shape.bert_binary_head:
        count += BERT_TOKEN_TYPES * h
    return count


def output_parameter_count(shape: ModelShape, tp: int = 1) -> int:
    """The last stage's extra parameters when it is not also the first (pp > 1): the final norm
    and the output layer's weight, which the last stage keeps even when tied to the word
    embedding (Megatron keeps a copy there and sums its gradient with the first stage's). BERT
    adds its LM head (dense, layer norm, output bias), the pooler and the binary head. With
    tp > 1: one rank's share (the output layer is split over the vocabulary)."""
    h, vocab = shape.hidden_size, shape.padded_vocab_size // tp
    count = _norm_parameters(shape, h) + vocab * h
    if shape.model == "bert":
        count += (h * h + h) + 2 * h + vocab  # LM head dense, its layer norm, the output bias
        if shape.bert_binary_head:
            count += (h * h + h) + (h * BERT_TOKEN_TYPES + BERT_TOKEN_TYPES)  # pooler, binary head
    return count


def total_parameter_count(shape: ModelShape) -> int:
    """The whole model on one pipeline stage (pp = 1): a tied output weight is counted once."""
    tied = MODEL_FAMILIES[shape.model].ties_output(shape.untie_embeddings_and_output_weights)
    shared = shape.padded_vocab_size * shape.hidden_size if tied else 0
    return (shape.num_layers * layer_parameter_count(shape) + embedding_parameter_count(shape)
            + output_parameter_count(shape) - shared)


# ----------------------------------------------------------------------------------------------
# activations (bytes one microbatch keeps for its backward, on one tensor-parallel rank)
# ----------------------------------------------------------------------------------------------
def _check_parallel(shape: ModelShape, micro_batch: int, tp: int) -> None:
    if micro_batch <= 0 or tp <= 0:
        raise InputError(f"micro_batch and tp must be positive, got {micro_batch}, {tp}")
    if shape.num_attention_heads % tp or shape.ffn_hidden_size % tp:
        raise InputError(f"tp {tp} does not divide num_attention_heads "
                               f"{shape.num_attention_heads} and ffn_hidden_size "
                               f"{shape.ffn_hidden_size}")


def _attention_mask_bytes(shape: ModelShape, micro_batch: int) -> int:
    """GPT: the s x s causal mask; BERT: the b x 1 x s x s padding mask."""
    s = shape.seq_length
    return (micro_batch if shape.model == "bert" else 1) * s * s * MASK_BYTES


def layer_activation_bytes(shape: ModelShape, micro_batch: int, tp: int = 1,
                           sequence_parallel: bool = False, recompute: str = "none") -> int:
    """Bytes one layer keeps for its backward, per microbatch, on one tensor-parallel rank.

    recompute: "none"; "selective" (Megatron recomputes core attention: its inputs are kept,
    the softmax, its dropout and the mask are not; BERT's mask is still kept by the checkpoint);
    "full" (the layer's input only, with recompute_method uniform and one layer per unit)."""
    if recompute not in RECOMPUTE_MODES:
        raise InputError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    _check_parallel(shape, micro_batch, tp)
    e = ELEMENT_BYTES[shape.dtype]
    s, b, h, a, f = (shape.seq_length, micro_batch, shape.hidden_size, shape.num_attention_heads,
                     shape.ffn_hidden_size)
    sp = tp if sequence_parallel else 1  # split of the tensors outside the tensor-parallel region
    sbh = s * b * h
    rotary = shape.rotary_dim
    bert_mask = _attention_mask_bytes(shape, b) if shape.model == "bert" else 0
    if recompute == "full":
        # The checkpoint keeps the layer input (and the rotary angles, fp32, s x rotary dim).
        return sbh * e // sp + s * rotary * FP32_BYTES + bert_mask

    hidden_masks = 2 if shape.hidden_dropout > 0 else 0  # after attention and after the MLP
    if shape.normalization == "LayerNorm":
        # Outside the tensor-parallel region: both norms' inputs, both column-parallel linears'
        # inputs (the norms' outputs), the hidden dropout masks; the norms' mean and rstd.
        outside = (4 + hidden_masks) * sbh * e // sp + 2 * 2 * s * b * FP32_BYTES // sp
    else:
        # Torch's RMSNorm computes in fp32: its fp32 input, normalized output and rstd.
        outside = (2 * (2 * sbh * FP32_BYTES + s * b * FP32_BYTES) // sp
                   + (2 + hidden_masks) * sbh * e // sp)
    inside = (_attention_input_bytes(shape, b, e, recompute == "selective", tp)
              + MLP_WIDTHS[shape.mlp] * s * b * f * e) // tp
    rotary_bytes = 4 * s * rotary * e  # cos and sin of the angles, for queries and for keys
    total = outside + inside + rotary_bytes
    if recompute == "selective":
        # The checkpoint also keeps the mask type, a one-element int32.
        return total + bert_mask + CHECKPOINT_MASK_TYPE_BYTES

    scores = a * s * s * b // tp  # attention probabilities per rank
    softmax = scores * FP32_BYTES  # the fp32 softmax output
    if shape.attention_dropout > 0:
        probabilities = 2 * scores * e  # dropout mask and dropout output
    else:
        probabilities = scores * e if e != FP32_BYTES else 0  # the matmul's 16-bit copy
    return total + softmax + probabilities + _attention_mask_bytes(shape, b)


MLP_WIDTHS = {"gelu": 2, "squared_relu": 2, "swiglu": 5}
"""ffn_hidden_size-wide tensors the MLP keeps (with fc2's input): GeLU's input and output;
squared ReLU's ReLU output (its square's input too) and the square; SwiGLU's fc1 output (2 wide,
the SiLU's input), the SiLU output, the up projection plus Megatron's glu_linear_offset, and the
product."""


def _attention_input_bytes(shape: ModelShape, b: int, e: int, selective: bool, tp: int) -> int:
    """What the attention keeps of its projections (all tensor-parallel ranks): the queries, keys
    and values its matmuls keep (selective: the recomputed core attention's inputs, before the
    groups are repeated), each a view of the QKV output or a tensor of its own, the QKV output
    once where a view keeps it alive, the q/k norms' tensors and the output projection's input.

    Megatron-Core's split leaves queries, keys and values views of the QKV output with one group
    per head; with fewer groups the queries are reshaped into a copy (a view where a rank has one
    group), and the local attention
    repeats keys and values to every head (copies). The rotary embedding and the q/k norms make
    new queries and keys; a LayerNorm keeps its input (a view), an RMSNorm its fp32 input (the
    view itself in fp32, a copy otherwise), its fp32 normalized output and its fp32 rstd."""
    s, a, g, d = shape.seq_length, shape.num_attention_heads, shape.query_groups, shape.kv_channels
    queries, keys = s * b * a * d, s * b * g * d  # elements
    grouped = g < a
    # The split's queries are a view of the QKV output with one group per head or one group per
    # rank; the local attention's reshape keeps that view with one sample only (else a copy).
    query_view = not grouped or g // tp == 1
    kept_query_view = not grouped or (query_view and b == 1)
    rotary, normed = shape.rotary_dim > 0, bool(shape.qk_layernorm)
    qkv_alive = False
    total = queries * e  # the output projection's input
    # The queries and keys the attention keeps.
    # (selective: the checkpoint keeps the split's queries, before the attention's reshape)
    if normed or rotary or not (query_view if selective else kept_query_view):
        total += queries * e
    else:
        qkv_alive = True
    if selective:
        if normed or rotary:
            total += keys * e
        else:
            qkv_alive = True
        qkv_alive = True  # the values, a view
    else:
        if grouped:
            total += 2 * queries * e  # keys and values repeated to every head
        elif normed or rotary:
            total += keys * e
            qkv_alive = True  # the values, a view
        else:
            qkv_alive = True
    if normed:
        # The norms' inputs: keys a view of the QKV output, queries one too with a group per head
        # (else the reshaped copy).
        for elements, vectors, view in ((queries, s * b * a, query_view), (keys, s * b * g, True)):
            if shape.normalization == "LayerNorm":
                total += 2 * vectors * FP32_BYTES  # mean and rstd
                if view:
                    qkv_alive = True
                else:
                    total += elements * e
            else:
                total += elements * FP32_BYTES + vectors * FP32_BYTES  # normalized output, rstd
                if e != FP32_BYTES:
                    total += elements * FP32_BYTES  # the fp32 copy of the input
                elif view:
                    qkv_alive = True
                else:
                    total += elements * e
    if qkv_alive:
        total += (queries + 2 * keys) * e
    return total


def embedding_activation_bytes(shape: ModelShape, micro_batch: int, tp: int = 1,
                               sequence_parallel: bool = False) -> int:
    """The first stage's embedding: the int64 token and position ids (BERT: token types too;
    BERT makes its position ids as one broadcast row), with tp > 1 the vocab-parallel lookup's
    bool mask of tokens outside this rank's shard, and the embedding dropout mask."""
    _check_parallel(shape, micro_batch, tp)
    e = ELEMENT_BYTES[shape.dtype]
    s, b, h = shape.seq_length, micro_batch, shape.hidden_size
    sp = tp if sequence_parallel else 1
    if shape.model != "bert":  # token ids, and position ids where they are looked up
        ids = (2 if shape.position_embedding_type == "learned_absolute" else 1) * s * b * INDEX_BYTES
    else:
        ids = s * b * INDEX_BYTES + s * INDEX_BYTES
        if shape.bert_binary_head:
            ids += s * b * INDEX_BYTES
    if tp > 1:
        ids += s * b * MASK_BYTES  # the vocab-parallel embedding's out-of-shard token mask
    dropout_mask = s * b * h * e // sp if shape.hidden_dropout > 0 else 0
    return ids + dropout_mask


def output_activation_bytes(shape: ModelShape, micro_batch: int, tp: int = 1,
                            sequence_parallel: bool = False) -> int:
    """The last stage's head and loss: the final layer norm (input, fp32 statistics), the output
    layer's input, and the vocab-parallel cross entropy's fp32 softmax (s x b x vocab/t), its
    target mask (bool) and targets (int64). BERT's LM head adds a dense layer, GeLU and layer norm,
    and its binary head the pooler's tanh output."""
    _check_parallel(shape, micro_batch, tp)
    e = ELEMENT_BYTES[shape.dtype]
    s, b, h = shape.seq_length, micro_batch, shape.hidden_size
    sp = tp if sequence_parallel else 1
    layer_norm = s * b * h * e // sp + 2 * s * b * FP32_BYTES // sp
    if shape.normalization == "RMSNorm":  # fp32 input and normalized output, fp32 rstd
        layer_norm = (2 * s * b * h * FP32_BYTES + s * b * FP32_BYTES) // sp
    output_input = s * b * h * e // sp
    cross_entropy = (s * b * shape.padded_vocab_size // tp * FP32_BYTES
                     + s * b * MASK_BYTES + s * b * INDEX_BYTES)
    total = layer_norm + output_input + cross_entropy
    if shape.model == "bert":
        # LM head: the final layer norm's output is the dense input (already counted above as the
        # output layer's input of GPT), GeLU input, LM layer norm input (GeLU output) and stats,
        # the output layer's input.
        total += 2 * s * b * h * e // sp + 2 * s * b * FP32_BYTES // sp + s * b * h * e // sp
        if shape.bert_binary_head:
            total += b * h * e  # pooler tanh output (the binary head's input)
    return total


# ----------------------------------------------------------------------------------------------
# model states and FLOPs
# ----------------------------------------------------------------------------------------------
def model_state_bytes(parameter_count: int, dtype: str, dp: int = 1,
                      distributed_optimizer: bool = False) -> int:
    """Parameters + gradients + Adam state as Megatron-Core keeps them, per data-parallel rank.

    bf16/fp16: 16-bit parameters (2), fp32 main gradients (4: DDP's grad buffer with
    grad_reduce_in_fp32, as megatron_dpp.training.config sets it; --grad-reduce-in-bf16's bf16
    buffer, 2, is not modelled), fp32 main parameters (4:
    Float16OptimizerWithFloat16Params / the distributed optimizer's shards) and Adam's two fp32
    moments (8): 18 bytes per parameter; the distributed optimizer shards the 12 fp32 optimizer
    bytes over dp: 6 + 12/dp (Megatron-LM's megatron/training/theoretical_memory_usage.py).
    fp32: parameters 4 + gradients 4 + Adam 8 = 16; the distributed optimizer shards Adam's 8
    (fp32 parameters are their own main parameters: no copy): 8 + 8/dp."""
    if dtype not in ELEMENT_BYTES:
        raise InputError(f"dtype must be one of {tuple(ELEMENT_BYTES)}, got {dtype!r}")
    if dp <= 0 or parameter_count < 0:
        raise InputError(f"dp must be positive and parameter_count >= 0, got {dp}, "
                               f"{parameter_count}")
    if dtype == "fp32":
        replicated, sharded = 4 + 4, 8
    else:
        replicated, sharded = 2 + 4, 4 + 8
    if distributed_optimizer:
        return parameter_count * replicated + -(-parameter_count * sharded // dp)
    return parameter_count * (replicated + sharded)


def layer_forward_flops(shape: ModelShape, micro_batch: int) -> float:
    """One layer's forward matmul FLOPs (2 per multiply-add), whole layer (all tp ranks):
    QKV 6sbh^2, scores and context 4bs^2h, output projection 2sbh^2, MLP 4sbhf
    (= 24sbh^2 + 4bs^2h with f = 4h, Megatron's count)."""
    s, b, h, f = shape.seq_length, micro_batch, shape.hidden_size, shape.ffn_hidden_size
    # QKV (keys and values per group), scores and context over heads x head size, the output
    # projection, fc1 (SwiGLU's twice as wide: gate and up) and fc2.
    query = shape.num_attention_heads * shape.kv_channels
    kv = 2 * shape.kv_channels * shape.query_groups
    fc1 = 2 * f if shape.mlp == "swiglu" else f
    return float(2 * s * b * (h * (query + kv) + query * h + h * fc1 + f * h)
                 + 4 * b * s * s * query)


CAUSAL_ATTENTION_SHARE = 0.5
"""The share of the s x s scores a causal attention computes: its kernels (flash attention, SDPA's
causal path) skip the masked upper triangle, and --log-throughput counts it so (Megatron-LM's
causal half, training/observe/throughput.py)."""


def layer_flop_terms(shape: ModelShape) -> tuple[float, float]:
    """(per token, per token pair): one layer's forward FLOPs of a sample of s tokens are
    per_token * s + per_token_pair * s^2 (layer_forward_flops: the projections and the MLP grow
    with s, the scores and the context with s^2, counted over the full s x s)."""
    one = layer_forward_flops(dataclasses.replace(shape, seq_length=1), 1)
    two = layer_forward_flops(dataclasses.replace(shape, seq_length=2), 1)
    per_token_pair = (two - 2 * one) / 2  # f(2) - 2 f(1) = 2 q for f(s) = l s + q s^2
    return one - per_token_pair, per_token_pair


def causal_attention_work_per_token_pair(shape: ModelShape) -> float:
    """c of a causal model's work W + c * sum of s_i^2 (in tokens: the dense part's FLOPs per
    token are one unit): CAUSAL_ATTENTION_SHARE * per_token_pair / per_token of layer_flop_terms.
    A backward costs the same multiple of its forward in both parts, so the forward's ratio prices
    the whole microbatch (pipeline/work.py's segments_work). GPT's f = 4h, one query group per head: (1/2 * 4h) / 24h^2 = 1/(12h)."""
    per_token, per_token_pair = layer_flop_terms(shape)
    return CAUSAL_ATTENTION_SHARE * per_token_pair / per_token


# ----------------------------------------------------------------------------------------------
# the DPP runtime's estimate (ModelSpec.activation_bytes), read from a Megatron TransformerConfig
# ----------------------------------------------------------------------------------------------
_TORCH_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


def config_dtype(config: Any) -> str:
    """The activations' dtype: the one pipeline stages exchange (else the parameters')."""
    dtype = getattr(config, "pipeline_dtype", None) or getattr(config, "params_dtype", None)
    if dtype is None:
        return "fp32"  # TransformerConfig's default params_dtype
    name = _TORCH_DTYPES.get(str(dtype))  # by name: this module stays free of torch
    if name is None:
        raise InputError(f"no activation model for dtype {dtype}; expected one of "
                         f"{tuple(_TORCH_DTYPES)}")
    return name


def recompute_layers(config: Any, layers: int) -> dict[str, int]:
    """How many of a chunk's `layers` keep which recompute mode's bytes, as Megatron-Core's
    TransformerBlock checkpoints them: "full" counts checkpoint units (each keeps its input only):
    uniform, one per recompute_num_layers layers; block, the first recompute_num_layers layers
    one by one, the others keep everything. Selective recomputes core attention (Megatron's
    default recompute_modules; more modules recomputed keep less, so this stays an upper bound)."""
    granularity = getattr(config, "recompute_granularity", None)
    if granularity == "selective":
        return {"selective": layers}
    if granularity != "full":
        return {"none": layers}
    per_unit = max(1, getattr(config, "recompute_num_layers", None) or 1)
    if getattr(config, "recompute_method", None) == "block":
        checkpointed = min(per_unit, layers)
        return {"full": checkpointed, "none": layers - checkpointed}
    return {"full": -(-layers // per_unit)}


def config_architecture(config: Any) -> dict:
    """The ModelShape architecture fields of a Megatron TransformerConfig (None: the model's own;
    the position fields are megatron_dpp's, models/transformer_config.py sets them)."""
    activation = getattr(getattr(config, "activation_func", None), "__name__", "gelu")
    mlp = ("swiglu" if getattr(config, "gated_linear_unit", False)
           else "squared_relu" if (activation == "squared_relu"
                                   or getattr(config, "squared_relu", False)) else "gelu")
    fields = {"mlp": mlp, "kv_channels": getattr(config, "kv_channels", None),
              "position_embedding_type": getattr(config, "position_embedding_type", None),
              "rotary_percent": getattr(config, "rotary_percent", None)}
    for name in ("normalization", "add_bias_linear", "add_qkv_bias", "qk_layernorm"):
        fields[name] = getattr(config, name, None)
    return fields


def layers_activation_bytes(shape: ModelShape, micro_batch: int, modes: dict[str, int],
                            tp: int = 1, sequence_parallel: bool = False) -> int:
    """Bytes consecutive layers of one chunk keep, `modes` as recompute_layers gives them. BERT's
    padding mask is one tensor the model hands every layer (and every checkpoint unit): kept once,
    where layer_activation_bytes counts it per layer."""
    total = sum(count * layer_activation_bytes(shape, micro_batch, tp, sequence_parallel, mode)
                for mode, count in modes.items() if count)
    if shape.model == "bert":
        total -= (sum(modes.values()) - 1) * _attention_mask_bytes(shape, micro_batch)
    return total


def config_layer_shape(model: str, config: Any) -> ModelShape:
    """The ModelShape of one layer of a Megatron TransformerConfig (or the flags' stand-in,
    models/flags.py's activation_config) at one token: a layer's bytes and FLOPs read neither the
    vocabulary nor the position table, so those are placeholders."""
    return ModelShape(model=model, num_layers=config.num_layers, hidden_size=config.hidden_size,
                      num_attention_heads=config.num_attention_heads,
                      ffn_hidden_size=config.ffn_hidden_size, seq_length=1, padded_vocab_size=1,
                      max_position_embeddings=1, dtype=config_dtype(config),
                      hidden_dropout=config.hidden_dropout,
                      attention_dropout=config.attention_dropout,
                      num_query_groups=getattr(config, "num_query_groups", None),
                      **config_architecture(config))


def chunk_activation_bytes(model: str, config: Any, sizes: Sequence[int], micro_batch_size: int,
                           num_model_chunks: int, pipeline_size: int) -> List[int]:
    """Bytes one forward of each micro-batch keeps on one model chunk until its backward, on one
    tensor-parallel rank: the chunk's layers at the micro-batch's own length (sizes are token
    counts, micro-batch x padded length), with the config's tensor and sequence parallelism,
    recompute, dropout and dtype. The embedding's and the output head's bytes are left out, as
    in the search's per-chunk figure (search/cost.py), so that every pipeline rank computes the
    same numbers (the adaptive policy's choice between spines and its fallback must agree)."""
    split = dataclasses.replace(PipelineSplit.from_config(config), pipeline_size=pipeline_size,
                                virtual_size=num_model_chunks if num_model_chunks > 1 else None)
    layers = split.largest_chunk()  # the fullest chunk (uneven splits: --decoder-first-... etc.)
    modes = recompute_layers(config, layers)
    tp = getattr(config, "tensor_model_parallel_size", 1) or 1
    sp = bool(getattr(config, "sequence_parallel", False))
    base = config_layer_shape(model, config)
    by_length: dict[int, int] = {}
    estimates = []
    for tokens in sizes:
        length = max(1, -(-int(tokens) // micro_batch_size))
        if length not in by_length:
            shape = dataclasses.replace(base, seq_length=length)
            by_length[length] = layers_activation_bytes(shape, micro_batch_size, modes, tp, sp)
        estimates.append(by_length[length])
    return estimates
