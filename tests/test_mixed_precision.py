"""--bf16 / --fp16 model chunks (training/loop.wrap_for_mixed_precision), on CPU in one process:
without Megatron's Float16Module a 16-bit GPT or BERT forward mixes dtypes (torch's position
embedding and layer norms are built in fp32) and fails; wrapped, every parameter is 16-bit and
the losses come back in fp32, as in Megatron-LM. (The flags themselves need a GPU; the models
do not.)"""
from __future__ import annotations

import pytest
import torch

from megatron_dpp.models.bert import BERT_SPEC, BertShape, build_bert_chunks
from megatron_dpp.models.gpt import GPTShape, build_gpt_chunks
from megatron_dpp.training.loop import wrap_for_mixed_precision

from _one_rank import one_rank_megatron

SEQ, BATCH, HIDDEN, VOCAB = 8, 2, 32, 128


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    with one_rank_megatron(tmp_path_factory.mktemp("mp"), BERT_SPEC.cpu_patched_modules):
        yield


def _config(dtype: torch.dtype):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4,
                             use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                             bias_activation_fusion=False, bias_dropout_fusion=False,
                             masked_softmax_fusion=False, gradient_accumulation_fusion=False,
                             bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
                             params_dtype=dtype, pipeline_dtype=dtype)


def _chunk_and_forward(model: str, dtype: torch.dtype):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    if model == "gpt":
        (chunk,) = build_gpt_chunks(_config(dtype), GPTShape(VOCAB, SEQ, False), seed=3)
        positions = torch.arange(SEQ).repeat(BATCH, 1)
        return chunk, lambda m: m(tokens, positions, None, labels=tokens)
    (chunk,) = build_bert_chunks(_config(dtype), BertShape(VOCAB, SEQ, True), seed=3)
    padding = torch.ones(BATCH, SEQ, dtype=torch.long)
    types = torch.zeros(BATCH, SEQ, dtype=torch.long)
    return chunk, lambda m: m(tokens, padding, tokentype_ids=types, lm_labels=tokens)[0]


@pytest.mark.parametrize("model", ["gpt", "bert"])
def test_16_bit_chunks_need_float16_module_and_return_fp32_losses(megatron, model):
    chunk, forward = _chunk_and_forward(model, torch.bfloat16)
    assert {p.dtype for p in chunk.parameters()} == {torch.bfloat16, torch.float32}
    with pytest.raises(RuntimeError):  # the bug: fp32 layers meet bf16 activations
        forward(chunk)
    (wrapped,) = wrap_for_mixed_precision(_config(torch.bfloat16), [chunk])
    assert {p.dtype for p in wrapped.parameters()} == {torch.bfloat16}
    losses = forward(wrapped)
    assert losses.dtype == torch.float32 and losses.shape == (BATCH, SEQ)
    assert torch.isfinite(losses).all()
    losses.sum().backward()
    grads = [p.grad for p in wrapped.parameters() if p.grad is not None]  # BERT's heads: unused
    assert len(grads) > 10 and all(grad.dtype == torch.bfloat16 for grad in grads)


def test_fp32_chunks_are_left_alone(megatron):
    chunk, _ = _chunk_and_forward("gpt", torch.float32)
    assert wrap_for_mixed_precision(_config(torch.float32), [chunk]) == [chunk]
