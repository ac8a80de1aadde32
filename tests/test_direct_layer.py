"""The direct transformer layer (megatron_dpp.mcore.direct_layer): Megatron-Core's TransformerLayer
whose dense forward runs in one function. In one process (tp = pp = 1, gloo):

(a) GPT's, BERT's and Llama's layers (our specs, both core attentions) give Megatron's forward's
    output and gradients (to 1e-6 relative: the linears add their bias in the GEMM, where
    Megatron adds it after the product), dropout drawing the same numbers from the same RNG
    states, in training and in evaluation; each linear's bias is added in its product, not by a
    separate addition;
(b) Megatron's forward runs wherever it has work to do: per layer (recomputation, offloading,
    another MLP class) and per call (an inference context, packed sequences, cross attention);
(c) the local specs name the direct layer, and a split backward's rewrite turns it back into
    Megatron's;
(d) its shortened calls (nn.Module's __call__ without Megatron's CUDA-graph checks, no IdentityOp
    q/k norm calls, bias-dropout-add without its closures and grad handler, a plain store of
    `current_microbatch`) leave Megatron's where those have work: real q/k norms give Megatron's
    output and gradients, a layer with CUDA graphs goes through Megatron's __call__.
The host time it saves: docs/gpu.md ("The transformer layer's forward").
"""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from megatron_dpp.models.llama import LLAMA_SPEC

from _one_rank import one_rank_megatron

SEQ, BATCH, HIDDEN, HEADS, FFN = 8, 3, 32, 4, 64
# The linears add their bias in the GEMM (one addmm) where Megatron adds it after the product: the
# same sums, which BLAS may round differently (equal bit for bit at these sizes on the CPU here).
REL_TOL = 1e-6


def _assert_close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    scale = theirs.abs().max().item() or 1.0
    assert (ours - theirs).abs().max().item() <= REL_TOL * scale, what


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    # Llama's patched modules: GPT's and the rotary embedding's.
    with one_rank_megatron(tmp_path_factory.mktemp("direct_layer"),
                           LLAMA_SPEC.cpu_patched_modules):
        yield


def _config(model: str, **overrides):
    from megatron.core.transformer import TransformerConfig

    settings = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS,
                    ffn_hidden_size=FFN, use_cpu_initialization=True, hidden_dropout=0.1,
                    attention_dropout=0.1, pipeline_dtype=torch.float32,
                    bias_activation_fusion=False, bias_dropout_fusion=False,
                    masked_softmax_fusion=False, gradient_accumulation_fusion=False)
    if model == "llama":
        settings.update(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                        add_bias_linear=False, num_query_groups=2)
    settings.update(overrides)
    return TransformerConfig(**settings)


def _spec(model: str, attention: str):
    from megatron_dpp.models.bert import bert_layer_spec
    from megatron_dpp.models.gpt import gpt_layer_spec
    from megatron_dpp.models.llama import llama_layer_spec

    return {"gpt": gpt_layer_spec, "bert": bert_layer_spec,
            "llama": llama_layer_spec}[model](attention)


def _megatrons(spec):
    """The same spec with Megatron's TransformerLayer."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_dpp.mcore.direct_layer import DirectTransformerLayer
    from megatron_dpp.mcore.specs import replace_spec_classes

    return replace_spec_classes(spec, {DirectTransformerLayer: TransformerLayer})


def _layer_pair(model: str, attention: str, **config_overrides):
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_dpp.mcore.direct_layer import DirectTransformerLayer

    config = _config(model, **config_overrides)
    spec = _spec(model, attention)
    torch.manual_seed(0)
    theirs = build_module(_megatrons(spec), config=config, layer_number=2)
    ours = build_module(spec, config=config, layer_number=2)
    assert type(theirs) is TransformerLayer and type(ours) is DirectTransformerLayer
    with torch.no_grad():
        for param in theirs.parameters():
            param.add_(0.05 * torch.randn_like(param))
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def _inputs(model: str) -> dict:
    """What TransformerBlock passes a layer, by name, as it does."""
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=generator)
    inputs = dict(hidden_states=hidden, attention_mask=None, context=None, context_mask=None,
                  rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None,
                  rotary_pos_cos_sin=None, attention_bias=None, inference_context=None,
                  packed_seq_params=None, sequence_len_offset=None, padding_mask=None)
    if model == "bert":  # BertModel's [b, 1, s, s] mask (True = masked): real lengths 8, 5, 2
        real = (torch.arange(SEQ)[None, :] < torch.tensor([SEQ, 5, 2])[:, None]).float()
        inputs["attention_mask"] = (real[:, None, :] * real[:, :, None]).unsqueeze(1) < 0.5
    if model == "llama":
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        rotary = RotaryEmbedding(kv_channels=HIDDEN // HEADS, rotary_percent=1.0,
                                 use_cpu_initialization=True)
        inputs["rotary_pos_emb"] = rotary(SEQ)
    return inputs


def _rng_states():
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    return ({name: state.clone() for name, state in tracker.get_states().items()},
            torch.get_rng_state())


def _set_rng_states(states) -> None:
    from megatron.core import tensor_parallel

    tracker_states, default_state = states
    tensor_parallel.get_cuda_rng_tracker().set_states(
        {name: state.clone() for name, state in tracker_states.items()})
    torch.set_rng_state(default_state)


def _train_step(layer, inputs: dict):
    hidden = inputs["hidden_states"].clone().requires_grad_()
    output, context = layer(**{**inputs, "hidden_states": hidden})
    assert context is None
    output.backward(torch.randn(output.shape, generator=torch.Generator().manual_seed(9)))
    grads = {name: param.grad.clone() for name, param in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    return output.detach(), hidden.grad, grads


@pytest.mark.parametrize("attention", ["sdpa", "local"])
@pytest.mark.parametrize("model", ["gpt", "bert", "llama"])
def test_the_direct_layer_is_megatrons_forward(megatron, model, attention):
    theirs, ours = _layer_pair(model, attention)
    assert ours.runs_directly and ours.mlp_inline
    inputs = _inputs(model)
    start = _rng_states()
    expected = _train_step(theirs.train(), inputs)
    after_megatron = _rng_states()
    _set_rng_states(start)
    actual = _train_step(ours.train(), inputs)
    _assert_close(actual[0], expected[0], "output")
    _assert_close(actual[1], expected[1], "input gradient")
    assert actual[2].keys() == expected[2].keys()
    for name in expected[2]:
        _assert_close(actual[2][name], expected[2][name], name)
    # Dropout drew the same numbers from the same streams.
    after_ours = _rng_states()
    for name in after_megatron[0]:
        assert torch.equal(after_ours[0][name], after_megatron[0][name]), name
    assert torch.equal(after_ours[1], after_megatron[1])
    # Evaluation, no dropout, no graph.
    with torch.no_grad():
        evaluated = [layer.eval()(**inputs)[0] for layer in (theirs, ours)]
    _assert_close(evaluated[1], evaluated[0], "evaluation output")
    assert not torch.allclose(evaluated[0], expected[0])  # dropout was on in training


def _bias_additions(output: torch.Tensor, layer) -> int:
    """Additions in the graph with one of `layer`'s biases as an operand."""
    biases = {id(param) for name, param in layer.named_parameters() if name.endswith(".bias")}
    count, stack, seen = 0, [output.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "AddBackward0":
            count += any(id(getattr(next_node, "variable", None)) in biases
                         for next_node, _ in node.next_functions)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return count


def test_the_linears_add_their_bias_in_the_product(megatron):
    theirs, ours = _layer_pair("gpt", "sdpa")
    assert ours.bias_in_products
    inputs = _inputs("gpt")
    hidden = inputs["hidden_states"].clone().requires_grad_()
    outputs = [layer.train()(**{**inputs, "hidden_states": hidden})[0]
               for layer in (theirs, ours)]
    # Megatron: fc1's bias after its product, the projection's and fc2's in bias-dropout-add (the
    # QKV's inside its Python linear function, not in the graph); ours: none (each in its addmm).
    assert [_bias_additions(output, layer)
            for output, layer in zip(outputs, (theirs, ours))] == [3, 0]
    # With Megatron's linears in our layer, the layer adds the biases itself.
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_dpp.mcore.direct_layer import DirectTransformerLayer
    from megatron_dpp.mcore.direct_linear import DIRECT_CLASSES
    from megatron_dpp.mcore.specs import replace_spec_classes
    from megatron.core.transformer.spec_utils import build_module

    megatron_linears = replace_spec_classes(
        _spec("gpt", "sdpa"), {ours_class: theirs_class
                               for theirs_class, ours_class in DIRECT_CLASSES.items()})
    layer = build_module(megatron_linears, config=_config("gpt"), layer_number=2)
    assert type(layer) is DirectTransformerLayer and layer.runs_directly
    assert type(layer.mlp.linear_fc1) is ColumnParallelLinear
    assert type(layer.mlp.linear_fc2) is RowParallelLinear
    assert not layer.bias_in_products
    output = layer.train()(**{**inputs, "hidden_states": hidden})[0]
    assert _bias_additions(output, layer) == 3


def _count_megatron_forwards(monkeypatch) -> list:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    calls = []
    megatron_forward = TransformerLayer.forward

    def counting(self, *args, **kwargs):
        calls.append(kwargs)
        return megatron_forward(self, *args, **kwargs)

    monkeypatch.setattr(TransformerLayer, "forward", counting)
    return calls


def test_megatrons_forward_runs_where_a_call_has_work_for_it(megatron, monkeypatch):
    _, ours = _layer_pair("gpt", "sdpa")
    ours.eval()
    calls = _count_megatron_forwards(monkeypatch)
    inputs = _inputs("gpt")
    with torch.no_grad():
        direct = ours(**inputs)[0]
        assert calls == []
        # Positional arguments, and an argument the dense path has no use for, go to Megatron's.
        positional = ours(inputs["hidden_states"])[0]
        assert len(calls) == 1
        marker = types.SimpleNamespace()
        # (packed_seq_params is the dense path's: tests/test_document_masking.py.)
        for name in ("context", "rotary_pos_cos", "inference_context"):
            try:
                ours(**{**inputs, name: marker})
            except Exception:  # Megatron's forward may fail on the odd value: it was called
                pass
            assert calls[-1][name] is marker, name
        assert len(calls) == 4
    assert torch.equal(positional, direct)


@pytest.mark.parametrize("overrides", [
    dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    dict(recompute_granularity="selective", recompute_modules=["layernorm"]),
    dict(recompute_granularity="selective", recompute_modules=["mlp"]),
    dict(attention_output_gate=True),
])
def test_megatrons_forward_runs_where_a_layer_has_work_for_it(megatron, overrides):
    from megatron.core.transformer.spec_utils import build_module

    spec = _spec("gpt", "sdpa")
    layer = build_module(spec, config=_config("gpt", **overrides), layer_number=1)
    assert not layer.runs_directly


def test_megatrons_mlp_forward_runs_where_its_fusion_is_on(megatron, monkeypatch):
    from megatron.core.transformer.mlp import MLP

    _, ours = _layer_pair("gpt", "sdpa")
    ours.mlp_inline = False  # as bias_activation_fusion=True sets it (its kernels are compiled)
    calls = []
    megatron_forward = MLP.forward
    monkeypatch.setattr(MLP, "forward",
                        lambda self, *a, **k: calls.append(1) or megatron_forward(self, *a, **k))
    with torch.no_grad():
        ours.eval()(**_inputs("gpt"))
    assert calls == [1]
    from megatron.core.transformer.spec_utils import build_module

    fused = build_module(_spec("gpt", "sdpa"), config=_config("gpt", bias_activation_fusion=True),
                         layer_number=1)
    assert fused.runs_directly and not fused.mlp_inline


def test_the_local_specs_name_the_direct_layer_also_under_a_split_backward(megatron):
    """A split backward's spec keeps the direct layer; its linears are the deferred ones, which
    are direct linears (so the layer adds the biases in the GEMMs there too)."""
    import dataclasses

    from megatron_dpp.mcore.direct_layer import DirectTransformerLayer
    from megatron_dpp.mcore.direct_linear import DIRECT_CLASSES
    from megatron_dpp.models.weight_grad import (DeferredColumnParallelLinear,
                                                 DeferredRowParallelLinear, deferred_layer_spec)

    for model in ("gpt", "bert", "llama"):
        for attention in ("sdpa", "local"):
            spec = _spec(model, attention)
            assert spec.module is DirectTransformerLayer, model
            deferred = deferred_layer_spec(spec)
            assert dataclasses.is_dataclass(deferred) and deferred.module is DirectTransformerLayer
            attention_spec = deferred.submodules.self_attention.submodules
            mlp_spec = deferred.submodules.mlp.submodules
            linears = (attention_spec.linear_qkv, attention_spec.linear_proj,
                       mlp_spec.linear_fc1, mlp_spec.linear_fc2)
            assert all(cls in (DeferredColumnParallelLinear, DeferredRowParallelLinear)
                       for cls in linears), (model, linears)
            assert all(issubclass(cls, tuple(DIRECT_CLASSES.values())) for cls in linears)


def test_real_qk_norms_run_and_match_megatrons_forward(megatron):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from megatron_dpp.mcore.direct_layer import DirectTransformerLayer, with_direct_classes

    config = _config("gpt", qk_layernorm=True)
    megatron_spec = get_gpt_layer_local_spec(qk_layernorm=True)
    torch.manual_seed(0)
    theirs = build_module(megatron_spec, config=config, layer_number=1)
    ours = build_module(with_direct_classes(megatron_spec), config=config, layer_number=1)
    assert type(ours) is DirectTransformerLayer and ours.runs_directly
    assert ours.norms_q and ours.norms_k
    with torch.no_grad():
        for param in theirs.parameters():  # norms that are not the identity
            param.add_(0.05 * torch.randn_like(param))
    ours.load_state_dict(theirs.state_dict())
    inputs = _inputs("gpt")
    start = _rng_states()
    expected = _train_step(theirs.train(), inputs)
    _set_rng_states(start)
    actual = _train_step(ours.train(), inputs)
    _assert_close(actual[0], expected[0], "output")
    _assert_close(actual[1], expected[1], "input gradient")
    for name in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
        _assert_close(actual[2][name], expected[2][name], name)
    # Our specs' layers have none: the IdentityOps are not called.
    _, plain = _layer_pair("gpt", "sdpa")
    assert not plain.norms_q and not plain.norms_k


def test_megatrons_call_runs_where_a_layer_has_cuda_graphs(megatron, monkeypatch):
    from megatron.core.transformer.transformer_layer import TransformerLayer

    _, ours = _layer_pair("gpt", "sdpa")
    # cuda_graph_impl "none" and no graph manager: nn.Module's __call__ directly.
    assert ours.plain_call
    calls = []
    megatron_call = TransformerLayer.__call__
    monkeypatch.setattr(TransformerLayer, "__call__",
                        lambda self, *a, **k: calls.append(1) or megatron_call(self, *a, **k))
    inputs = _inputs("gpt")
    with torch.no_grad():
        direct = ours.eval()(**inputs)[0]
        assert calls == []
        ours.plain_call = False  # as a layer with cuda_graph_impl "local" (a GPU's) has it
        through_megatron = ours(**inputs)[0]
    assert calls == [1]
    assert torch.equal(direct, through_megatron)


def test_current_microbatch_is_a_plain_attribute(megatron):
    from megatron.core.pipeline_parallel.schedules import set_current_microbatch
    from megatron.core.transformer.transformer_block import TransformerBlock

    _, ours = _layer_pair("gpt", "sdpa")
    ours.current_microbatch = 3
    assert ours.__dict__["current_microbatch"] == 3 and ours.current_microbatch == 3
    # Megatron's schedules set it through the model's decoder, as before.
    block = TransformerBlock(_config("gpt"), _spec("gpt", "sdpa"))
    holder = torch.nn.Module()
    holder.decoder = block
    set_current_microbatch(holder, 5)
    assert [layer.current_microbatch for layer in block.layers] == [5, 5]
    # Anything else is nn.Module's as before: a parameter registers.
    ours.extra = torch.nn.Parameter(torch.zeros(1))
    assert "extra" in dict(ours.named_parameters())


def test_bias_dropout_add_keeps_megatrons_grad_handler_without_grad(megatron, monkeypatch):
    """Evaluation under no_grad runs bias-dropout-add under Megatron's torch.enable_grad, as
    Megatron's layer does; with grad on already, the handler has nothing to do and is skipped."""
    _, ours = _layer_pair("gpt", "sdpa")
    assert ours.bda_handler_enables_grad and ours.bda_unfused
    entered = []
    handler = ours.bias_dropout_add_exec_handler

    class Counting:
        def __enter__(self):
            entered.append(1)
            self.inner = handler()
            return self.inner.__enter__()

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

    monkeypatch.setattr(ours, "bias_dropout_add_exec_handler", Counting)
    inputs = _inputs("gpt")
    with torch.no_grad():
        ours.eval()(**inputs)
    assert len(entered) == 2
    ours.train()(**inputs)
    assert len(entered) == 2
    fused = _config("gpt", bias_dropout_fusion=True)
    from megatron.core.transformer.spec_utils import build_module

    assert not build_module(_spec("gpt", "sdpa"), config=fused, layer_number=1).bda_unfused
