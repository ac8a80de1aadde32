"""Deferred weight gradients (megatron_dpp.models.weight_grad): a tiny GPT chunk built with the
deferred layers against Megatron-Core's own GPTModel, in one process (tp = pp = dp = 1, gloo).

(a) deferring off: the same outputs and gradients, bit for bit;
(b) deferring on: B leaves every parameter without a gradient, the input gradient bit for bit;
    W of each microbatch, in a non-FIFO order, adds exactly that microbatch's fused gradients;
(c) the stash reports the bytes it holds, and 0 after W;
(d) errors: unknown key, second run, W before B, work left behind, nested microbatches;
plus Megatron DDP: main_grad equal, its hooks fire at W (overlap_grad_reduce included).
"""
from __future__ import annotations

import pytest
import torch

from megatron_dpp.models.gpt import GPT_SPEC
from megatron_dpp.platform import setup_platform

from _one_rank import one_rank_megatron

SEQ, BATCH, HIDDEN, FFN, VOCAB, LAYERS = 8, 2, 16, 32, 64, 2
ORDER = [("B", 1), ("B", 0), ("W", 0), ("B", 2), ("W", 2), ("W", 1)]  # not FIFO
REL_TOL = 1e-6


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """A one-rank Megatron-Core setup (the platform's CPU patches, gloo, tp = pp = 1)."""
    with one_rank_megatron(tmp_path_factory.mktemp("wg"), GPT_SPEC.cpu_patched_modules):
        yield


def _config(**overrides):
    from megatron.core.transformer import TransformerConfig

    settings = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=2,
                    ffn_hidden_size=FFN, use_cpu_initialization=True, hidden_dropout=0.0,
                    attention_dropout=0.0, pipeline_dtype=torch.float32,
                    bias_activation_fusion=False, bias_dropout_fusion=False,
                    masked_softmax_fusion=False, gradient_accumulation_fusion=False)
    settings.update(overrides)
    return TransformerConfig(**settings)


# A pipeline chunk of each kind: the first stage (embeddings, no loss), the last stage (a hidden-
# state input, the output layer and the loss), the whole model (tied embeddings on one stage).
CHUNKS = {"first": (True, False), "last": (False, True), "whole": (True, True)}


def _layer_spec(spec: str):
    """Megatron-Core's local layer spec, or ours as training builds it (models.gpt's: the direct
    layer and linears of mcore/, torch SDPA)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_dpp.models.gpt import gpt_layer_spec

    return get_gpt_layer_local_spec() if spec == "megatron" else gpt_layer_spec("sdpa")


def _pair(kind: str, seed: int = 0, spec: str = "megatron"):
    """(GPTModel, DeferredGPTModel) with the same weights, both of the layer spec `spec`."""
    from megatron.core.models.gpt import GPTModel

    from megatron_dpp.models.weight_grad import DeferredGPTModel

    pre, post = CHUNKS[kind]
    config = _config()
    arguments = dict(config=config, transformer_layer_spec=_layer_spec(spec),
                     vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=pre,
                     post_process=post, share_embeddings_and_output_weights=True,
                     position_embedding_type="learned_absolute")
    torch.manual_seed(seed)
    reference = GPTModel(**arguments)
    with torch.no_grad():  # Megatron's biases start at 0: perturb every weight
        for param in reference.parameters():
            param.add_(0.05 * torch.randn_like(param))
    deferred = DeferredGPTModel(**arguments)
    deferred.load_state_dict(reference.state_dict())
    return reference, deferred


def _microbatch(m: int):
    generator = torch.Generator().manual_seed(100 + m)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=generator)
    out_grad = torch.randn(SEQ, BATCH, HIDDEN, generator=generator)
    return tokens, hidden, out_grad


def _forward(model, kind: str, m: int):
    """One microbatch's forward; returns (what to backpropagate, its gradient, the input tensor)."""
    tokens, hidden, out_grad = _microbatch(m)
    pre, post = CHUNKS[kind]
    input_tensor = None
    if not pre:
        input_tensor = hidden.clone().requires_grad_(True)
        model.set_input_tensor(input_tensor)
    positions = torch.arange(SEQ).repeat(BATCH, 1)
    output = model(tokens, positions, None, labels=tokens if post else None)
    if post:
        return output.sum(), None, input_tensor
    return output, out_grad, input_tensor


def _grads(model):
    return {name: None if param.grad is None else param.grad.clone()
            for name, param in model.named_parameters()}


def _rel_err(mine: torch.Tensor, reference: torch.Tensor) -> float:
    scale = reference.abs().max().item()
    return (mine - reference).abs().max().item() / (scale if scale > 0 else 1.0)


def _assert_close(mine: dict, reference: dict, tol: float = REL_TOL):
    assert mine.keys() == reference.keys()
    errors = {name: _rel_err(mine[name], reference[name]) for name in reference}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tol, f"{worst}: relative error {errors[worst]:.3g}"


# ----------------------------------------------------------------------------------------------
# (a) deferring off: Megatron's numbers
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(CHUNKS))
def test_without_deferral_the_layers_are_megatrons(megatron, kind):
    from megatron_dpp.models.weight_grad import undeferred_parameters

    reference, deferred = _pair(kind)
    assert undeferred_parameters(deferred) == []
    assert len(undeferred_parameters(reference)) == len(list(reference.parameters()))
    outputs = []
    for model in (reference, deferred):
        output, grad, input_tensor = _forward(model, kind, 0)
        torch.autograd.backward(output, grad)
        outputs.append((output.detach(), input_tensor))
    assert torch.equal(outputs[0][0], outputs[1][0])
    if outputs[0][1] is not None:
        assert torch.equal(outputs[0][1].grad, outputs[1][1].grad)
    theirs, mine = _grads(reference), _grads(deferred)
    assert all(torch.equal(mine[name], theirs[name]) for name in theirs), \
        [name for name in theirs if not torch.equal(mine[name], theirs[name])]


# ----------------------------------------------------------------------------------------------
# (b) + (c): split backward, microbatches interleaved out of order
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["megatron", "direct"])
@pytest.mark.parametrize("kind", sorted(CHUNKS))
def test_deferred_weight_gradients_per_microbatch_in_any_order(megatron, kind, spec):
    from megatron_dpp.mcore.direct_layer import DirectTransformerLayer
    from megatron_dpp.models.weight_grad import WeightGradStash

    reference, deferred = _pair(kind, spec=spec)
    if spec == "direct":  # the split's forward is the fused one's: biases in the GEMMs
        assert all(type(layer) is DirectTransformerLayer and layer.bias_in_products
                   for layer in deferred.decoder.layers)
    # Megatron's fused backward, one microbatch at a time: each one's own gradients.
    per_microbatch, input_grads = {}, {}
    for m in range(3):
        reference.zero_grad(set_to_none=True)
        output, grad, input_tensor = _forward(reference, kind, m)
        torch.autograd.backward(output, grad)
        per_microbatch[m] = _grads(reference)
        input_grads[m] = None if input_tensor is None else input_tensor.grad

    stash = WeightGradStash()
    pending = {}
    for m in range(3):
        with stash.defer(m):
            pending[m] = _forward(deferred, kind, m)
    assert sorted(stash.keys()) == [0, 1, 2] and stash.bytes_held() == 0
    expected = None
    for phase, m in ORDER:
        if phase == "B":
            output, grad, input_tensor = pending.pop(m)
            torch.autograd.backward(output, grad)
            if input_tensor is not None:  # B gave the input gradient, at once
                assert torch.equal(input_tensor.grad, input_grads[m])
            assert stash.bytes_held(m) > 0
        else:
            held = stash.bytes_held(m)
            # At least every linear layer's input and output gradient, in fp32.
            assert held >= LAYERS * SEQ * BATCH * (HIDDEN + FFN + HIDDEN + HIDDEN) * 4
            stash.run(m)
            assert stash.bytes_held(m) == 0
            expected = per_microbatch[m] if expected is None else {
                name: expected[name] + per_microbatch[m][name] for name in expected}
        if expected is None:  # before the first W: no parameter has a gradient
            assert all(p.grad is None for p in deferred.parameters())
        else:
            _assert_close(_grads(deferred), expected)
    assert stash.bytes_held() == 0 and stash.keys() == []
    stash.check_drained()


def test_a_forward_without_autograd_defers_nothing(megatron):
    from megatron_dpp.models.weight_grad import WeightGradStash

    _, deferred = _pair("whole")
    stash = WeightGradStash()
    with stash.defer("eval"), torch.no_grad():
        _forward(deferred, "whole", 0)
    assert stash.keys() == []
    stash.check_drained()


def test_recompute_defers_when_the_backward_is_wrapped_too(megatron):
    """Full recompute reruns the layers' forward inside B: under defer(key) there, it defers."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_dpp.models.weight_grad import DeferredGPTModel, WeightGradStash

    config = _config(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1)
    arguments = dict(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=VOCAB, max_sequence_length=SEQ,
                     share_embeddings_and_output_weights=True,
                     position_embedding_type="learned_absolute")
    torch.manual_seed(0)
    reference = GPTModel(**arguments)
    deferred = DeferredGPTModel(**arguments)
    deferred.load_state_dict(reference.state_dict())
    _forward(reference, "whole", 0)[0].backward()
    stash = WeightGradStash()
    with stash.defer(0):
        loss = _forward(deferred, "whole", 0)[0]
    with stash.defer(0):
        loss.backward()
    assert all(p.grad is None for p in deferred.parameters())
    stash.run(0)
    _assert_close(_grads(deferred), _grads(reference))


# ----------------------------------------------------------------------------------------------
# (d) errors
# ----------------------------------------------------------------------------------------------
def test_errors_name_the_misuse(megatron):
    from megatron_dpp.models.weight_grad import WeightGradError, WeightGradStash

    _, deferred = _pair("whole")
    stash = WeightGradStash()
    with pytest.raises(WeightGradError, match="nothing is stored under this key"):
        stash.run("never")
    with stash.defer(0):
        output, _, _ = _forward(deferred, "whole", 0)
    with pytest.raises(WeightGradError, match="backward has not finished"):
        stash.run(0)  # W before B
    with pytest.raises(WeightGradError, match="without their backward"):
        stash.check_drained()
    output.backward()
    with pytest.raises(WeightGradError, match="not run"):
        stash.check_drained()  # B done, W missing
    stash.run(0)
    with pytest.raises(WeightGradError, match="already ran"):
        stash.run(0)
    stash.check_drained()
    with pytest.raises(WeightGradError, match="one microbatch at a time"):
        with stash.defer(1), stash.defer(2):
            pass
    # A new forward under a key that ran makes it a fresh microbatch again (next iteration).
    with stash.defer(0):
        output, _, _ = _forward(deferred, "whole", 1)
    output.backward()
    stash.run(0)
    stash.discard()
    stash.check_drained()


def test_w_hands_each_gradient_over_without_copying_it():
    """At W the accumulator takes the computed gradient as param.grad itself (no copy), and the
    hooks on the parameter run once with it: what Megatron's DDP (grad = None after each hook)
    relies on to avoid a copy of every weight gradient at every W."""
    from megatron_dpp.models.weight_grad import WeightGradStash
    from megatron_dpp.models.weight_grad.store import WeightGradWork

    param = torch.nn.Parameter(torch.zeros(64, 32))
    made, seen = [], []

    def compute():
        grad = torch.full((64, 32), 2.0)
        made.append(grad.data_ptr())
        return (grad,)

    param.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.data_ptr()))
    stash = WeightGradStash()
    stash._forward_deferred("m")
    stash._store("m", WeightGradWork((param,), (), compute))
    stash.run("m")
    assert seen == made and param.grad.data_ptr() == made[0]
    assert torch.equal(param.grad, torch.full((64, 32), 2.0))


def test_transformer_engine_layers_are_refused(megatron):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_dpp.models.weight_grad import WeightGradError, deferred_layer_spec

    spec = get_gpt_layer_local_spec()
    fake_te = type("TELayerNormColumnParallelLinear", (torch.nn.Module,),
                   {"__module__": "megatron.core.extensions.transformer_engine"})
    spec.submodules.self_attention.submodules.linear_qkv = fake_te
    with pytest.raises(WeightGradError, match="Transformer Engine"):
        deferred_layer_spec(spec)


# ----------------------------------------------------------------------------------------------
# layers outside the GPT defaults: Megatron's deterministic embedding, torch's padding_idx
# ----------------------------------------------------------------------------------------------
def test_embedding_variants(megatron):
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    from megatron_dpp.models.weight_grad import (
        DeferredEmbedding,
        DeferredVocabParallelEmbedding,
        WeightGradStash,
    )

    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    ids[0, :3] = 1
    grad = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(4))
    config = _config(deterministic_mode=True)
    init = torch.nn.init.normal_
    cases = [
        (VocabParallelEmbedding(VOCAB, HIDDEN, init_method=init, config=config),
         DeferredVocabParallelEmbedding(VOCAB, HIDDEN, init_method=init, config=config)),
        (torch.nn.Embedding(VOCAB, HIDDEN, padding_idx=1), DeferredEmbedding(VOCAB, HIDDEN, 1)),
    ]
    for reference, deferred in cases:
        deferred.load_state_dict(reference.state_dict())
        reference(ids).backward(grad)
        stash = WeightGradStash()
        with stash.defer("m"):
            output = deferred(ids)
        assert torch.equal(output, reference(ids).detach())
        output.backward(grad)
        assert deferred.weight.grad is None
        stash.run("m")
        assert torch.equal(deferred.weight.grad, reference.weight.grad)


# ----------------------------------------------------------------------------------------------
# Megatron's DistributedDataParallel: main_grad, and its hooks fire at W
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap_grad_reduce", [False, True])
def test_megatron_ddp_main_grad_and_hooks(megatron, overlap_grad_reduce):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_dpp.models.weight_grad import WeightGradStash

    reference, deferred = _pair("whole")
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=overlap_grad_reduce)
    theirs = DistributedDataParallel(reference.config, ddp_config, module=reference)
    mine = DistributedDataParallel(deferred.config, ddp_config, module=deferred)
    buckets = mine.bucket_groups
    for iteration in range(2):  # the first batch of overlap_grad_reduce counts the hooks
        theirs.zero_grad_buffer()
        mine.zero_grad_buffer()
        with theirs.no_sync():
            for m in range(2):
                _forward(theirs, "whole", m)[0].backward()
        _forward(theirs, "whole", 2)[0].backward()
        theirs.finish_grad_sync()

        stash = WeightGradStash()
        losses = {}
        for m in range(3):
            with stash.defer(m):
                losses[m] = _forward(mine, "whole", m)[0]
        with mine.no_sync():
            for phase, m in ORDER[:-1]:
                if phase == "B":
                    losses[m].backward()
                else:
                    stash.run(m)
                if (phase, m) == ("B", 1):  # nothing reached DDP's buffers at B
                    assert all(p.main_grad.abs().max() == 0 for p in deferred.parameters())
                    assert all(p.grad is None for p in deferred.parameters())
        if overlap_grad_reduce and iteration == 1:
            assert all(group.grad_reduce_handle is None for group in buckets)
        stash.run(ORDER[-1][1])  # the last W, synchronizing: the hooks launch the reduction
        if overlap_grad_reduce and iteration == 1:
            assert all(group.grad_reduce_handle is not None for group in buckets)
        mine.finish_grad_sync()
        assert all(p.grad is None for p in deferred.parameters())
        _assert_close({n: p.main_grad for n, p in deferred.named_parameters()},
                      {n: p.main_grad for n, p in reference.named_parameters()})


# ----------------------------------------------------------------------------------------------
# BERT: the same guarantees for DeferredBertModel (its heads are torch Linear layers and norms)
# ----------------------------------------------------------------------------------------------
def _bert_pair(kind: str):
    """(Megatron's BertModel, DeferredBertModel) with the binary head and the same weights."""
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel

    from megatron_dpp.models.bert import BERT_SPEC
    from megatron_dpp.models.weight_grad import DeferredBertModel

    setup_platform(BERT_SPEC.cpu_patched_modules)
    pre, post = CHUNKS[kind]
    arguments = dict(config=_config(), num_tokentypes=2, transformer_layer_spec=bert_layer_local_spec,
                     vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=pre, post_process=post,
                     share_embeddings_and_output_weights=True, add_binary_head=True,
                     position_embedding_type="learned_absolute")
    torch.manual_seed(0)
    reference = BertModel(**arguments)
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(0.05 * torch.randn_like(param))
    deferred = DeferredBertModel(**arguments)
    deferred.load_state_dict(reference.state_dict())
    return reference, deferred


def _bert_forward(model, kind: str, m: int):
    tokens, hidden, out_grad = _microbatch(m)
    pre, post = CHUNKS[kind]
    input_tensor = None
    if not pre:
        input_tensor = hidden.clone().requires_grad_(True)
        model.set_input_tensor(input_tensor)
    padding = torch.ones(BATCH, SEQ, dtype=torch.long)
    padding[0, SEQ - 2:] = 0
    types = (torch.arange(SEQ) >= SEQ // 2).long().repeat(BATCH, 1)
    output = model(tokens, padding, tokentype_ids=types, lm_labels=tokens if post else None)
    if post:
        lm_losses, binary_logits = output
        return lm_losses.sum() + binary_logits.square().sum(), None, input_tensor
    return output, out_grad, input_tensor


@pytest.mark.parametrize("kind", sorted(CHUNKS))
def test_bert_weight_gradients_deferred_equal_the_fused_ones(megatron, kind):
    from megatron_dpp.models.weight_grad import WeightGradStash, undeferred_parameters

    reference, deferred = _bert_pair(kind)
    assert undeferred_parameters(deferred) == []
    names = {name for name, _ in deferred.named_parameters()}
    if CHUNKS[kind][1]:  # the heads are there and deferred too
        assert {"pooler.dense.weight", "binary_head.weight", "lm_head.dense.weight"} <= names
    fused_input_grads, fused = [], None
    for m in range(2):
        output, grad, input_tensor = _bert_forward(reference, kind, m)
        torch.autograd.backward(output, grad)
        fused_input_grads.append(None if input_tensor is None else input_tensor.grad)
    fused = _grads(reference)
    stash = WeightGradStash()
    for m in range(2):
        with stash.defer(m):
            output, grad, input_tensor = _bert_forward(deferred, kind, m)
        torch.autograd.backward(output, grad)
        if input_tensor is not None:
            assert torch.allclose(input_tensor.grad, fused_input_grads[m], rtol=1e-5, atol=1e-7)
    assert all(p.grad is None for p in deferred.parameters())  # nothing before W
    for m in (1, 0):
        stash.run(m)
    _assert_close(_grads(deferred), fused, tol=1e-5)
    stash.check_drained()
