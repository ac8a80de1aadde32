"""torch's fused AdamW where Megatron-Core falls back to torch's AdamW on a GPU.

Without Transformer Engine or Apex, Megatron-Core 0.16.1 builds `torch.optim.AdamW(params, lr,
weight_decay, betas, eps)`, and torch then takes its default implementation: on CUDA, foreach, a
dozen foreach ops a step and per-parameter Python (each parameter's bias corrections read its step
counter, a CPU tensor). The FusedAdam that Megatron-LM users get from Transformer Engine or Apex
updates every parameter in one multi-tensor kernel; torch's own fused AdamW (`fused=True`) does the
same, on the GPU, step counters included. Megatron-Core has no setting that passes `fused` to torch,
so the implementation is set on the optimizer's parameter groups after it is built, and again after
a checkpoint load: torch's `load_state_dict` takes the saved groups' `fused`/`foreach` (whatever
the saving run used), and Megatron-Core's distributed optimizer gives every parameter one shared
step tensor on load, which a fused step (one increment per tensor in the list) would count many
times over. `kernels.torch_fused_adam` decides (Adam on a CUDA machine, no Transformer Engine or
Apex); the `kernels: fused optimizer` line says which runs.
"""
from __future__ import annotations

import torch

__all__ = ["torch_adams", "set_torch_adam_implementation"]


def torch_adams(optimizer) -> list[torch.optim.Adam]:
    """The torch Adam/AdamW instances inside a Megatron-Core optimizer (its chained optimizers'
    inner optimizers); empty for Transformer Engine's or Apex's FusedAdam, or SGD."""
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    inner = [getattr(part, "optimizer", part) for part in chained]
    return [opt for opt in inner if isinstance(opt, torch.optim.Adam)]


def _step_dtype() -> torch.dtype:
    # torch.optim's own choice for a step counter (optimizer._get_scalar_dtype).
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def set_torch_adam_implementation(optimizer, fused: bool) -> int:
    """Every torch Adam/AdamW in `optimizer` fused (`fused=True`, its step counters float32 on their
    parameter's device) or on torch's default (`fused`/`foreach` None, counters on the CPU), each
    parameter with a step counter of its own. Returns the number of torch optimizers set."""
    adams = torch_adams(optimizer)
    for adam in adams:
        for group in adam.param_groups:
            group["fused"] = True if fused else None
            group["foreach"] = False if fused else None
            for param in group["params"]:
                state = adam.state.get(param)
                if not state or "step" not in state:
                    continue  # torch makes the counter at the first step, as the group says
                step = state["step"]
                value = step if torch.is_tensor(step) else torch.tensor(float(step))
                state["step"] = value.detach().to(
                    device=param.device if fused else "cpu",
                    dtype=torch.float32 if fused else _step_dtype(), copy=True)
    return len(adams)
