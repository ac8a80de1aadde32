"""Checkpoints: the save transaction and load (save_load.py), Megatron-Core's distributed format
with resharding (torch_dist.py), checksums (integrity.py), the scheduler state's saved form
(scheduler_state.py) and the checkpoint flags (flags.py)."""
