"""models/bert.py on one rank: Megatron-Core's BertModel built by the spec, its forward step on a
batch shaped like Megatron-Core's BERT dataset's, the masked-LM and sentence-order losses as
Megatron-LM computes them, reported as [sum, count], and the layout-independent init (layer norms
of the LM head start at 1, the output layer shares the embedding)."""
from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F

from megatron_dpp.models.bert import (BERT_SPEC, BertShape, bert_loss, bert_microbatch_work,
                                      build_bert_chunks, make_bert_forward_step)

from _one_rank import one_rank_megatron

SEQ, BATCH, HIDDEN, VOCAB = 16, 2, 32, 128


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """A one-rank Megatron-Core setup (the CPU patches BERT needs, gloo, tp = pp = 1)."""
    with one_rank_megatron(tmp_path_factory.mktemp("bert"), BERT_SPEC.cpu_patched_modules):
        yield


def _config():
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4,
                             ffn_hidden_size=4 * HIDDEN, use_cpu_initialization=True,
                             hidden_dropout=0.0, attention_dropout=0.0,
                             bias_activation_fusion=False, bias_dropout_fusion=False,
                             masked_softmax_fusion=False, gradient_accumulation_fusion=False)


def _batch(seed: int = 0) -> dict:
    """A collated batch as Megatron-Core's BERTMaskedWordPieceDataset yields it."""
    generator = torch.Generator().manual_seed(seed)
    text = torch.randint(5, VOCAB, (BATCH, SEQ), generator=generator)
    padding_mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    padding_mask[1, 12:] = 0  # the second sample is shorter
    labels = torch.full((BATCH, SEQ), -1, dtype=torch.int64)
    labels[:, 3] = text[:, 3]
    labels[0, 7] = text[0, 7]
    loss_mask = (labels != -1).long()
    types = torch.zeros(BATCH, SEQ, dtype=torch.int64)
    types[:, SEQ // 2:] = 1
    return {"text": text, "types": types, "labels": labels, "is_random": torch.tensor([0, 1]),
            "padding_mask": padding_mask, "loss_mask": loss_mask, "truncated": torch.tensor([0, 0])}


def _model(binary_head: bool):
    (chunk,) = build_bert_chunks(_config(), BertShape(VOCAB, SEQ, binary_head), seed=7)
    return chunk


@pytest.mark.parametrize("binary_head", [True, False])
def test_forward_step_and_losses_are_megatron_lms(megatron, binary_head):
    model = _model(binary_head)
    args = argparse.Namespace(bert_binary_head=binary_head)
    forward_step = make_bert_forward_step(args, torch.device("cpu"))
    batch = _batch()
    output, loss_func = forward_step(iter([batch]), model)
    loss, report = loss_func(output)

    lm_losses, sop_logits = output
    mask = batch["loss_mask"].float().reshape(-1)
    expected_lm = torch.sum(lm_losses.float().reshape(-1) * mask) / mask.sum()
    assert torch.allclose(report["lm loss"], torch.stack([expected_lm * mask.sum(), mask.sum()]))
    if binary_head:
        assert sop_logits.shape == (BATCH, 2)
        expected_sop = F.cross_entropy(sop_logits.float(), batch["is_random"])
        assert torch.allclose(loss, expected_lm + expected_sop)
        assert torch.allclose(report["sop loss"], torch.stack([expected_sop * BATCH,
                                                               torch.tensor(float(BATCH))]))
    else:
        assert sop_logits is None and set(report) == {"lm loss"}
        assert torch.allclose(loss, expected_lm)
    loss.backward()  # the loss is differentiable end to end
    assert model.embedding.word_embeddings.weight.grad is not None


def test_token_types_only_with_the_binary_head(megatron):
    with_head, without = _model(True), _model(False)
    assert with_head.embedding.tokentype_embeddings.weight.shape[0] == 2
    assert without.embedding.tokentype_embeddings is None


def test_layout_independent_init(megatron):
    a, b = _model(True), _model(True)
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(x, y), name  # the same seed gives the same model
    assert torch.equal(a.lm_head.layer_norm.weight, torch.ones(HIDDEN))
    assert torch.count_nonzero(a.lm_head.layer_norm.bias) == 0
    assert a.share_embeddings_and_output_weights and a.output_layer.weight is None  # tied


def test_ignored_sentence_order_labels_are_not_counted(megatron):
    logits = torch.tensor([[2.0, -1.0], [0.5, 0.5]])
    lm = torch.ones(BATCH, SEQ)
    loss_mask = torch.zeros(BATCH, SEQ)
    loss_mask[0, 0] = 1
    _loss, report = bert_loss(loss_mask, torch.tensor([1, -1]), (lm, logits))
    assert report["sop loss"][1].item() == 1.0
    assert torch.isclose(report["sop loss"][0], F.cross_entropy(logits[:1], torch.tensor([1])))


def test_a_micro_batch_without_masked_tokens_adds_nothing_and_no_nan():
    # Megatron's masking leaves some very short samples without a masked token; 0/0 would make
    # every gradient of the iteration NaN.
    lm = torch.full((BATCH, SEQ), 3.0, requires_grad=True)
    loss, report = bert_loss(torch.zeros(BATCH, SEQ), None, (lm, None))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(lm.grad, torch.zeros(BATCH, SEQ))
    assert report["lm loss"].tolist() == [0.0, 0.0]


def test_microbatch_work_is_its_token_count():
    assert bert_microbatch_work(_batch()) == BATCH * SEQ
    assert bert_microbatch_work(object()) == 1


def test_the_loop_averages_every_reported_loss_by_its_count(megatron):
    """training/step.py's reduce_losses: each name's sums and counts over the microbatches (and
    data-parallel ranks), "lm loss" first; names a microbatch does not report count nothing."""
    from megatron_dpp.training.step import reduce_losses

    reported = [{"lm loss": torch.tensor([2.0, 4.0]), "sop loss": torch.tensor([1.0, 2.0])},
                {"lm loss": torch.tensor([4.0, 4.0])}]
    reduced = reduce_losses(reported, torch.device("cpu"))
    assert list(reduced) == ["lm loss", "sop loss"]
    assert reduced["lm loss"] == (0.75, 8.0) and reduced["sop loss"] == (0.5, 2.0)
