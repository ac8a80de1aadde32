"""The models megatron_dpp trains, each described by a ModelSpec.

Nothing outside this package names a concrete model: the training loop, the pipeline runtime, the
platform and the search take a ModelSpec or a ModelFamily. A model is two things here: its
ModelFamily in families.py (flags, checks, tokenizer, vocabulary: what needs no torch) and its
module (models/gpt.py is the example) that builds its chunks with the layout-independent init
(models/init.py) and defines its ModelSpec, which the family names. MODEL_SPECS follows
families.MODEL_FAMILIES. docs/architecture.md, "Where to add a model", goes step by step.

`memory_model.py` (the analytical parameter and activation model) is standard library only, and
the search's torch-free tools import it: so the specs, which import torch and Megatron-Core, load
on first use of MODEL_SPECS or ModelSpec, not with the package.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_dpp.models.spec import ModelSpec

__all__ = ["MODEL_SPECS", "ModelSpec"]


def _model_specs() -> dict[str, ModelSpec]:
    import importlib

    from megatron_dpp.models.families import MODEL_FAMILIES

    specs = {}
    for name, family in MODEL_FAMILIES.items():
        module, attribute = family.spec.split(":")
        specs[name] = getattr(importlib.import_module(module), attribute)
    return specs


def __getattr__(name: str):
    if name == "MODEL_SPECS":
        globals()[name] = value = _model_specs()
        return value
    if name == "ModelSpec":
        from megatron_dpp.models.spec import ModelSpec

        return ModelSpec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
