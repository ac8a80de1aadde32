"""--bf16 / --fp16 model chunks (training/setup.wrap_for_mixed_precision), on CPU in one process:
without Megatron's Float16Module a 16-bit GPT or BERT forward mixes dtypes (torch's position
embedding and layer norms are built in fp32) and fails; wrapped, every parameter is 16-bit and
the losses come back in fp32, as in Megatron-LM.

And training with the flags on CPU ranks (megatron_dpp/platform.py lets Megatron-Core's 16-bit
optimizer take CPU tensors): at pp=2 in bf16, --use-dpp gives Megatron's 1F1B's losses bit for bit
(bf16 activations through shm_tensor); bf16 with the distributed optimizer resumes from a
checkpoint to the uninterrupted run's losses bit for bit; fp16 lowers its loss scale at every
overflow, skips those steps (counted per log interval, as Megatron-LM) and then trains, at pp=2
with --use-dpp as with Megatron's 1F1B, bit for bit."""
from __future__ import annotations

import pytest
import torch

from megatron_dpp.models.bert import BERT_SPEC, BertShape, build_bert_chunks
from megatron_dpp.models.gpt import GPTShape, build_gpt_chunks
from megatron_dpp.training.setup import wrap_for_mixed_precision

import re

from _one_rank import one_rank_megatron
from _train_util import run_training

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


SCHEDULE = ["--lr-decay-iters", "6", "--train-iters", "6"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bf16_dpp_matches_megatron_at_pp2():
    flags = ["--bf16", *SCHEDULE, "--pipeline-model-parallel-size", "2"]
    rc, megatron, _norms, out = run_training(flags, nproc=2)
    assert rc == 0 and len(megatron) == 6, out[-3000:]
    rc, dpp, _norms, out = run_training([*flags, "--use-dpp", "--dpp-timeout", "60"], nproc=2)
    assert rc == 0, out[-3000:]
    assert dpp == megatron


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bf16_distributed_optimizer_resumes_bit_for_bit(tmp_path):
    flags = ["--bf16", "--use-distributed-optimizer", *SCHEDULE]
    rc, uninterrupted, _norms, out = run_training(flags, nproc=2)
    assert rc == 0 and len(uninterrupted) == 6, out[-3000:]
    save = str(tmp_path / "ckpt")
    rc, first, _norms, out = run_training([*flags, "--train-iters", "3", "--save", save], nproc=2)
    assert rc == 0 and first == uninterrupted[:3], out[-3000:]
    rc, resumed, _norms, out = run_training([*flags, "--load", save], nproc=2)
    assert rc == 0 and resumed == uninterrupted[3:], out[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fp16_lowers_its_loss_scale_at_overflows_then_trains_and_dpp_follows():
    flags = ["--fp16", "--train-iters", "24", "--log-interval", "4",
             "--pipeline-model-parallel-size", "2"]
    rc, losses, _norms, out = run_training(flags, nproc=2)
    assert rc == 0 and len(losses) == 6, out[-3000:]
    scales = [float(x) for x in re.findall(r"loss scale: ([0-9.]+)", out)]
    skipped = [int(x) for x in re.findall(r"number of skipped iterations:\s+(\d+)", out)]
    assert len(scales) == len(skipped) == 6, out[-3000:]
    # From Megatron's initial 2**32, halved at every overflow (hysteresis 2 after the first).
    assert scales[0] < 2.0 ** 32 and scales == sorted(scales, reverse=True), scales
    assert skipped[0] == 4 and skipped[-1] == 0, skipped  # per interval, not a running total
    assert losses[-1] < losses[0] - 0.2, losses  # the steps taken train
    # The DPP runtime scales the loss as Megatron's schedule does: the same overflows and losses.
    rc, dpp, _norms, dpp_out = run_training([*flags, "--use-dpp", "--dpp-timeout", "60"], nproc=2)
    assert rc == 0, dpp_out[-3000:]
    assert dpp == losses and re.findall(r"loss scale: [0-9.]+", dpp_out) == \
        re.findall(r"loss scale: [0-9.]+", out)


@pytest.mark.timeout(300)
def test_megatron_lm_loss_scale_flags_set_the_scaler():
    """A constant --loss-scale never moves and skips nothing; the dynamic scaler starts at
    --initial-loss-scale and doubles after each --loss-scale-window updates without overflow."""
    rc, _losses, _norms, out = run_training(["--fp16", "--loss-scale", "256", "--train-iters", "4"],
                                            nproc=1)
    assert rc == 0, out[-3000:]
    assert re.findall(r"loss scale: ([0-9.]+)", out) == ["256.0"] * 4
    assert re.findall(r"number of skipped iterations:\s+(\d+)", out) == ["0"] * 4
    rc, _losses, _norms, out = run_training(
        ["--fp16", "--initial-loss-scale", "1024", "--loss-scale-window", "2", "--hysteresis", "1",
         "--train-iters", "4"], nproc=1)
    assert rc == 0, out[-3000:]
    assert re.findall(r"loss scale: ([0-9.]+)", out) == ["1024.0", "2048.0", "2048.0", "4096.0"]
