"""The GPT forward step Megatron's schedules (and the DPP runtime) call once per micro-batch."""
from __future__ import annotations

from functools import partial

import torch


def gpt_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron-LM's 3-tuple form: (summed loss, token count, {"lm loss": [sum, count]})."""
    losses = output_tensor.float()
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses.view(-1) * mask)
    num_tokens = mask.sum().to(torch.int)
    # The schedule divides the returned loss in place: report a detached copy.
    report = torch.cat([loss_sum.detach().clone().view(1), num_tokens.detach().float().view(1)])
    return loss_sum, num_tokens, {"lm loss": report}


def gpt_forward_step(data_iterator, model, device: torch.device):
    """Reads exactly one micro-batch; ranks that need no tokens or labels still consume one."""
    batch = next(data_iterator)
    tokens = batch["tokens"].to(device, non_blocking=True)
    position_ids = batch["position_ids"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True)
    loss_mask = batch["loss_mask"].to(device, non_blocking=True)
    attention_mask = batch.get("attention_mask")
    if attention_mask is not None:
        attention_mask = attention_mask.to(device, non_blocking=True)
    output = model(tokens, position_ids, attention_mask, labels=labels)
    return output, partial(gpt_loss, loss_mask)


def make_forward_step(device: torch.device):
    """forward_step_func(data_iterator, model) for Megatron's schedules, tensors moved to device."""
    return partial(gpt_forward_step, device=device)
