"""ModelSpec: what the training loop, the pipeline runtime and the platform need from a model."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from megatron_dpp.models.families import ModelFamily

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig


@dataclass(frozen=True)
class ModelSpec:
    """One model family (GPT, ...) as the rest of megatron_dpp sees it."""

    family: ModelFamily
    """What the model is without torch (models/families.py): its name, flags, tokenizer."""

    build_chunks: Callable[[argparse.Namespace, TransformerConfig, int], list[torch.nn.Module]]
    """(args, config, seed) -> the model chunks of this pipeline rank, one per virtual stage.

    Call after parallel_state is initialized. The weights depend on the seed only, not on the
    parallel layout. args carries padded_vocab_size, max_position_embeddings and
    untie_embeddings_and_output_weights."""

    make_forward_step: Callable[[argparse.Namespace, torch.device], Callable]
    """(args, device) -> forward_step_func(data_iterator, model) for Megatron's schedules and the
    DPP runtime: reads one micro-batch, moves it to device, returns (output, loss_func). The loss
    function reports each loss as a [sum, count] tensor under its name, "lm loss" among them (the
    training loop logs each name's sum / count over the global batch)."""

    microbatch_work: Callable[[Any], Callable[[Any], int]]
    """config (the model's TransformerConfig, or the flags' models/flags.py activation_config) ->
    the relative work of one micro-batch item as the data iterator yields it, in tokens (the
    runtime balances and orders micro-batches by it): GPT's and Llama's count each document's
    causal attention beside its tokens (models/gpt.py gpt_microbatch_work); 1 when the item
    carries nothing to measure."""

    microbatch_tokens: Callable[[Any], int]
    """Tokens of one micro-batch item: what activation_bytes counts (memory grows with the
    tokens, work faster), kept apart from microbatch_work everywhere."""

    build_datasets: Callable[[argparse.Namespace, Any], tuple]
    """(args, tokenizer) -> (train, valid, test) datasets; a split with no share is None."""

    cpu_patched_modules: tuple[str, ...]
    """Megatron-Core modules specific to this model that call torch.cuda or create tensors on
    "cuda": on CPU, the platform replaces their `torch` global (see megatron_dpp.mcore.cpu_patches)."""

    global_parameter_name: Callable[[torch.nn.Module, str], str]
    """(chunk, chunk-local parameter name) -> the parameter's name in the unsplit model; the
    layout-independent init (megatron_dpp.models.init) seeds each parameter by this name."""

    activation_bytes: Callable[[TransformerConfig, Sequence[int], int, int, int], list[int]]
    """(config, micro-batch token counts as microbatch_tokens counts them, micro-batch size, model
    chunks per rank, pipeline size) -> the bytes one forward of each micro-batch keeps on one model chunk
    until its backward, on one tensor-parallel rank: what the DPP runtime's memory budget admits
    against. The search's analytical model (models/memory_model.py's chunk_activation_bytes)."""

    layer_spec: Callable[[Optional[str]], Any]
    """(core attention megatron_dpp.kernels chose, None: this machine's default) -> Megatron-Core's
    ModuleSpec of one transformer layer, as build_chunks uses it (the search's profiler times it)."""

    config_fields: Callable[[argparse.Namespace], dict]
    """args -> the model's own TransformerConfig fields (normalization, MLP, attention groups...),
    on top of the shared ones (models/transformer_config.py adds them)."""

    transformer_layers: Callable[[torch.nn.Module], torch.nn.ModuleList]
    """A model chunk (unwrapped) -> its transformer layers (the profiler hooks each)."""

    sample_layer_inputs: Callable[[Any, int], dict]
    """(models.memory_model.ModelShape, micro-batch size) -> the keyword inputs one transformer
    layer gets in training besides its hidden states (attention_mask: None for the layer spec's own
    causal mask; Llama's rotary_pos_emb); the profiler's sample input."""

    sample_model_inputs: Callable[[Any, int], dict]
    """(ModelShape, micro-batch size) -> keyword inputs of a whole chunk's forward with random
    tokens and labels, as the forward step passes them; the profiler's sample input."""

    layer_spec_options: Callable[[argparse.Namespace], dict] = lambda args: {}
    """args -> layer_spec's keyword arguments beyond the core attention (GPT's --normalization and
    --qk-layernorm choose the spec's norms), so that the profiler builds the trained layer."""

    @property
    def name(self) -> str:
        """The model's name, as in MODEL_SPECS and --model (e.g. "gpt")."""
        return self.family.name
