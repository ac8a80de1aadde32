"""`python -m tests._fused_adam_entry ARGS`: megatron_dpp.pretrain_gpt with torch's fused AdamW
chosen as a GPU run chooses it (kernels.torch_fused_adam), for tests on the CPU, where torch has
the fused kernel too.

It also records which kernel each optimizer step ran, so that a test checks what happened rather
than a difference in the losses' last digits: every `torch.optim.Adam.step` notes whether torch's
fused implementation (`torch.optim.adam._fused_adam`, which `adam()` looks up at each call) ran in
it, and at exit the process prints `fused adam steps: [True, ...]` (one entry per step)."""
import atexit
import runpy

import torch
import torch.optim.adam as adam_module  # torch.optim deletes its submodules' names

from megatron_dpp import kernels

kernels.torch_fused_adam = lambda optimizer: optimizer == "adam"

_fused_calls = 0
_steps_fused: list[bool] = []
_fused_adam = adam_module._fused_adam
_adam_step = torch.optim.Adam.step


def _counted_fused_adam(*args, **kwargs):
    global _fused_calls
    _fused_calls += 1
    return _fused_adam(*args, **kwargs)


def _recorded_step(self, *args, **kwargs):
    before = _fused_calls
    result = _adam_step(self, *args, **kwargs)
    _steps_fused.append(_fused_calls > before)
    return result


adam_module._fused_adam = _counted_fused_adam
torch.optim.Adam.step = _recorded_step  # AdamW inherits it
atexit.register(lambda: print(f"fused adam steps: {_steps_fused}", flush=True))
runpy.run_module("megatron_dpp.pretrain_gpt", run_name="__main__", alter_sys=True)
