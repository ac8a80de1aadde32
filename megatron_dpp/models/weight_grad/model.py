"""GPT (and Llama, a GPTModel) and BERT model chunks whose every weight gradient can be deferred to W.

The transformer layers and the final layer norm come from a Megatron layer spec rewritten to our
classes (`deferred_layer_spec`, `deferred_block_spec`): the public way Megatron-Core lets a model
choose its layer classes. GPTModel and LanguageModelEmbedding build the word and position
embeddings and the output layer with hard-coded classes, which no spec reaches; for those,
`DeferredGPTModel` (a GPTModel subclass) changes the class of the built modules to ours
(`adopt_deferred_embedding_and_output`). See that function for why a class change rather than
a rebuilt module. `DeferredBertModel` does the same for BERT, whose heads (LM-head transform and
norm, pooler, sentence-order head) are built outside any spec too.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Optional, Union

import torch
from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
from megatron.core.models.bert.bert_model import BertModel
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from megatron_dpp.mcore.direct_linear import DirectColumnParallelLinear, DirectRowParallelLinear
from megatron_dpp.mcore.specs import replace_spec_classes
from megatron_dpp.models.bert_mask import LocalMaskBertModel
from megatron_dpp.models.weight_grad.layers import (
    DEFERRED_CLASSES,
    DeferredColumnParallelLinear,
    DeferredLayerNorm,
    DeferredRowParallelLinear,
    DeferredTorchNorm,
)
from megatron_dpp.models.weight_grad.store import WeightGradError

__all__ = [
    "deferred_layer_spec",
    "deferred_block_spec",
    "DeferredGPTModel",
    "DeferredBertModel",
    "adopt_deferred_embedding_and_output",
    "undeferred_parameters",
]

# The classes of Megatron-Core's local spec (get_gpt_layer_local_spec) and ours. With apex,
# the local spec's norm is FusedLayerNorm: ours is torch's LayerNorm (same math, other kernel).
# WrappedTorchNorm builds torch's LayerNorm or RMSNorm (Llama) by the config: so does ours.
# Our specs name the direct linears (mcore.direct_linear); the deferred linears subclass them, and
# the direct layer (mcore.direct_layer) stays: a split backward's forward is the fused one's, the
# biases in the GEMMs included (it measured 3-5% more forward time through Megatron's layer).
_SPEC_CLASSES: dict[type, type] = {
    ColumnParallelLinear: DeferredColumnParallelLinear,
    RowParallelLinear: DeferredRowParallelLinear,
    DirectColumnParallelLinear: DeferredColumnParallelLinear,
    DirectRowParallelLinear: DeferredRowParallelLinear,
    WrappedTorchNorm: DeferredTorchNorm,
    FusedLayerNorm: DeferredLayerNorm,
}


def _refuse_transformer_engine(cls: type) -> None:
    if cls.__module__.startswith("megatron.core.extensions"):
        raise WeightGradError(f"deferred weight gradients cover Megatron-Core's local layers, "
                              f"not Transformer Engine's ({cls.__name__})")


def _rewrite(value):
    return replace_spec_classes(value, _SPEC_CLASSES, _refuse_transformer_engine)


def deferred_layer_spec(layer_spec: ModuleSpec) -> ModuleSpec:
    """A copy of a transformer-layer spec with our classes in place of Megatron's local linear
    and norm classes (the given spec is left as it is)."""
    return _rewrite(layer_spec)


def deferred_block_spec(config: TransformerConfig,
                        layer_spec: Union[ModuleSpec, TransformerBlockSubmodules],
                        vp_stage: Optional[int] = None,
                        pp_rank: Optional[int] = None) -> ModuleSpec:
    """A TransformerBlock spec for one chunk: its layers from `layer_spec`, rewritten, and our
    layer norm as the final norm. (Given a layer spec, TransformerBlock would pick the final norm
    itself, from a module global; a block spec is the public way to choose it.)"""
    if isinstance(layer_spec, ModuleSpec) and isinstance(layer_spec.module, type) \
            and issubclass(layer_spec.module, TransformerBlock):
        layer_spec = layer_spec.submodules
    if isinstance(layer_spec, TransformerBlockSubmodules):
        submodules = _rewrite(layer_spec)
        if submodules.layer_norm is not None:
            submodules = dataclasses.replace(submodules, layer_norm=DeferredTorchNorm)
    else:
        count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
        submodules = TransformerBlockSubmodules(layer_specs=[_rewrite(layer_spec)] * count,
                                                layer_norm=DeferredTorchNorm)
    return ModuleSpec(module=TransformerBlock, submodules=submodules)


def _adopt(module: Optional[torch.nn.Module]) -> None:
    if module is None:
        return
    if type(module) in DEFERRED_CLASSES.values():
        return
    ours = DEFERRED_CLASSES.get(type(module))
    if ours is None:
        raise WeightGradError(f"no deferred version of {type(module).__name__}")
    module.__class__ = ours


def adopt_deferred_embedding_and_output(model: GPTModel) -> None:
    """Give GPT's word and position embeddings and its output layer our classes.

    LanguageModelEmbedding and GPTModel build these with fixed classes, not through a spec. Our
    classes only add behaviour (no state, no __init__), so the class of each built module is
    changed in place: the parameters stay the objects Megatron made and set up (the tied or
    shared-embedding attributes of setup_embeddings_and_output_layer,
    is_embedding_or_output_parameter, the layout-independent init, DDP's buffers if it already
    wraps the model). A replacement module would have to redo that setup; a GPTModel subclass
    that built them itself would copy GPTModel.__init__.
    """
    embedding = getattr(model, "embedding", None)
    if embedding is not None:
        _adopt(embedding.word_embeddings)
        _adopt(getattr(embedding, "position_embeddings", None))
        _adopt(getattr(embedding, "tokentype_embeddings", None))
    _adopt(getattr(model, "output_layer", None))


_GPT_ARGUMENTS = inspect.signature(GPTModel.__init__)


class DeferredGPTModel(GPTModel):
    """GPTModel whose every trainable parameter's gradient can be deferred to W.

    Takes GPTModel's arguments; `transformer_layer_spec` is Megatron's local layer spec (as
    megatron_dpp.models.gpt picks it without Transformer Engine), which is rewritten here. Outside
    `WeightGradStash.defer`, it computes exactly what GPTModel computes."""

    def __init__(self, *args, **kwargs):
        call = _GPT_ARGUMENTS.bind(self, *args, **kwargs)
        arguments = call.arguments
        if arguments.get("mtp_block_spec") is not None:
            raise WeightGradError("DeferredGPTModel does not cover multi-token prediction")
        groups = arguments.get("pg_collection")
        pp_rank = groups.pp.rank() if groups is not None and hasattr(groups, "pp") else None
        arguments["transformer_layer_spec"] = deferred_block_spec(
            arguments["config"], arguments["transformer_layer_spec"],
            vp_stage=arguments.get("vp_stage"), pp_rank=pp_rank)
        super().__init__(*call.args[1:], **call.kwargs)
        adopt_deferred_embedding_and_output(self)


_BERT_ARGUMENTS = inspect.signature(BertModel.__init__)


class DeferredBertModel(LocalMaskBertModel):
    """BertModel whose every trainable parameter's gradient can be deferred to W.

    Takes BertModel's arguments; `transformer_layer_spec` is Megatron-Core's local BERT layer spec
    (its core attention the one megatron_dpp.kernels chose), rewritten here. BertModel reads the
    attention-mask type from a *layer* spec, so it gets the
    rewritten layer spec (not a block spec, as GPT does), and the modules built outside it (the
    encoder's final norm, the embeddings, the output layer and the heads) change class after the
    build, as in `adopt_deferred_embedding_and_output`. Outside `WeightGradStash.defer`, it
    computes exactly what BertModel computes."""

    def __init__(self, *args, **kwargs):
        call = _BERT_ARGUMENTS.bind(self, *args, **kwargs)
        call.arguments["transformer_layer_spec"] = deferred_layer_spec(
            call.arguments["transformer_layer_spec"])
        super().__init__(*call.args[1:], **call.kwargs)
        adopt_deferred_embedding_and_output(self)
        _adopt(getattr(self.encoder, "final_layernorm", None))
        lm_head = getattr(self, "lm_head", None)
        if lm_head is not None:
            _adopt(lm_head.dense)
            _adopt(lm_head.layer_norm)
        pooler = getattr(self, "pooler", None)
        if pooler is not None:
            _adopt(pooler.dense)
        _adopt(getattr(self, "binary_head", None))


def undeferred_parameters(model: torch.nn.Module) -> list[str]:
    """Names of the trainable parameters whose gradient a deferred backward would still
    accumulate at B (empty for a DeferredGPTModel or DeferredBertModel): a runtime can refuse to
    split with them."""
    names = []
    ours = tuple(DEFERRED_CLASSES.values())
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad:
                continue
            covered = isinstance(module, ours)
            if isinstance(module, RowParallelLinear) and name == "bias":
                # In the direct product the bias is deferred with the weight; after the tp
                # reduction (Megatron's forward), only when returned to the caller.
                covered = covered and (module.skip_bias_add
                                       or getattr(module, "multiplies_directly", False))
            if not covered:
                names.append(f"{module_name}.{name}" if module_name else name)
    return names
