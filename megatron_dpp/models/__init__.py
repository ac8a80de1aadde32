"""The models megatron_dpp trains, each described by a ModelSpec.

Nothing outside this package names a concrete model: the training loop, the pipeline runtime and
the platform take a ModelSpec. To add a model, write one module here (models/gpt.py is the
example) that builds its chunks with the layout-independent init (models/init.py) and defines a
ModelSpec, then register that spec in MODEL_SPECS below under its name.

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
    from megatron_dpp.models.bert import BERT_SPEC
    from megatron_dpp.models.gpt import GPT_SPEC

    return {"gpt": GPT_SPEC, "bert": BERT_SPEC}


def __getattr__(name: str):
    if name == "MODEL_SPECS":
        globals()[name] = value = _model_specs()
        return value
    if name == "ModelSpec":
        from megatron_dpp.models.spec import ModelSpec

        return ModelSpec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
