"""The models megatron_dpp trains, each described by a ModelSpec.

Nothing outside this package names a concrete model: the training loop, the pipeline runtime and
the platform take a ModelSpec. To add a model, write one module here (models/gpt.py is the
example) that builds its chunks with the layout-independent init (models/init.py) and defines a
ModelSpec, then register that spec in MODEL_SPECS below under its name.
"""
from megatron_dpp.models.bert import BERT_SPEC
from megatron_dpp.models.gpt import GPT_SPEC
from megatron_dpp.models.spec import ModelSpec

MODEL_SPECS: dict[str, ModelSpec] = {"gpt": GPT_SPEC, "bert": BERT_SPEC}

__all__ = ["MODEL_SPECS", "ModelSpec"]
