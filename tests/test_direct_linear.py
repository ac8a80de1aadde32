"""Direct linear layers (megatron_dpp.mcore.direct_linear): Megatron-Core's local linears whose
forward on one tensor-parallel rank is torch.matmul, differentiated by autograd, instead of
Megatron's Python autograd functions. In one process (tp = pp = 1, gloo):

(a) each layer kind (column and row, with and without a bias, bias added or returned) gives
    Megatron's outputs and gradients, and its graph holds none of Megatron's Python functions;
    a bias it adds is added in the GEMM (one addmm), also where the caller asks a layer that
    returns its bias to add it (bias_in_product);
(b) a whole GPT chunk built from our spec equals one built from Megatron's local spec: the same
    state-dict keys, loss and gradients;
(c) Megatron's forward runs wherever it has work to do (tensor or sequence parallelism, a weight
    passed in, gradient-accumulation fusion, deferred embedding gradients);
(d) the GPT, BERT and Llama local specs name the direct classes, and a split backward's rewrite
    turns them into its deferred ones.
The host time they save is measured by `benchmarks/host_overhead.py --compare-linears`.
"""
from __future__ import annotations

import collections
import types

import pytest
import torch

from megatron_dpp.models.gpt import GPT_SPEC

from _one_rank import one_rank_megatron

SEQ, BATCH, HIDDEN, FFN, VOCAB = 8, 2, 16, 32, 64
# Same products, reduced in another order only where autograd's matmul backward transposes
# differently from Megatron's (measured equal bit for bit here; the tolerance allows BLAS its way).
REL_TOL = 1e-6

# Megatron-Core's Python autograd functions around a linear on one rank.
MEGATRON_FUNCTIONS = ("LinearWithGradAccumulationAndAsyncCommunicationBackward",
                      "_CopyToModelParallelRegionBackward", "_ReduceFromModelParallelRegionBackward")


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    with one_rank_megatron(tmp_path_factory.mktemp("direct"), GPT_SPEC.cpu_patched_modules):
        yield


def _config(**overrides):
    from megatron.core.transformer import TransformerConfig

    settings = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=FFN,
                    use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                    pipeline_dtype=torch.float32, bias_activation_fusion=False,
                    bias_dropout_fusion=False, masked_softmax_fusion=False,
                    gradient_accumulation_fusion=False)
    settings.update(overrides)
    return TransformerConfig(**settings)


def _graph_names(tensor: torch.Tensor) -> set:
    names, stack, seen = set(), [tensor.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def _assert_close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    scale = theirs.abs().max().item() or 1.0
    assert (ours - theirs).abs().max().item() <= REL_TOL * scale, what


def _layer_pair(kind: str, bias: bool, skip_bias_add: bool):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_dpp.mcore.direct_linear import (
        DirectColumnParallelLinear,
        DirectRowParallelLinear,
    )

    config = _config()
    common = dict(config=config, init_method=torch.nn.init.normal_, bias=bias,
                  skip_bias_add=skip_bias_add)
    if kind == "column":
        megatron_class, ours_class = ColumnParallelLinear, DirectColumnParallelLinear
        sizes, common = (HIDDEN, FFN), dict(common, gather_output=False)
    else:
        megatron_class, ours_class = RowParallelLinear, DirectRowParallelLinear
        sizes, common = (FFN, HIDDEN), dict(common, input_is_parallel=True)
    theirs, ours = megatron_class(*sizes, **common), ours_class(*sizes, **common)
    with torch.no_grad():
        for param in theirs.parameters():  # Megatron's biases start at 0
            param.add_(0.1 * torch.randn_like(param))
    ours.load_state_dict(theirs.state_dict())
    assert ours.multiplies_directly
    return theirs, ours, sizes[0]


def _run_layer(layer, inputs: torch.Tensor, weight=None):
    inputs = inputs.clone().requires_grad_(True)
    output, bias = layer(inputs) if weight is None else layer(inputs, weight=weight)
    if bias is not None:
        output = output + bias
    output.square().sum().backward()
    return output, [inputs.grad] + [param.grad for param in layer.parameters()]


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("bias,skip_bias_add", [(True, True), (True, False), (False, False)])
def test_each_layer_gives_megatrons_numbers_without_its_python_functions(megatron, kind, bias,
                                                                         skip_bias_add):
    theirs, ours, width = _layer_pair(kind, bias, skip_bias_add)
    inputs = torch.randn(SEQ, BATCH, width, generator=torch.Generator().manual_seed(3))
    their_output, their_grads = _run_layer(theirs, inputs)
    our_output, our_grads = _run_layer(ours, inputs)
    _assert_close(our_output, their_output, "output")
    assert len(our_grads) == len(their_grads)
    for index, (mine, reference) in enumerate(zip(our_grads, their_grads)):
        _assert_close(mine, reference, f"gradient {index}")
    assert not _graph_names(our_output) & set(MEGATRON_FUNCTIONS)
    assert _graph_names(their_output) & set(MEGATRON_FUNCTIONS)  # the check can fail


def _graph_counts(tensor: torch.Tensor) -> collections.Counter:
    counts, stack, seen = collections.Counter(), [tensor.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        counts[type(node).__name__] += 1
        stack.extend(next_node for next_node, _ in node.next_functions)
    return counts


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("skip_bias_add", [True, False])
def test_the_bias_is_added_in_the_product(megatron, kind, skip_bias_add):
    theirs, ours, width = _layer_pair(kind, True, skip_bias_add)
    inputs = torch.randn(SEQ, BATCH, width, generator=torch.Generator().manual_seed(4))
    their_output, their_grads = _run_layer(theirs, inputs)
    # Asked for the bias in the product, every layer returns none and adds it in one addmm.
    output, bias = ours(inputs.clone().requires_grad_(True), bias_in_product=True)
    assert bias is None
    counts = _graph_counts(output)
    assert counts["AddmmBackward0"] == 1 and counts["AddBackward0"] == 0, counts
    output.square().sum().backward()
    _assert_close(output, their_output, "output")
    for index, param in enumerate(ours.parameters(), start=1):
        _assert_close(param.grad, their_grads[index], f"parameter gradient {index}")
    # Not asked, a skip_bias_add layer returns its bias as Megatron's does.
    ours.zero_grad(set_to_none=True)
    output, bias = ours(inputs)
    assert (bias is ours.bias) == skip_bias_add
    assert _graph_counts(output)["AddmmBackward0"] == (0 if skip_bias_add else 1)


def _gpt_pair():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_dpp.mcore.direct_linear import with_direct_linears

    arguments = dict(config=_config(), vocab_size=VOCAB, max_sequence_length=SEQ,
                     pre_process=True, post_process=True,
                     share_embeddings_and_output_weights=True,
                     position_embedding_type="learned_absolute")
    torch.manual_seed(0)
    theirs = GPTModel(transformer_layer_spec=get_gpt_layer_local_spec(), **arguments)
    with torch.no_grad():
        for param in theirs.parameters():
            param.add_(0.05 * torch.randn_like(param))
    ours = GPTModel(transformer_layer_spec=with_direct_linears(get_gpt_layer_local_spec()),
                    **arguments)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def test_a_gpt_chunk_with_direct_linears_is_megatrons(megatron):
    from megatron_dpp.mcore.direct_linear import DIRECT_CLASSES

    theirs, ours = _gpt_pair()
    direct = [module for module in ours.modules() if isinstance(module,
                                                                 tuple(DIRECT_CLASSES.values()))]
    assert len(direct) == 2 * 4  # qkv, proj, fc1, fc2 in each of the two layers
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    losses = []
    for model in (theirs, ours):
        loss = model(tokens, positions, None, labels=labels).sum()
        loss.backward()
        losses.append(loss)
    _assert_close(losses[1], losses[0], "loss")
    for (name, mine), (_, reference) in zip(ours.named_parameters(), theirs.named_parameters()):
        _assert_close(mine.grad, reference.grad, name)


def test_megatrons_forward_runs_where_it_has_work_to_do(megatron):
    from megatron_dpp.mcore.direct_linear import _one_rank_without_communication

    _, ours, width = _layer_pair("column", True, True)
    inputs = torch.randn(SEQ, BATCH, width)
    output, _ = _run_layer(ours, inputs, weight=ours.weight.detach().clone().requires_grad_())
    assert _graph_names(output) & set(MEGATRON_FUNCTIONS)  # a weight passed in

    def layer(**overrides):
        settings = dict(tp_group=types.SimpleNamespace(size=lambda: 1), sequence_parallel=False,
                        explicit_expert_comm=False, gradient_accumulation_fusion=False,
                        config=types.SimpleNamespace(defer_embedding_wgrad_compute=False))
        settings.update(overrides)
        return types.SimpleNamespace(**settings)

    assert _one_rank_without_communication(layer())
    assert _one_rank_without_communication(layer(tp_group=None))
    for overrides in (dict(tp_group=types.SimpleNamespace(size=lambda: 2)),
                      dict(sequence_parallel=True), dict(explicit_expert_comm=True),
                      dict(gradient_accumulation_fusion=True),
                      dict(config=types.SimpleNamespace(defer_embedding_wgrad_compute=True))):
        assert not _one_rank_without_communication(layer(**overrides)), overrides


def _classes(spec) -> set:
    import dataclasses

    found = set()

    def visit(value):
        if isinstance(value, type):
            found.add(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)
        elif dataclasses.is_dataclass(value):
            for field in dataclasses.fields(value):
                visit(getattr(value, field.name))

    visit(spec)
    return found


def test_the_local_specs_name_the_direct_linears(megatron):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_dpp import kernels
    from megatron_dpp.models.bert import bert_layer_spec
    from megatron_dpp.mcore.direct_linear import DIRECT_CLASSES
    from megatron_dpp.models.gpt import gpt_layer_spec
    from megatron_dpp.models.llama import llama_layer_spec
    from megatron_dpp.models.weight_grad import deferred_layer_spec
    from megatron_dpp.models.weight_grad.layers import (
        DeferredColumnParallelLinear,
        DeferredRowParallelLinear,
    )

    for build in (gpt_layer_spec, bert_layer_spec, llama_layer_spec):
        for attention in (kernels.SDPA, kernels.LOCAL):
            classes = _classes(build(attention))
            assert set(DIRECT_CLASSES.values()) <= classes, build.__name__
            assert not {ColumnParallelLinear, RowParallelLinear} & classes, build.__name__
            deferred = _classes(deferred_layer_spec(build(attention)))
            assert {DeferredColumnParallelLinear, DeferredRowParallelLinear} <= deferred
            assert not set(DIRECT_CLASSES.values()) & deferred
