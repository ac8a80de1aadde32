"""--log-throughput: the model's floating-point operations per iteration and TFLOP/s per GPU, as
Megatron-LM computes them (its `num_floating_point_operations`, megatron/training/training.py at
core_v0.16.1, for the dense transformers built here: no MoE, multi-token prediction, latent or
linear attention), so that a figure read from our log compares with one from Megatron-LM's.

What Megatron-LM counts, per token of the global batch at the full --seq-length (a run with
--variable-seq-lengths trains fewer tokens than it counts):
- every GEMM three times (forward, data gradient, weight gradient), two operations per
  multiply-add;
- per layer: the query/key/value and output projections, the MLP's GEMMs (two for a plain MLP,
  three for a gated unit such as SwiGLU), and the core attention's two products, halved as if
  every model's attention were causal (BERT's too: Megatron-LM makes no exception);
- the output layer's logits over the padded vocabulary.
Norms, activations, softmax, dropout and the embedding lookup are not counted.
"""
from __future__ import annotations

from dataclasses import dataclass

GEMM_PASSES = 3  # forward, data gradient, weight gradient
OPS_PER_MULTIPLY_ADD = 2


@dataclass(frozen=True)
class ModelShape:
    """The numbers the count needs (Megatron-Core's TransformerConfig names)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    kv_channels: int
    num_query_groups: int
    gated_linear_unit: bool  # SwiGLU (Llama): the MLP's first GEMM is twice as wide
    seq_length: int
    padded_vocab_size: int

    @classmethod
    def of(cls, config, seq_length: int, padded_vocab_size: int) -> "ModelShape":
        """From a TransformerConfig and the run's sequence length and padded vocabulary."""
        return cls(num_layers=config.num_layers, hidden_size=config.hidden_size,
                   ffn_hidden_size=config.ffn_hidden_size,
                   num_attention_heads=config.num_attention_heads,
                   kv_channels=config.kv_channels,
                   num_query_groups=config.num_query_groups or config.num_attention_heads,
                   gated_linear_unit=bool(config.gated_linear_unit),
                   seq_length=seq_length, padded_vocab_size=padded_vocab_size)


def floating_point_operations(shape: ModelShape, batch_size: int) -> float:
    """Operations of one iteration over `batch_size` samples (the global batch)."""
    h = shape.hidden_size
    query = shape.kv_channels * shape.num_attention_heads
    key_value = shape.kv_channels * shape.num_query_groups
    mlp_gemms = 3 if shape.gated_linear_unit else 2
    per_token_multiply_adds = (
        shape.num_layers * (
            h * (query + 2 * key_value)                 # query, key, value projections
            + query * shape.seq_length / 2 * 2          # QK^T and its product with V, causal half
            + query * h                                 # output projection
            + h * shape.ffn_hidden_size * mlp_gemms)    # MLP
        + h * shape.padded_vocab_size)                  # logits
    return (batch_size * shape.seq_length * GEMM_PASSES * OPS_PER_MULTIPLY_ADD
            * per_token_multiply_adds)


def tflops_per_gpu(operations: float, seconds_per_iteration: float, world_size: int) -> float:
    """Megatron-LM's `throughput per GPU (TFLOP/s/GPU)`: every rank counts as one GPU (on a CPU
    run too, where the figure is the ranks' rate)."""
    return operations / (max(seconds_per_iteration, 1e-12) * 1e12 * world_size)
