"""Whether the ranks that share one GPU fit its memory, by the memory model the search uses
(models/memory_model.py): the launcher's refusal of more ranks than a GPU holds.

The estimate is a lower bound, so that only a layout that cannot fit is refused: per pipeline
rank, the model states of its transformer layers (an even split of --num-layers; the embedding
and output layer, whose vocabulary is known only once the tokenizer is built, left out) and the
activations Megatron's 1F1B keeps on it (pipeline rank p holds pp - p micro-batches of the full
sequence), summed over the ranks on the first GPU (pipeline ranks 0..N-1, the fullest). Nothing
here counts the CUDA context, the allocator's slack or the workspaces: a layout can pass and still
run out of memory.
"""
from __future__ import annotations

import argparse
import os
from typing import Optional

from megatron_dpp.shared_gpu import ranks_per_gpu

GPU_MEMORY_ENV = "DPP_GPU_MEMORY_BYTES"
"""The GPU's memory in bytes, which the launcher reads from torch for its flag check."""


def first_gpu_bytes(args: argparse.Namespace, per_gpu: int) -> int:
    """The lower bound above, in bytes, for the ranks on the first GPU."""
    from megatron_dpp.models.flags import activation_config, largest_microbatch_activation_bytes
    from megatron_dpp.models.memory_model import (ModelShape, config_architecture, config_dtype,
                                                  layer_parameter_count, model_state_bytes)

    config = activation_config(args)
    shape = ModelShape(model=args.model, num_layers=args.num_layers, hidden_size=args.hidden_size,
                       num_attention_heads=args.num_attention_heads,
                       ffn_hidden_size=args.ffn_hidden_size, seq_length=args.seq_length,
                       padded_vocab_size=1, max_position_embeddings=1, dtype=config_dtype(config),
                       num_query_groups=getattr(args, "num_query_groups", None),
                       **config_architecture(config))
    pp = args.pipeline_model_parallel_size
    tp = args.tensor_model_parallel_size
    layers = -(-args.num_layers // pp)
    states = model_state_bytes(layers * layer_parameter_count(shape, tp), shape.dtype,
                               args.parallel.data_parallel_size,
                               bool(args.use_distributed_optimizer))
    microbatch = largest_microbatch_activation_bytes(args) or 0
    ranks = range(min(per_gpu, pp))
    return sum(states + (pp - p) * microbatch for p in ranks)


def shared_gpu_memory_error(args: argparse.Namespace) -> Optional[str]:
    """One line where the ranks on one GPU cannot fit it; None where they may, or where the
    launcher gave no GPU memory (one rank per GPU, or a check outside the launcher)."""
    per_gpu = ranks_per_gpu()
    memory = os.environ.get(GPU_MEMORY_ENV, "")
    if per_gpu == 1 or not memory:
        return None
    needed = first_gpu_bytes(args, per_gpu)
    if needed <= int(memory):
        return None
    gib = 1 << 30
    return (f"{per_gpu} ranks per GPU need at least {needed / gib:.1f} GiB on one GPU (their "
            f"layers' parameters, gradients and optimizer state, and 1F1B's activations, by "
            f"models/memory_model.py); the GPU has {int(memory) / gib:.1f} GiB: lower "
            f"RANKS_PER_GPU, the model or --micro-batch-size")
