"""Megatron-Core's optimizer where it has no setting for what we need.

Without Transformer Engine or Apex, Megatron-Core 0.16.1 falls back to per-tensor multi-tensor ops
(a host-device synchronization per parameter tensor, Python loops) chosen at import into module
globals, and builds torch's AdamW with no way to pass `fused`. `install_foreach_multi_tensor_ops`
rebinds those globals to foreach versions; `set_torch_adam_implementation` rewrites the torch
Adams' parameter groups. The training loop and the search's optimizer measurement call them.
"""
from __future__ import annotations


def foreach_multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for amp_C.multi_tensor_l2norm (per_tensor=False): the l2 norm of all tensors of
    tensor_lists[0] as a 1-element fp32 tensor on their device, and None.

    Megatron-Core's own fallback (megatron.core.utils.local_multi_tensor_l2_norm) takes one
    torch.norm per tensor, then builds a CPU tensor from the list of device scalars and a device
    tensor from its float: on CUDA one host-device synchronization per parameter tensor (about 150
    for GPT-125m) and one more, every optimizer step. This one is two launches (torch._foreach_norm
    and the norm of the stacked norms) and never synchronizes. On CPU the numbers are the same bits
    (the same per-tensor norm, then the norm of the same fp32 vector)."""
    if per_tensor:
        from megatron.core.utils import local_multi_tensor_l2_norm

        return local_multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args)
    import torch

    norms = torch.stack(torch._foreach_norm(tensor_lists[0]))
    if norms.dtype != torch.float32:  # the fallback's torch.tensor(list) made fp32 values
        norms = norms.float()
    return torch.linalg.vector_norm(norms).reshape(1), None


def foreach_multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for amp_C.multi_tensor_scale: tensor_lists[1][i] = tensor_lists[0][i] * scale.

    Megatron-Core's fallback (local_multi_tensor_scale) loops in Python, two launches per tensor
    (`dst.copy_(src * scale)`); it copies the fp32 main parameters to the bf16 model parameters
    (scale 1.0) and clips gradients (in place) once per step. The same values here, with foreach
    ops: x * 1.0 is x, and a product is rounded once, to the source's dtype, before the copy."""
    sources, destinations = tensor_lists[0], tensor_lists[1]
    if not sources:
        return
    import torch

    if scale == 1.0:
        torch._foreach_copy_(destinations, sources)
    elif all(s is d for s, d in zip(sources, destinations)):
        torch._foreach_mul_(sources, scale)
    else:
        torch._foreach_copy_(destinations, torch._foreach_mul(sources, scale))


def install_foreach_multi_tensor_ops() -> bool:
    """Where Megatron-Core fell back to its local multi-tensor ops (neither Transformer Engine nor
    Apex importable), point its gradient-norm and scale/copy calls at the foreach versions above.
    True when something was replaced; idempotent.

    This replaces module globals of Megatron-Core (clip_grads.l2_norm_impl, and
    multi_tensor_scale_impl in clip_grads and optimizer), chosen by Megatron-Core at import from
    what is installed: it has no config or hook to choose them, and its fallbacks cost a
    host-device synchronization per parameter tensor on every step (see
    foreach_multi_tensor_l2_norm). The call signatures are amp_C's, which Megatron-Core calls them
    with through multi_tensor_applier."""
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    replaced = False
    if getattr(clip_grads, "l2_norm_impl", None) is mcore_utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_multi_tensor_l2_norm
        replaced = True
    for module in (clip_grads, mcore_optimizer):
        if getattr(module, "multi_tensor_scale_impl", None) is mcore_utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = foreach_multi_tensor_scale
            replaced = True
    return replaced


def torch_adams(optimizer) -> list:
    """The torch Adam/AdamW instances inside a Megatron-Core optimizer (its chained optimizers'
    inner optimizers); empty for Transformer Engine's or Apex's FusedAdam, or SGD."""
    import torch

    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    inner = [getattr(part, "optimizer", part) for part in chained]
    return [opt for opt in inner if isinstance(opt, torch.optim.Adam)]


def set_torch_adam_implementation(optimizer, fused: bool) -> int:
    """Every torch Adam/AdamW in `optimizer` fused (`fused=True`, its step counters float32 on
    their parameter's device) or on torch's default (`fused`/`foreach` None, counters on the CPU),
    each parameter with a step counter of its own. Returns the number of torch optimizers set.

    Without Transformer Engine or Apex, Megatron-Core 0.16.1 builds `torch.optim.AdamW(params, lr,
    weight_decay, betas, eps)`, and has no setting that passes `fused` to torch: the training loop
    sets it here after the optimizer is built and again after a checkpoint load, since torch's
    `load_state_dict` takes the saved groups' `fused`/`foreach` (whatever the saving run used), and
    Megatron-Core's distributed optimizer gives every parameter one shared step tensor on load,
    which a fused step (one increment per tensor in its list) would advance once per parameter.
    torch_fused_adam decides; the search's optimizer measurement uses the same choice."""
    import torch

    def step_dtype(fused_step: bool) -> torch.dtype:
        # torch.optim's own choice for a step counter (optimizer._get_scalar_dtype).
        if fused_step or torch.get_default_dtype() != torch.float64:
            return torch.float32
        return torch.float64

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
                state["step"] = value.detach().to(device=param.device if fused else "cpu",
                                                  dtype=step_dtype(fused), copy=True)
    return len(adams)
