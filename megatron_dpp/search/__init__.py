"""Strategy search: profile the hardware and the model, price every layout with the simulator,
print the winner as Megatron flags.

    run_scripts/profile_hardware.sh  -> a directory of Galvatron hardware files
    run_scripts/profile_model.sh     -> a directory of Galvatron model files
    run_scripts/start-search.sh      -> the top layouts, a Megatron command line, a strategy JSON

Modules, each with one job (dependencies point down this list, never up):

- `hardware.py`: `HardwareProfile`, the cluster's figures (all-reduce bus bandwidth per group size
  and contiguity, point-to-point bandwidth per pipeline size, the overlap slowdown, optional
  sequence-parallel collective times), read from and written to Galvatron's file names and
  formats; named presets from published nominal figures, each with its source.
- `hardware_measurement.py`: measures a `HardwareProfile` over the backend in use (torch.distributed
  collectives; `shm_tensor` / `rdma_tensor` for point-to-point).
- `model_profile.py`: `ModelProfile`, forward time per layer type over batch sizes and sequence
  lengths and memory per layer (Galvatron's `computation_profiling_*` / `memory_profiling_*`).
- `memory_model.py`: the analytical model (parameter counts, the activation formulas of Megatron's
  selective-recompute paper) for sizes that cannot be run here.
- `model_measurement.py`: measures a `ModelProfile` by running Megatron-Core's layers (any model in
  `models.families`).
- `space.py`, `cost.py`, `engine.py`: the layouts, their memory and time (the simulator's pipeline
  time on modeled task durations, plus gradient sync and tensor-parallel communication), the pruned
  search with its progress bar; `lengths.py`: the sequence-length distribution of
  --variable-seq-lengths and each microbatch's padded length.
- `strategy.py`: the strategy JSON that the run scripts accept with `--strategy FILE`.
- `galvatron_strategy.py`: Galvatron's strategy file (`galvatron_config_*.json`) to our layout
  (`--galvatron-config`) and our winner to it (`--output-format galvatron`), where expressible.
- `cli.py`: `start-search.sh`'s flags and output.
"""
