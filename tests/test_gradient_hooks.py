"""Our DistributedDataParallel (megatron_dpp.mcore.ddp): Megatron-Core's, whose
per-parameter backward hook, where it has only the accumulation to do, does only that. In one
process (tp = pp = dp = 1, gloo):

(a) the same model trained through Megatron's DDP and ours for two micro-batches leaves the same
    gradient buffer, bit for bit, and no parameter's `.grad` behind; with --overlap-grad-reduce
    too, where the last micro-batch's hooks start the buckets' reduction (finish_grad_sync then
    finds it started);
(b) Megatron's hook is kept where it has more to do: CUDA graphs, a parameter without a buffer.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from _one_rank import one_rank_megatron


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    with one_rank_megatron(tmp_path_factory.mktemp("gradient_hooks")):
        yield


def _config():
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                             use_cpu_initialization=True, hidden_dropout=0.0,
                             attention_dropout=0.0, bias_activation_fusion=False,
                             bias_dropout_fusion=False, masked_softmax_fusion=False,
                             gradient_accumulation_fusion=False)


def _model(config):
    from megatron.core.models.gpt import GPTModel

    from megatron_dpp.models.gpt import gpt_layer_spec

    torch.manual_seed(3)
    return GPTModel(config=config, transformer_layer_spec=gpt_layer_spec("sdpa"), vocab_size=64,
                    max_sequence_length=8)


def _ddp(ddp_class, config, **ddp_settings):
    from megatron.core.distributed import DistributedDataParallelConfig

    return ddp_class(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                           **ddp_settings),
                     module=_model(config))


def _accumulate_two_micro_batches(ddp) -> torch.Tensor:
    """The gradient buffers after a second iteration of two micro-batches, driven as Megatron's
    schedule drives them: no_sync but for the last micro-batch, then finish_grad_sync. Under
    --overlap-grad-reduce the last micro-batch's hooks of the second iteration start each bucket's
    reduction (the first iteration counts the hooks), and finish_grad_sync asserts they did."""
    generator = torch.Generator().manual_seed(7)
    for iteration in range(2):
        ddp.zero_grad_buffer()
        for micro_batch in range(2):
            tokens = torch.randint(0, 64, (2, 8), generator=generator)
            position_ids = torch.arange(8).expand(2, 8)
            context = ddp.no_sync() if micro_batch == 0 else contextlib.nullcontext()
            with context:
                loss = ddp(tokens, position_ids, None, labels=tokens).float().mean()
                loss.backward()
        if ddp.ddp_config.overlap_grad_reduce and iteration == 1:
            # The hooks said every gradient was ready: each bucket's reduction is under way
            # (without them finish_grad_sync would start it itself, hiding the difference).
            assert all(group.grad_reduce_handle is not None for group in ddp.bucket_groups)
        ddp.finish_grad_sync()
        assert all(param.grad is None for param in ddp.parameters())
    return torch.cat([buffer.grad_data.clone() for buffer in ddp.buffers])


@pytest.mark.parametrize("overlap", [False, True])
def test_the_same_gradients_as_megatrons_hook(megatron, overlap):
    from megatron.core.distributed import DistributedDataParallel as Megatrons

    from megatron_dpp.mcore.ddp import DistributedDataParallel

    config = _config()
    theirs = _accumulate_two_micro_batches(_ddp(Megatrons, config, overlap_grad_reduce=overlap))
    ours_ddp = _ddp(DistributedDataParallel, config, overlap_grad_reduce=overlap)
    param = next(ours_ddp.parameters())
    assert ours_ddp._make_backward_post_hook(param).__name__ == (
        "accumulate_and_mark_ready" if overlap else "accumulate_into_main_grad")
    ours = _accumulate_two_micro_batches(ours_ddp)
    assert theirs.abs().sum() > 0
    assert torch.equal(ours, theirs)


def test_megatrons_hook_where_it_has_more_to_do(megatron):
    from megatron_dpp.mcore.ddp import DistributedDataParallel, accumulation_only

    ddp = _ddp(DistributedDataParallel, _config())
    param = next(ddp.parameters())
    assert accumulation_only(ddp, param)
    ddp.config.cuda_graph_impl = "local"  # the hook must do nothing while a graph is captured
    assert not accumulation_only(ddp, param)
    assert ddp._make_backward_post_hook(param).__name__ == "hook"  # Megatron's
    ddp.config.cuda_graph_impl = "none"
    assert not accumulation_only(ddp, torch.nn.Parameter(torch.zeros(1)))  # no buffer
