"""What a run shows of itself: timers (timers.py, timer_hooks.py), TensorBoard and W&B
(tensorboard_log.py, wandb_log.py), throughput and the parameters' norm (throughput.py,
params_norm.py), the profiler window (profiler_window.py), and the trace hooks (tracing.py,
step_tracing.py, megatron_tracing.py, clock_sync.py)."""
