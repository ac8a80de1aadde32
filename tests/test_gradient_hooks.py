"""Our DistributedDataParallel (megatron_dpp.training.gradient_hooks): Megatron-Core's, whose
per-parameter backward hook, where it has only the accumulation to do, does only that. In one
process (tp = pp = dp = 1, gloo):

(a) the same model trained through Megatron's DDP and ours for two micro-batches leaves the same
    gradient buffer, bit for bit, and no parameter's `.grad` behind;
(b) Megatron's hook is kept wherever it has more to do: overlapped gradient reduction, CUDA graphs,
    a parameter without a buffer.
"""
from __future__ import annotations

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
    generator = torch.Generator().manual_seed(7)
    ddp.zero_grad_buffer()
    for _ in range(2):
        tokens = torch.randint(0, 64, (2, 8), generator=generator)
        position_ids = torch.arange(8).expand(2, 8)
        loss = ddp(tokens, position_ids, None, labels=tokens).float().mean()
        loss.backward()
    assert all(param.grad is None for param in ddp.parameters())
    return torch.cat([buffer.grad_data.clone() for buffer in ddp.buffers])


def test_the_same_gradients_as_megatrons_hook(megatron):
    from megatron.core.distributed import DistributedDataParallel as Megatrons

    from megatron_dpp.training.gradient_hooks import DistributedDataParallel

    config = _config()
    theirs = _accumulate_two_micro_batches(_ddp(Megatrons, config))
    ours_ddp = _ddp(DistributedDataParallel, config)
    param = next(ours_ddp.parameters())
    assert ours_ddp._make_backward_post_hook(param).__name__ == "accumulate_into_main_grad"
    ours = _accumulate_two_micro_batches(ours_ddp)
    assert theirs.abs().sum() > 0
    assert torch.equal(ours, theirs)


def test_megatrons_hook_where_it_has_more_to_do(megatron):
    from megatron_dpp.training.gradient_hooks import DistributedDataParallel, accumulation_only

    ddp = _ddp(DistributedDataParallel, _config())
    param = next(ddp.parameters())
    assert accumulation_only(ddp, param)
    ddp.ddp_config.overlap_grad_reduce = True  # the hook counts ready gradients per bucket
    assert not accumulation_only(ddp, param)
    assert ddp._make_backward_post_hook(param).__name__ == "hook"  # Megatron's
    ddp.ddp_config.overlap_grad_reduce = False
    ddp.config.cuda_graph_impl = "local"  # the hook must do nothing while a graph is captured
    assert not accumulation_only(ddp, param)
    ddp.config.cuda_graph_impl = "none"
    assert not accumulation_only(ddp, torch.nn.Parameter(torch.zeros(1)))  # no buffer
