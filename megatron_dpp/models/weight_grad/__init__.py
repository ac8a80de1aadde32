"""Split backward, model side: B computes input gradients, W the weight gradients, later.

    stash = WeightGradStash()
    model = DeferredGPTModel(config=..., transformer_layer_spec=get_gpt_layer_local_spec(), ...)
    with stash.defer(key):          # F of microbatch `key`
        loss = model(...)
    loss.backward()                 # B: input gradients; the weight work is stored under `key`
    stash.run(key)                  # W: the weight gradients, into .grad (DDP: main_grad)

`store.py` holds the stash, `functions.py` the autograd functions with split backwards,
`layers.py` the Megatron-Core layer subclasses that use them, `model.py` the layer spec and the
GPT and BERT models, `memory.py` the stash's bytes per microbatch (what the runtime's budget counts). docs/weight_grad.md says what is covered and what the stash holds.
"""
from megatron_dpp.models.weight_grad.layers import (
    DeferredColumnParallelLinear,
    DeferredEmbedding,
    DeferredLayerNorm,
    DeferredRowParallelLinear,
    DeferredTorchLinear,
    DeferredVocabParallelEmbedding,
)
from megatron_dpp.models.weight_grad.memory import megatron_weight_grad_bytes, weight_grad_bytes_per_token
from megatron_dpp.models.weight_grad.model import (
    DeferredBertModel,
    DeferredGPTModel,
    adopt_deferred_embedding_and_output,
    deferred_block_spec,
    deferred_layer_spec,
    undeferred_parameters,
)
from megatron_dpp.models.weight_grad.store import (
    WeightGradError,
    WeightGradStash,
    WeightGradWork,
    active_deferral,
)

__all__ = [
    "WeightGradStash",
    "WeightGradError",
    "WeightGradWork",
    "active_deferral",
    "DeferredColumnParallelLinear",
    "DeferredRowParallelLinear",
    "DeferredLayerNorm",
    "DeferredVocabParallelEmbedding",
    "DeferredEmbedding",
    "DeferredTorchLinear",
    "DeferredGPTModel",
    "DeferredBertModel",
    "deferred_layer_spec",
    "deferred_block_spec",
    "adopt_deferred_embedding_and_output",
    "undeferred_parameters",
    "megatron_weight_grad_bytes",
    "weight_grad_bytes_per_token",
]
