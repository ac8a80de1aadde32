"""The learning-rate and weight-decay schedule, counted in samples as Megatron-LM counts it.

Megatron-Core's OptimizerParamScheduler takes its lengths in "steps" and is advanced by a caller's
increment. Megatron-LM makes a step one sample: the lengths are --lr-warmup-iters x global batch
(or --lr-warmup-samples), and every successful update advances it by the global batch. The
learning rate of each iteration is the same as with steps counted in iterations (the schedule
depends on ratios of the two counts, which the common factor leaves exact), but the state a
checkpoint holds is not: this module counts samples so that a checkpoint's `opt_param_scheduler`
means the same here and in Megatron-LM, either way round.

Loading a checkpoint's schedule (Megatron-LM's rule): where the checkpoint's values differ from
this run's flags, the load stops in one line unless --override-opt_param-scheduler (the flags win)
or --use-checkpoint-opt_param-scheduler (the checkpoint wins) says which to take. Checkpoints of
megatron-dpp before this counted iterations; they are recognised by a missing marker and
converted once, with a line saying so (checkpoint/scheduler_state.py).
"""
from __future__ import annotations

from typing import Optional

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_dpp.training.config import TrainingConfig

# The state's values a load compares with this run's, as Megatron-Core's load_state_dict does,
# and the flags each comes from (for the one-line error).
_COMPARED = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "lr_warmup_steps": "warmup samples (--lr-warmup-iters/-samples/-fraction)",
    "lr_decay_steps": "decay samples (--lr-decay-iters/-samples, default the training's length)",
    "lr_decay_style": "--lr-decay-style",
    "start_wd": "--weight-decay",
    "end_wd": "--weight-decay",
    "wd_incr_steps": "weight-decay samples (the training's length)",
    "wd_incr_style": "weight-decay style",
    # Ours only (state_dict): the decoupled groups' max_lr/min_lr live in the optimizer's
    # param groups, which a load restores without a check.
    "decoupled_lr": "--decoupled-lr",
    "decoupled_min_lr": "--decoupled-min-lr",
}
class SampleSchedule(OptimizerParamScheduler):
    """Megatron-Core's scheduler over the lengths in samples of a TrainingConfig, advanced by the
    global batch. Weight decay stays constant, as Megatron-LM's default."""

    def __init__(self, optimizer, train: TrainingConfig):
        # Megatron-Core's own check of a loaded state is an assert; schedule_difference makes it
        # one line before the load, so Megatron-Core is told to take the checkpoint's values
        # unless the flags are to win.
        super().__init__(
            optimizer, init_lr=0.0, max_lr=train.lr, min_lr=train.min_lr,
            lr_warmup_steps=train.lr_warmup_samples, lr_decay_steps=train.lr_decay_samples,
            lr_decay_style=train.lr_decay_style,
            start_wd=train.weight_decay, end_wd=train.weight_decay,
            wd_incr_steps=train.wd_incr_samples, wd_incr_style="constant",
            use_checkpoint_opt_param_scheduler=not train.override_opt_param_scheduler,
            override_opt_param_scheduler=train.override_opt_param_scheduler)
        self.keep_checkpoint_schedule = train.use_checkpoint_opt_param_scheduler
        # --decoupled-lr's peak and floor (None: off; the floor defaults to --min-lr, as
        # Megatron-Core's param groups; --decoupled-min-lr alone does nothing).
        self.decoupled_lr = train.decoupled_lr
        self.decoupled_min_lr = None if train.decoupled_lr is None else (
            train.min_lr if train.decoupled_min_lr is None else train.decoupled_min_lr)

    def state_dict(self) -> dict:
        # Megatron-Core's load_state_dict (and Megatron-LM's) reads only its own keys.
        return {**super().state_dict(), "decoupled_lr": self.decoupled_lr,
                "decoupled_min_lr": self.decoupled_min_lr}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        if not self.override_opt_param_scheduler and "decoupled_lr" in state_dict:
            # The checkpoint's, as its param groups (restored with the optimizer) hold them.
            self.decoupled_lr = state_dict["decoupled_lr"]
            self.decoupled_min_lr = state_dict.get("decoupled_min_lr")
        if self.override_opt_param_scheduler:
            # The rate is computed from each parameter group's own max_lr and min_lr, which the
            # optimizer's checkpoint restored: the flags must win there too (Megatron-LM leaves
            # them, and its override changes nothing of the peak or the floor: its issue #1138).
            for group in self.optimizer.param_groups:
                decoupled = self.decoupled_lr is not None and not group.get("default_config", True)
                group["max_lr"], group["min_lr"] = ((self.decoupled_lr, self.decoupled_min_lr)
                                                    if decoupled else (self.max_lr, self.min_lr))
            self.step(0)

    def step_after_update(self, global_batch_size: int) -> None:
        """After a successful update of global_batch_size samples (a skipped fp16 update does
        not advance it, as in Megatron-LM)."""
        self.step(increment=global_batch_size)

    def schedule_difference(self, state: dict) -> Optional[str]:
        """Where a checkpoint's schedule (checkpoint/scheduler_state.py's state_in_samples) differs from this run's flags and
        neither --override-opt_param-scheduler nor --use-checkpoint-opt_param-scheduler was
        given: the differences and what to do, in one line; else None."""
        if self.override_opt_param_scheduler or self.keep_checkpoint_schedule:
            return None
        ours = self.state_dict()
        compared = list(_COMPARED)
        if _constant_weight_decay(ours) and _constant_weight_decay(state):
            # The weight decay's length and style change nothing then (Megatron-LM compares them
            # anyway, and stops a run that only trains longer).
            compared = [key for key in compared if key not in ("wd_incr_steps", "wd_incr_style")]
        differences = [f"{_COMPARED[key]} {state[key]!r} in the checkpoint, {ours[key]!r} here"
                       for key in compared if key in state and state[key] != ours[key]]
        if not differences:
            return None
        return ("its learning-rate schedule differs from this run's flags: "
                + "; ".join(dict.fromkeys(differences))
                + "; add --override-opt_param-scheduler to take this run's flags or "
                  "--use-checkpoint-opt_param-scheduler to keep the checkpoint's")


def _constant_weight_decay(state: dict) -> bool:
    return state.get("start_wd") == state.get("end_wd")
