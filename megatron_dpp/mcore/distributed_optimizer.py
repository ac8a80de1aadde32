"""Saving and loading Megatron-Core 0.16.1's distributed optimizer, mended from outside at the two
checkpoint formats' save and load (training/checkpoint/torch_dist.py, training/checkpoint/save_load.py).

With any Adam, the fully reshardable format (torch_dist's, `sharded_sd_metadata`):

- aligned_state_gather: get_parameter_state_dp_zero gathers a grad buffer's state into one
  tensor without the padding after each bucket, while sharded_param_state_fully_reshardable cuts
  each parameter out of it at its offset in the buffer, which counts that padding. A parameter
  after a padded bucket comes out shifted, its last elements zeros (the "param range exceeds
  unpadded buffer" warning). The shared word embedding has a bucket of its own (pp > 1, tied):
  on a first stage whose other parameters do not fill whole buckets it was saved a row short, and
  its resumed copy differed from the output layer's. During the gather each bucket counts its
  padding, so the gathered tensor has the buffer's offsets.

Over torch's Adam, where neither Apex nor Transformer Engine is installed (their FusedAdam keeps
`step` in its param groups; torch's Adam keeps a `step` tensor per parameter), four things its
load paths get wrong:

- before_sharded_load: DistributedOptimizer.sharded_state_dict(is_loading=True) starts from
  state_dict(), which reads every parameter's `step` and fails on a fresh optimizer (no step yet).
  The optimizer gets the state its first step would make; the load overwrites all of it.
- the same call wraps load_parameter_state_from_fully_reshardable, which copies a parameter's saved
  tensors over every entry of its state, `step` included, which the saved tensors lack
  (KeyError 'step'): the steps are set aside during that copy.
- after_load: load_state_dict gives every parameter the same `step` tensor, which torch's Adam then
  advances once per parameter and step (the bias correction of every later update wrong): each
  parameter gets a copy of its own.
- flagged_unpadded: load_parameter_state_from_dp_reshardable skips the entries flagged `padding`, a
  flag get_parameter_state_dp_reshardable does not write.

tests/test_distributed_optimizer.py resumes and reshards training through both formats and checks
every later loss against a run that was not interrupted, a tied first stage whose embedding's
bucket follows a padded one included (tests/test_v_placement_checkpoint.py: the v's rank 0).
"""
from __future__ import annotations

import functools

import torch


def _distributed_optimizers(optimizer) -> list:
    """The distributed optimizers among `optimizer`'s (or a chain's)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [sub for sub in getattr(optimizer, "chained_optimizers", [optimizer])
            if isinstance(sub, DistributedOptimizer)]


def _torch_adam_distributed_optimizers(optimizer) -> list:
    """The distributed optimizers among `optimizer`'s (or a chain's) that wrap torch's Adam."""
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE

    return [] if HAVE_APEX_OR_TE else _distributed_optimizers(optimizer)


def _setting_aside_adam_steps(load_param_state):
    @functools.wraps(load_param_state)
    def load(self, state_dict):
        steps = {param: state.pop("step") for param, state in self.optimizer.state.items()
                 if "step" in state}
        try:
            return load_param_state(self, state_dict)
        finally:
            for param, step in steps.items():
                self.optimizer.state[param]["step"] = step

    load.sets_aside_adam_steps = True
    return load


def _with_padded_buckets(get_state):
    @functools.wraps(get_state)
    def get(self, *args, **kwargs):
        buckets = [bucket for buffer in self.buffers for bucket in buffer.buckets]
        unpadded = [buffer.numel_unpadded for buffer in self.buffers], \
            [bucket.numel_unpadded for bucket in buckets]
        try:
            for buffer in self.buffers:
                buffer.numel_unpadded = buffer.numel
            for bucket in buckets:
                bucket.numel_unpadded = bucket.grad_data.numel()
            return get_state(self, *args, **kwargs)
        finally:
            for buffer, numel in zip(self.buffers, unpadded[0]):
                buffer.numel_unpadded = numel
            for bucket, numel in zip(buckets, unpadded[1]):
                bucket.numel_unpadded = numel

    get.pads_buckets = True
    return get


def aligned_state_gather(optimizer) -> None:
    """Before a torch_dist save or load builds the optimizer's sharded state dict: the gathered
    state at the buffer's offsets (see the module's text)."""
    for cls in {type(sub) for sub in _distributed_optimizers(optimizer)}:
        if not getattr(cls.get_parameter_state_dp_zero, "pads_buckets", False):
            cls.get_parameter_state_dp_zero = _with_padded_buckets(cls.get_parameter_state_dp_zero)


def before_sharded_load(optimizer) -> None:
    """Before a torch_dist load builds the optimizer's sharded state dict (see the module's text)."""
    subs = _torch_adam_distributed_optimizers(optimizer)
    if not subs:
        return
    cls = type(subs[0])
    if not getattr(cls.load_parameter_state_from_fully_reshardable, "sets_aside_adam_steps", False):
        cls.load_parameter_state_from_fully_reshardable = _setting_aside_adam_steps(
            cls.load_parameter_state_from_fully_reshardable)
    for sub in subs:
        if len(sub.optimizer.state) > 0:
            continue
        sub.init_state_fn(sub.optimizer, sub.config)  # exp_avg, exp_avg_sq: zeros
        for group in sub.optimizer.param_groups:
            for param in group["params"]:
                sub.optimizer.state[param].setdefault("step", torch.tensor(0.0))


def after_load(optimizer) -> None:
    """After either format's load: every parameter's `step` a tensor of its own."""
    for sub in _torch_adam_distributed_optimizers(optimizer):
        for state in sub.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()


def flagged_unpadded(param_state: dict) -> dict:
    """get_parameter_state_dp_reshardable()'s output as load_parameter_state_from_dp_reshardable()
    reads it: every entry the getter writes is a parameter's, none padding."""
    for key, per_dtype in param_state.items():
        if isinstance(key, int):  # a grad buffer's index; the other keys hold bucket sizes
            for buckets in per_dtype.values():
                for bucket in buckets:
                    for entry in bucket:
                        entry.setdefault("padding", False)
    return param_state
