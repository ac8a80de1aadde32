"""The analytical model the search prices layouts with. It lives in megatron_dpp.models.memory_model
(the models own what a model is, and the DPP runtime's memory budget uses the same model); this
name stays for the search's modules, its tools and their tests."""
from megatron_dpp.models.memory_model import *  # noqa: F401,F403
from megatron_dpp.models.memory_model import __all__  # noqa: F401
