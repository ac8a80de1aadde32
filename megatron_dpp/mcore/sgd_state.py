"""--optimizer sgd through Megatron-Core 0.16.1's optimizer wrappers: get_megatron_optimizer gives
SGD no state initializer (init_state_fn None), and loading a distributed (torch_dist) checkpoint
calls it to lay out the state it loads into, which fails with "'NoneType' object is not callable".
This one creates SGD's momentum buffers as zeros where torch's SGD keeps them. A zero buffer
changes no step: torch's first step with momentum m and no dampening takes m * 0 + grad, the
gradient itself, as it does without a buffer.
"""
from __future__ import annotations

import torch


def init_sgd_momentum(optimizer: torch.optim.Optimizer, config=None) -> None:
    """Megatron-Core's init_state_fn signature: zero momentum buffers where there are none."""
    del config
    for group in optimizer.param_groups:
        if group["momentum"] == 0:
            continue  # torch's SGD keeps no state without momentum
        for param in group["params"]:
            state = optimizer.state[param]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(param.data)


def install_sgd_state_init(optimizer) -> None:
    """On each of Megatron's optimizer wrappers (a chain's too) over torch's SGD."""
    for wrapper in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(getattr(wrapper, "optimizer", None), torch.optim.SGD) \
                and getattr(wrapper, "init_state_fn", None) is None:
            wrapper.init_state_fn = init_sgd_momentum
