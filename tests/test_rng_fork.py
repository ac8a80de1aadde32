"""megatron_dpp.mcore.rng: the model-parallel RNG fork of core attention's dropout.

- the same dropout masks as Megatron-Core's `get_cuda_rng_tracker().fork()`, call after call, and
  the same tracker and default-generator states afterwards, bit for bit;
- SdpaCoreAttention with dropout: the same output and gradients as with Megatron's fork;
- an exception inside restores the states; a checkpointed recompute replays the mask;
- Megatron's own fork where the states are not plain tensors or another fork is open.
"""
from __future__ import annotations

import pytest
import torch

from megatron_dpp.models.gpt import GPT_SPEC

from _one_rank import one_rank_megatron

DEVICE = torch.device("cpu")


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    with one_rank_megatron(tmp_path_factory.mktemp("rng_fork"), GPT_SPEC.cpu_patched_modules):
        yield


@pytest.fixture
def tracker(megatron):
    """Megatron's tracker, its states and the default generator's put back after the test."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    states = {name: state.clone() for name, state in tracker.get_states().items()}
    default_state = torch.get_rng_state()
    yield tracker
    tracker.set_states(states)
    tracker._current_state_name = "default-rng"
    torch.set_rng_state(default_state)


def _snapshot(tracker):
    return ({name: state.clone() for name, state in tracker.get_states().items()},
            torch.get_rng_state())


def _restore(tracker, snapshot):
    states, default_state = snapshot
    tracker.set_states({name: state.clone() for name, state in states.items()})
    torch.set_rng_state(default_state)


def _draws(fork) -> list[torch.Tensor]:
    """Three forked dropout masks with draws from the default stream between them."""
    masks = []
    for _ in range(3):
        with fork():
            masks.append(torch.nn.functional.dropout(torch.ones(64), p=0.5))
        masks.append(torch.rand(4))  # the default stream (hidden dropout) in between
    return masks


def _assert_same_states(a, b):
    states_a, default_a = a
    states_b, default_b = b
    assert states_a.keys() == states_b.keys()
    for name in states_a:
        assert torch.equal(states_a[name], states_b[name]), name
    assert torch.equal(default_a, default_b)


def test_fork_draws_what_megatrons_fork_draws(tracker):
    from megatron_dpp.mcore.rng import model_parallel_rng

    start = _snapshot(tracker)
    expected = _draws(lambda: tracker.fork())
    expected_after = _snapshot(tracker)
    _restore(tracker, start)
    actual = _draws(lambda: model_parallel_rng(DEVICE))
    for want, got in zip(expected, actual):
        assert torch.equal(got, want)
    _assert_same_states(_snapshot(tracker), expected_after)
    assert tracker._current_state_name == "default-rng"
    # The stream is not the default one: the fork changed what the masks are.
    _restore(tracker, start)
    unforked = _draws(_NoFork)
    assert not torch.equal(unforked[0], expected[0])


class _NoFork:
    def __enter__(self):
        return None

    def __exit__(self, *_exc):
        return None


def test_sdpa_attention_with_dropout_equals_megatrons_fork(tracker, monkeypatch):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dpp.models import sdpa_attention

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                               use_cpu_initialization=True, attention_dropout=0.5,
                               hidden_dropout=0.0)
    attention = sdpa_attention.SdpaCoreAttention(
        config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
        attention_type="self").train()
    generator = torch.Generator().manual_seed(3)
    qkv = [torch.randn(6, 2, 2, 8, generator=generator).requires_grad_() for _ in range(3)]

    def run():
        output = attention(*qkv, None)
        output.sum().backward()
        grads = [t.grad.clone() for t in qkv]
        for t in qkv:
            t.grad = None
        return output.detach(), grads

    start = _snapshot(tracker)
    ours, our_grads = run()
    after_ours = _snapshot(tracker)
    _restore(tracker, start)
    monkeypatch.setattr(sdpa_attention, "model_parallel_rng", lambda _device: tracker.fork())
    megatrons, megatron_grads = run()
    assert torch.equal(ours, megatrons)
    for got, want in zip(our_grads, megatron_grads):
        assert torch.equal(got, want)
    _assert_same_states(_snapshot(tracker), after_ours)


def test_an_exception_inside_restores_the_states(tracker):
    from megatron_dpp.mcore.rng import MODEL_PARALLEL_STREAM, model_parallel_rng

    default_before = torch.get_rng_state()
    stream_before = tracker.get_states()[MODEL_PARALLEL_STREAM].clone()
    with pytest.raises(RuntimeError, match="inside"):
        with model_parallel_rng(DEVICE):
            torch.rand(8)
            raise RuntimeError("inside")
    assert torch.equal(torch.get_rng_state(), default_before)
    assert not torch.equal(tracker.get_states()[MODEL_PARALLEL_STREAM], stream_before)  # drawn
    assert tracker._current_state_name == "default-rng"


def test_checkpointed_recompute_replays_the_mask(tracker):
    """tensor_parallel.checkpoint restores the tracker's states before recomputing: the forked
    dropout in the recompute must draw the forward's mask, or the gradient would be wrong."""
    from megatron.core import tensor_parallel

    from megatron_dpp.mcore.rng import model_parallel_rng

    def function(x):
        with model_parallel_rng(DEVICE):
            return torch.nn.functional.dropout(x * 2.0, p=0.5)

    start = _snapshot(tracker)
    x = torch.ones(256, requires_grad=True)
    plain = function(x)
    plain.sum().backward()
    plain_grad = x.grad.clone()
    _restore(tracker, start)
    x.grad = None
    recomputed = tensor_parallel.checkpoint(function, False, x)
    recomputed.sum().backward()
    assert torch.equal(recomputed, plain)
    assert torch.equal(x.grad, plain_grad)
    assert plain_grad.eq(0).any() and plain_grad.ne(0).any()  # a real mask


@pytest.mark.parametrize("case", ["graph-safe states", "another fork open", "another tracker"])
def test_megatrons_fork_where_states_are_not_plain(tracker, monkeypatch, case):
    from megatron.core.tensor_parallel import random as megatron_random

    from megatron_dpp.mcore import rng as rng_fork

    if case == "graph-safe states":
        monkeypatch.setattr(tracker, "use_cudagraphable_rng", True)
    elif case == "another fork open":
        monkeypatch.setattr(tracker, "_current_state_name", "expert-parallel-rng")
    else:
        class OtherTracker(megatron_random.CudaRNGStatesTracker):
            pass

        other = OtherTracker()
        other.set_states(tracker.get_states())
        monkeypatch.setattr(megatron_random, "get_cuda_rng_tracker", lambda *a, **k: other)
    fork = rng_fork.model_parallel_rng(DEVICE)
    assert not isinstance(fork, rng_fork._StateSwap)
    assert type(fork).__name__ == "_GeneratorContextManager"  # CudaRNGStatesTracker.fork()
