"""BERT on Megatron-Core: model chunks per pipeline rank, forward step, masked-LM and sentence-order
losses.

BERT_SPEC is the ModelSpec the training loop, the runtime and the platform use. The samples are
Megatron-Core's BERTMaskedWordPieceDataset dicts (text, types, labels, is_random, padding_mask,
loss_mask), read the way Megatron-LM's pretrain_bert.py reads them.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core.models.bert.bert_model import BertModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_dpp import kernels
from megatron_dpp.data.bert_datasets import build_bert_datasets
from megatron_dpp.mcore.direct_layer import with_direct_classes
from megatron_dpp.models.bert_mask import LocalMaskBertModel
from megatron_dpp.models.init import build_model_chunks, stacked_model_global_name, stage_placement
from megatron_dpp.models.memory_model import chunk_activation_bytes
from megatron_dpp.models.sdpa_attention import with_core_attention
from megatron_dpp.models import families
from megatron_dpp.models.spec import ModelSpec
from megatron_dpp.pipeline.placement import INTERLEAVED

# Sentence-order prediction has two classes; Megatron-LM gives the token-type embedding two rows
# when the binary head is on, none otherwise.
SENTENCE_ORDER_CLASSES = 2


@dataclass(frozen=True)
class BertShape:
    """What BertModel needs beyond TransformerConfig."""

    padded_vocab_size: int  # Megatron-LM's padding: a multiple of divisible-by x tp size
    max_position_embeddings: int
    binary_head: bool  # the sentence-order head (Megatron-LM: on unless --bert-no-binary-head)


def bert_layer_spec(attention: Optional[str] = None) -> ModuleSpec:
    """Transformer Engine's layers where megatron_dpp.kernels chose its attention, else
    Megatron-Core's local layers with the chosen core attention (kernels.SDPA, FLASH_ATTN, LOCAL);
    None: this machine's default (kernels.core_attention())."""
    attention = attention or kernels.core_attention().module
    if attention == kernels.TRANSFORMER_ENGINE:
        from megatron.core.models.bert.bert_layer_specs import (
            get_bert_layer_with_transformer_engine_spec,
        )

        return get_bert_layer_with_transformer_engine_spec()
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec

    return with_direct_classes(with_core_attention(bert_layer_local_spec, attention))


def build_bert_chunks(config: TransformerConfig, shape: BertShape, seed: int,
                      deferred_weight_grads: bool = False,
                      attention: Optional[str] = None,
                      placement: str = INTERLEAVED) -> list[BertModel]:
    """The model chunks of this pipeline rank (one per virtual stage), initialized layout-free;
    attention: the core attention megatron_dpp.kernels chose (None: this machine's default);
    placement: which stage each chunk is (--dpp-stage-placement, models/init.py).
    Embeddings and the masked-LM output layer share their weight, as in Megatron-LM.

    deferred_weight_grads (--dpp-split-backward): DeferredBertModel over Megatron-Core's local
    layer spec (never Transformer Engine's; kernels chooses no Transformer Engine attention with
    it), whose weight gradients a split backward defers to W; the same parameters,
    initialization and numbers as the default chunks (core attention has no weights)."""
    model_class = LocalMaskBertModel
    spec = bert_layer_spec(attention or
                           kernels.core_attention(split_backward=deferred_weight_grads).module)
    if deferred_weight_grads:
        from megatron_dpp.models.weight_grad import DeferredBertModel

        model_class = DeferredBertModel
    return build_model_chunks(
        model_class, spec, config, seed, _global_name, placement=placement,
        num_tokentypes=SENTENCE_ORDER_CLASSES if shape.binary_head else 0,
        vocab_size=shape.padded_vocab_size,
        max_sequence_length=shape.max_position_embeddings,
        share_embeddings_and_output_weights=True,
        position_embedding_type="learned_absolute",
        add_binary_head=shape.binary_head)


def _build_chunks_from_args(args: argparse.Namespace, config: TransformerConfig,
                            seed: int) -> list[BertModel]:
    shape = BertShape(padded_vocab_size=args.padded_vocab_size,  # set by build_tokenizer
                      max_position_embeddings=args.max_position_embeddings,
                      binary_head=args.bert_binary_head)
    return build_bert_chunks(config, shape, seed,
                             deferred_weight_grads=getattr(args, "dpp_split_backward", False),
                             attention=kernels.core_attention_from_args(args).module,
                             placement=stage_placement(args))


_LAYERS_PREFIX = "encoder.layers."


def _global_name(model: BertModel, local_name: str) -> str:
    """Map a chunk-local parameter name to its name in the unsplit model."""
    return stacked_model_global_name(model.encoder.layers, _LAYERS_PREFIX,
                                     model.share_embeddings_and_output_weights, local_name)


# ----------------------------------------------------------------------------------------------
# forward step and losses (called by Megatron's schedules and the DPP runtime once per micro-batch)
# ----------------------------------------------------------------------------------------------
def bert_loss(loss_mask: torch.Tensor, sentence_order: Optional[torch.Tensor], output_tensor):
    """Megatron-LM's BERT loss: the masked-LM loss averaged over the masked tokens, plus the
    sentence-order loss averaged over the samples when the binary head is on. Reports each as
    [sum, count] (the training loop averages every reported loss over microbatches and
    data-parallel ranks by its count).

    A micro-batch with no masked token (Megatron's masking can leave a very short sample without
    one) adds 0 to the masked-LM loss; Megatron-LM divides 0 by 0 there and every gradient of the
    iteration becomes NaN."""
    lm_losses, sentence_order_logits = output_tensor
    mask = loss_mask.reshape(-1).float()
    lm_sum = torch.sum(lm_losses.float().reshape(-1) * mask)
    masked_tokens = mask.sum()
    loss = lm_sum / masked_tokens.clamp(min=1.0)
    report = {"lm loss": torch.stack([lm_sum.detach(), masked_tokens.detach()])}
    if sentence_order_logits is not None and sentence_order is not None:
        labels = sentence_order.reshape(-1)
        sop_loss = F.cross_entropy(sentence_order_logits.reshape(-1, SENTENCE_ORDER_CLASSES).float(),
                                   labels, ignore_index=-1)
        counted = (labels != -1).sum().float()
        loss = loss + sop_loss
        report["sop loss"] = torch.stack([sop_loss.detach() * counted, counted])
    return loss, report


def bert_forward_step(data_iterator, model, device: torch.device, binary_head: bool):
    """Reads exactly one micro-batch; every stage needs the padding mask (for attention)."""
    batch = next(data_iterator)
    tokens = batch["text"].long().to(device, non_blocking=True)
    padding_mask = batch["padding_mask"].long().to(device, non_blocking=True)
    labels = batch["labels"].long().to(device, non_blocking=True)
    loss_mask = batch["loss_mask"].float().to(device, non_blocking=True)
    types = batch["types"].long().to(device, non_blocking=True) if binary_head else None
    sentence_order = batch["is_random"].long().to(device, non_blocking=True) if binary_head else None
    output = model(tokens, padding_mask, tokentype_ids=types, lm_labels=labels)
    return output, partial(bert_loss, loss_mask, sentence_order)


def make_bert_forward_step(args: argparse.Namespace, device: torch.device):
    """forward_step_func(data_iterator, model) for Megatron's schedules, tensors moved to device;
    token types and sentence order only with the binary head (args.bert_binary_head)."""
    return partial(bert_forward_step, device=device, binary_head=args.bert_binary_head)


def bert_microbatch_work(item: Any) -> int:
    """Relative work of one microbatch: its token count (text.numel()); 1 without tokens. BERT's
    samples are whole padded sequences of one length per batch, so tokens order its microbatches
    as their FLOPs do; its activation bytes count the same tokens."""
    if isinstance(item, dict) and isinstance(item.get("text"), torch.Tensor):
        return int(item["text"].numel())
    return 1



# ----------------------------------------------------------------------------------------------
# what the search's profiler feeds a layer and a chunk
# ----------------------------------------------------------------------------------------------
def bert_sample_layer_mask(shape: Any, batch: int) -> torch.Tensor:
    """The [b, 1, s, s] padding mask BertModel makes (True = masked), one padded token per sample
    so that the mask is not trivial."""
    keep = torch.ones(batch, shape.seq_length, dtype=torch.bool)
    keep[:, -1] = False
    return ~(keep[:, None, :, None] & keep[:, None, None, :])


def bert_sample_model_inputs(shape: Any, batch: int) -> dict:
    """Random tokens as labels too, no padding; token types with the binary head."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape.padded_vocab_size, (batch, shape.seq_length),
                           generator=generator)
    inputs = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "lm_labels": tokens}
    if shape.bert_binary_head:
        inputs["tokentype_ids"] = torch.zeros_like(tokens)
    return inputs


BERT_SPEC = ModelSpec(
    family=families.BERT,
    build_chunks=_build_chunks_from_args,
    make_forward_step=make_bert_forward_step,
    microbatch_work=lambda config: bert_microbatch_work,
    microbatch_tokens=bert_microbatch_work,
    build_datasets=build_bert_datasets,
    # BERT's own Megatron-Core modules that call torch.cuda; the platform patches them on CPU.
    cpu_patched_modules=(
        "megatron.core.models.common.embeddings.language_model_embedding",  # current_device()
    ),
    global_parameter_name=_global_name,
    activation_bytes=partial(chunk_activation_bytes, "bert"),
    layer_spec=bert_layer_spec,
    config_fields=lambda args: {},  # Megatron-Core's defaults (LayerNorm, GeLU, biases)
    transformer_layers=lambda model: model.encoder.layers,
    sample_layer_inputs=lambda shape, batch: {"attention_mask": bert_sample_layer_mask(shape, batch)},
    sample_model_inputs=bert_sample_model_inputs,
)
