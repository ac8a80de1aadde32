"""--dataloader-inter-document-masking: packed samples whose documents attend only to themselves.

- the data: boundaries after each end-of-document token, positions restarting per document, a
  micro-batch folded into one THD row (padding its own segment);
- SdpaCoreAttention on a THD row equals SDPA with the dense block-diagonal causal mask (forward
  and q/k/v gradients, fp32, grouped-query attention too);
- a model (GPT with learned positions; Llama-style: RoPE, RMSNorm, SwiGLU, GQA) on a packed micro-
  batch of 1 or 2 samples gives every token the loss, and the parameters the gradients, of each
  document run alone as its own sequence (1e-5 relative). The comparison: every position of a
  document, with the labels of the packed sample (a document's last token, its EOD, has the next
  document's first token as label, as in Megatron's packing); the gradients are of the summed
  loss over the tokens that are not EOD (--eod-mask-loss), so no label crosses a document; and
  our direct layer's THD path equals Megatron-Core's own layer forward;
- training (real ranks on the sample corpus): --use-dpp equals Megatron's 1F1B with the flag at
  pp=2, with --dpp-split-backward too, and Llama at pp=2; the flag changes the losses;
- the one-line refusals;
- GPU (marked gpu): torch's varlen_attn (and flash-attn's varlen kernel where installed) against
  SDPA per document in bf16, and a training run with the flag.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from _gpu import gpu_env
from _one_rank import one_rank_megatron
from _train_util import (PYTHON, REPO_ROOT, TINY_GPT_ARGS, assert_losses_close, data_args,
                         flag_error, run_training)
from test_attention_kernels import _config as _attention_config
from megatron_dpp.data.documents import (document_boundaries, positions_within_documents,
                                         with_document_boundaries)
from megatron_dpp.data.iterators import collate_samples
from megatron_dpp.models.gpt import GPT_SPEC

EOD = 127
VOCAB = 128
HEADS, HEAD_DIM = 4, 8  # test_attention_kernels' _config's (its shapes)
REL_TOL = 1e-5


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    with one_rank_megatron(tmp_path_factory.mktemp("document_masking"),
                           GPT_SPEC.cpu_patched_modules):
        yield


# ----------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------
def test_boundaries_follow_end_of_document_tokens():
    tokens = torch.tensor([5, 6, EOD, 7, EOD, 8, 9, 10])
    cu = document_boundaries(tokens, EOD)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 8]
    assert positions_within_documents(cu).tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    # An EOD as the sample's last token ends the last document: no empty segment.
    assert document_boundaries(torch.tensor([5, EOD, 6, EOD]), EOD).tolist() == [0, 2, 4]
    assert document_boundaries(torch.tensor([5, 6]), EOD).tolist() == [0, 2]


def _sample(tokens, labels=None):
    tokens = torch.tensor(tokens)
    labels = tokens + 1 if labels is None else torch.tensor(labels)
    return with_document_boundaries({"tokens": tokens, "labels": labels,
                                     "loss_mask": torch.ones(tokens.numel()),
                                     "position_ids": torch.arange(tokens.numel()),
                                     "attention_mask": None}, EOD)


def test_collate_folds_a_micro_batch_into_one_row():
    samples = [_sample([1, EOD, 2, 3]), _sample([4, 5, 6, EOD])]
    batch = collate_samples(samples, fold_documents=True)
    assert batch["tokens"].tolist() == [[1, EOD, 2, 3, 4, 5, 6, EOD]]
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1, 0, 1, 2, 3]]
    assert batch["cu_seqlens"].dtype == torch.int32
    assert batch["cu_seqlens"].tolist() == [0, 2, 4, 8] and batch["max_seqlen"] == 4
    # Without folding the rows stay rows and attention spans each: the boundaries are dropped.
    unfolded = collate_samples(samples)
    assert unfolded["tokens"].shape == (2, 4) and "cu_seqlens" not in unfolded


def test_collate_makes_padding_a_segment_of_its_own():
    # --variable-seq-lengths: the shorter sample is padded; its padding is its own segment.
    batch = collate_samples([_sample([1, 2, EOD]), _sample([3, 4, 5, 6, EOD])],
                            fold_documents=True)
    assert batch["cu_seqlens"].tolist() == [0, 3, 5, 10]
    assert batch["loss_mask"].tolist() == [[1, 1, 1, 0, 0, 1, 1, 1, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 4]]
    assert batch["max_seqlen"] == 5


def test_collate_without_the_flag_is_unchanged():
    plain = {"tokens": torch.tensor([1, 2]), "labels": torch.tensor([2, 3]),
             "loss_mask": torch.ones(2), "position_ids": torch.arange(2), "attention_mask": None}
    batch = collate_samples([plain, plain])
    assert "cu_seqlens" not in batch and batch["tokens"].shape == (2, 2)


# ----------------------------------------------------------------------------------------------
# core attention
# ----------------------------------------------------------------------------------------------


def _block_causal_allowed(cu: list[int]) -> torch.Tensor:
    """[t, t] True where query i may attend to key j: the same document, j <= i."""
    total = cu[-1]
    document = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff())
    same = document[:, None] == document[None, :]
    return same & torch.ones(total, total, dtype=torch.bool).tril()


@pytest.mark.parametrize("groups", [HEADS, 2])
def test_sdpa_per_document_equals_a_dense_block_diagonal_mask(megatron, groups):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dpp.models.sdpa_attention import SdpaCoreAttention, packed_kernel

    cu = [0, 5, 6, 13, 20]
    total = cu[-1]
    generator = torch.Generator().manual_seed(3)
    shapes = [(total, HEADS, HEAD_DIM), (total, groups, HEAD_DIM), (total, groups, HEAD_DIM)]
    qkv = [torch.randn(s, generator=generator).requires_grad_() for s in shapes]
    core = SdpaCoreAttention(_attention_config(num_query_groups=groups), layer_number=1,
                             attn_mask_type=AttnMaskType.causal, attention_type="self")
    cu_tensor = torch.tensor(cu, dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_tensor, cu_seqlens_kv=cu_tensor,
                             max_seqlen_q=7, max_seqlen_kv=7)
    assert packed_kernel(qkv[0], 0.0, False) == "torch SDPA per document"  # the CPU's
    got = core(*qkv, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
    assert got.shape == (total, HEADS * HEAD_DIM)
    grad = torch.randn(got.shape, generator=generator)
    got_grads = torch.autograd.grad(got, qkv, grad)

    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in qkv)  # [1, heads, t, hn]
    k = k.repeat_interleave(HEADS // groups, dim=1)
    v = v.repeat_interleave(HEADS // groups, dim=1)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=_block_causal_allowed(cu), scale=HEAD_DIM ** -0.5)
    want = dense.squeeze(0).transpose(0, 1).reshape(total, HEADS * HEAD_DIM)
    want_grads = torch.autograd.grad(want, qkv, grad)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for name, a, b in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"gradient of {name}")


# ----------------------------------------------------------------------------------------------
# a model on a packed micro-batch against each document alone
# ----------------------------------------------------------------------------------------------
def _model(llama: bool, direct: bool = True):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_dpp import kernels
    from megatron_dpp.models.gpt import GPTShape, build_gpt_chunks
    from megatron_dpp.models.sdpa_attention import with_core_attention

    fields = dict(num_query_groups=2)
    if llama:
        fields.update(normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True,
                      activation_func=torch.nn.functional.silu)
    config = _attention_config(**fields)
    shape = GPTShape(VOCAB, 32, untie_embeddings_and_output_weights=llama,
                     position_embedding_type="rope" if llama else "learned_absolute",
                     normalization="RMSNorm" if llama else "LayerNorm")
    if direct:
        (model,) = build_gpt_chunks(config, shape, seed=5, attention=kernels.SDPA)
        return model
    # Megatron-Core's own layer (no direct classes), the same initialization seed.
    torch.manual_seed(5)
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(5)
    spec = with_core_attention(get_gpt_layer_local_spec(normalization=shape.normalization),
                               kernels.SDPA)
    rotary = {"rotary_base": 10000} if llama else {}
    return GPTModel(config, spec, VOCAB, 32,
                    share_embeddings_and_output_weights=not llama,
                    position_embedding_type=shape.position_embedding_type, **rotary)


def _stream_samples(micro_batch: int, length: int = 16) -> list[dict]:
    """Windows of a token stream of documents (each ended by EOD), labels the next token."""
    generator = torch.Generator().manual_seed(11)
    stream = []
    for doc_length in (5, 1, 9, 3, 7, 4, 2, 6):
        stream += torch.randint(0, EOD, (doc_length - 1,), generator=generator).tolist() + [EOD]
    stream += [1, 2, 3]
    samples = []
    for row in range(micro_batch):
        window = stream[row * length: row * length + length + 1]
        samples.append(_sample(window[:-1], window[1:]))
    return samples


def _per_token_losses(model, tokens, positions, labels, packed=None):
    return model(tokens, positions, None, labels=labels, packed_seq_params=packed)


def _documents_alone(model, batch):
    """Each segment of the folded row as its own sequence: (per-token losses, summed masked loss)."""
    cu = batch["cu_seqlens"].tolist()
    losses, total = [], 0.0
    for start, end in zip(cu[:-1], cu[1:]):
        tokens = batch["tokens"][:, start:end]
        positions = torch.arange(end - start).unsqueeze(0)
        loss = _per_token_losses(model, tokens, positions, batch["labels"][:, start:end])
        losses.append(loss)
        total = total + (loss * (tokens != EOD)).sum()
    return torch.cat(losses, dim=1), total


def _grads(model, loss):
    model.zero_grad()
    for p in model.parameters():
        p.grad = None
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_close_relative(got: torch.Tensor, want: torch.Tensor, what: str):
    scale = want.abs().max().clamp_min(1e-12)
    assert float((got - want).abs().max() / scale) <= REL_TOL, what


@pytest.mark.parametrize("micro_batch", [1, 2])
@pytest.mark.parametrize("llama", [False, True], ids=["gpt", "llama"])
def test_packed_documents_equal_each_document_alone(megatron, llama, micro_batch):
    from megatron_dpp.models.gpt import packed_seq_params_of

    model = _model(llama).train()
    batch = collate_samples(_stream_samples(micro_batch), fold_documents=True)
    assert batch["tokens"].shape == (1, 16 * micro_batch)
    assert len(batch["cu_seqlens"]) > 3  # several documents in the row
    packed = packed_seq_params_of(batch, torch.device("cpu"))
    losses = _per_token_losses(model, batch["tokens"], batch["position_ids"], batch["labels"],
                               packed)
    packed_grads = _grads(model, (losses * (batch["tokens"] != EOD)).sum())
    alone, alone_total = _documents_alone(model, batch)
    alone_grads = _grads(model, alone_total)
    _assert_close_relative(losses.detach(), alone.detach(), "per-token losses")
    assert packed_grads.keys() == alone_grads.keys() and packed_grads
    for name in packed_grads:
        _assert_close_relative(packed_grads[name], alone_grads[name], f"gradient of {name}")
    # The masking matters: the same row without the boundaries attends across documents.
    unmasked = _per_token_losses(model, batch["tokens"].view(micro_batch, -1),
                                 batch["position_ids"].view(micro_batch, -1),
                                 batch["labels"].view(micro_batch, -1))
    assert not torch.allclose(unmasked.detach().view(1, -1), alone.detach(), rtol=1e-3)


@pytest.mark.parametrize("llama", [False, True], ids=["gpt", "llama"])
def test_direct_layer_thd_path_equals_megatron_layer(megatron, llama):
    from megatron_dpp.mcore.direct_layer import DirectTransformerLayer
    from megatron_dpp.models.gpt import packed_seq_params_of

    direct, reference = _model(llama).train(), _model(llama, direct=False).train()
    assert isinstance(direct.decoder.layers[0], DirectTransformerLayer)
    assert direct.decoder.layers[0].runs_directly
    reference.load_state_dict(direct.state_dict())
    batch = collate_samples(_stream_samples(2), fold_documents=True)
    packed = packed_seq_params_of(batch, torch.device("cpu"))
    args = (batch["tokens"], batch["position_ids"], batch["labels"], packed)
    got, want = _per_token_losses(direct, *args), _per_token_losses(reference, *args)
    _assert_close_relative(got.detach(), want.detach(), "per-token losses")
    got_grads, want_grads = _grads(direct, got.sum()), _grads(reference, want.sum())
    for name in want_grads:
        _assert_close_relative(got_grads[name], want_grads[name], f"gradient of {name}")


# ----------------------------------------------------------------------------------------------
# training: DPP against Megatron's schedule, with the flag
# ----------------------------------------------------------------------------------------------
ITERATIONS = 4
MASKING = ["--dataloader-inter-document-masking"]
PP2 = ["--pipeline-model-parallel-size", "2", "--train-iters", str(ITERATIONS)]
DPP = ["--use-dpp", "--dpp-timeout", "60", "--p2p-transport", "shm"]
MEGATRON = ["--p2p-transport", "torch"]
MBS2 = ["--micro-batch-size", "2"]
LLAMA = [*TINY_GPT_ARGS, "--model", "llama", "--num-query-groups", "2", "--ffn-hidden-size",
         "128"]

_runs: dict = {}


def _train(name: str, flags: list, base=None, entry: str = "megatron_dpp.pretrain_gpt"):
    if name not in _runs:
        rc, losses, grad_norms, out = run_training(flags, nproc=2, timeout=240, base_args=base,
                                                   entry=entry)
        assert rc == 0, out[-3000:]
        assert len(losses) == ITERATIONS and len(grad_norms) == ITERATIONS, out[-3000:]
        _runs[name] = (losses, grad_norms, out)
    return _runs[name]


def test_the_flag_runs_per_document_attention_and_changes_the_losses():
    losses, _, out = _train("megatron", PP2 + MBS2 + MASKING + MEGATRON)
    assert "kernels: per-document attention on: CPU: torch scaled_dot_product_attention" in out
    assert "kernels: core attention: torch scaled_dot_product_attention" in out
    plain, _, _ = _train("megatron_plain", PP2 + MBS2 + MEGATRON)
    assert all(abs(a - b) > 1e-4 * abs(b) for a, b in zip(losses, plain)), (losses, plain)


@pytest.mark.parametrize("extra", [[], ["--dpp-split-backward"]], ids=["dpp", "split_backward"])
def test_dpp_equals_megatron_with_the_flag(extra):
    want_losses, want_norms, _ = _train("megatron", PP2 + MBS2 + MASKING + MEGATRON)
    losses, norms, _ = _train("dpp" + "".join(extra), PP2 + MBS2 + MASKING + DPP + extra)
    assert_losses_close(losses, want_losses, REL_TOL)
    assert_losses_close(norms, want_norms, REL_TOL)


def test_llama_dpp_equals_megatron_with_the_flag():
    want_losses, want_norms, _ = _train("llama_megatron", PP2 + MASKING + MEGATRON, LLAMA,
                                        "megatron_dpp.pretrain")
    losses, norms, _ = _train("llama_dpp", PP2 + MASKING + DPP, LLAMA, "megatron_dpp.pretrain")
    assert_losses_close(losses, want_losses, REL_TOL)
    assert_losses_close(norms, want_norms, REL_TOL)


# ----------------------------------------------------------------------------------------------
# refusals
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags,model,words", [
    (["--reset-attention-mask"], "gpt", "give one of the two"),
    (["--attention-backend", "local"], "gpt", "DotProductAttention) cannot"),
    (["--attention-backend", "fused"], "gpt", "THD attention is not set up here"),
])
def test_one_line_refusals(monkeypatch, capsys, flags, model, words):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    line = flag_error(capsys, [*data_args(), *TINY_GPT_ARGS, *MASKING, *flags], model)
    assert "--dataloader-inter-document-masking" in line and words in line, line


def test_bert_refuses_the_flag(monkeypatch, capsys):
    from _train_util import ensure_sample_data

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    sample = ensure_sample_data()
    bert_data = ["--data-path", str(sample / "sample_bert_text_sentence"), "--vocab-file",
                 str(sample / "bert-vocab.txt"), "--split", "98,2,0"]
    line = flag_error(capsys, [*bert_data, *TINY_GPT_ARGS, *MASKING], "bert")
    assert "--dataloader-inter-document-masking is a GPT data flag" in line, line


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------
_GPU_KERNELS = r"""
import sys, tempfile, pathlib
sys.path.insert(0, "tests")
import torch
from _one_rank import one_rank_megatron
from megatron_dpp.models.gpt import GPT_SPEC

with one_rank_megatron(pathlib.Path(tempfile.mkdtemp()), GPT_SPEC.cpu_patched_modules):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType
    from megatron_dpp.models import sdpa_attention
    from megatron_dpp import kernels

    checked = []
    for use_flash in ([False, True] if kernels.flash_attn_available() else [False]):
        for groups in (4, 2):
            config = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=4,
                                       num_query_groups=groups, attention_dropout=0.0,
                                       bf16=True, params_dtype=torch.bfloat16)
            core = sdpa_attention.SdpaCoreAttention(config, 1, AttnMaskType.causal, "self",
                                                    use_flash_attn=use_flash).cuda()
            cu = torch.tensor([0, 100, 101, 357, 512], dtype=torch.int32, device="cuda")
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                     max_seqlen_q=256, max_seqlen_kv=256)
            g = torch.Generator(device="cuda").manual_seed(0)
            qkv = [torch.randn(512, h, 64, device="cuda", generator=g, dtype=torch.bfloat16)
                   .requires_grad_() for h in (4, groups, groups)]
            kernel = sdpa_attention.packed_kernel(qkv[0], 0.0, use_flash)
            assert kernel != sdpa_attention.PACKED_SDPA_PER_DOCUMENT, kernel
            got = core(*qkv, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
            grads = torch.autograd.grad(got.float().sum(), qkv)
            ref = core._sdpa_per_document(*[t.float() for t in qkv], cu, cu, 4 // groups, 0.0)
            ref = ref.reshape(512, -1)
            ref_grads = torch.autograd.grad(ref.sum(), qkv)
            err = float((got.float() - ref).abs().max() / ref.abs().max())
            assert err < 2e-2, (kernel, groups, err)
            for a, b in zip(grads, ref_grads):
                gerr = float((a.float() - b.float()).abs().max() / b.float().abs().max())
                assert gerr < 5e-2, (kernel, groups, gerr)
            checked.append((kernel, groups, err))
    print("checked", checked)
"""


@pytest.mark.gpu
def test_gpu_varlen_kernels_equal_sdpa_per_document():
    result = subprocess.run([PYTHON, "-c", _GPU_KERNELS], env=gpu_env(), cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "torch varlen_attn" in result.stdout, result.stdout


@pytest.mark.gpu
def test_gpu_training_with_the_flag():
    rc, losses, _, out = run_training([*MASKING, *MBS2, "--bf16", "--train-iters", "3"],
                                      nproc=1, timeout=300, env=gpu_env())
    assert rc == 0, out[-3000:]
    assert len(losses) == 3 and all(loss == loss for loss in losses), out[-3000:]
    assert "kernels: per-document attention on: " in out and "varlen_attn" in out, out[-3000:]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
