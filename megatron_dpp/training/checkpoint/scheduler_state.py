"""The learning-rate schedule's state as a checkpoint holds it.

Ours count samples, as Megatron-LM's do, and say so with SAMPLES_MARKER beside the state (both
formats). Checkpoints of megatron-dpp before that counted iterations: they have no marker and are
converted once, with a line saying so. Megatron-Core's older key names are read too, as its own
load_state_dict reads them.
"""
from __future__ import annotations

from typing import Optional

# Saved beside the scheduler's state in our checkpoints (both formats): its steps are samples.
# Megatron-LM's checkpoints have no such key and always count samples.
SAMPLES_MARKER = "megatron_dpp_schedule_in_samples"

# Megatron-Core's older names for a state's values (its load_state_dict reads them too).
_OLD_NAMES = {"start_lr": "max_lr", "warmup_iter": "lr_warmup_steps",
              "warmup_steps": "lr_warmup_steps", "end_iter": "lr_decay_steps",
              "decay_steps": "lr_decay_steps", "decay_style": "lr_decay_style",
              "num_iters": "num_steps"}
# Lengths (counts of steps) in a state: what an iteration-counted state multiplies.
_LENGTHS = ("num_steps", "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps")


def state_in_samples(saved: dict, in_samples: bool, iteration: int,
                     consumed_samples: int, saved_args=None) -> tuple[dict, Optional[str]]:
    """A checkpoint's scheduler state with its lengths in samples, and a line saying what was
    converted (None: nothing). in_samples: the state counts samples (ours with SAMPLES_MARKER, or
    Megatron-LM's); otherwise it is an earlier megatron-dpp's, counted in iterations, whose
    global batch is consumed_samples / iteration (it had no batch-size ramp-up)."""
    state = {_OLD_NAMES.get(key, key): value for key, value in saved.items()}
    if in_samples:
        return state, None
    batch = consumed_samples // iteration if iteration > 0 else \
        getattr(saved_args, "global_batch_size", None)
    if not batch:
        raise ValueError("its learning-rate schedule counts iterations (saved by an earlier "
                         "megatron-dpp) and its global batch size is unknown")
    for key in _LENGTHS:
        if key in state:
            state[key] = state[key] * batch
    return state, (f"its learning-rate schedule counted iterations (saved by an earlier "
                   f"megatron-dpp): converted to samples at global batch {batch}")
