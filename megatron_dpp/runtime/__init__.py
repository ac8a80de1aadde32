"""The DPP executor: `forward_backward_dpp` (executor.py), Megatron's forward_backward_func run by
a dynamic pipeline policy (megatron_dpp.pipeline), with one handler per task kind (handlers.py),
the rank's place in the job (layout.py), the tensor-parallel decision channel, batch agreement,
gradient sync and the no-progress watchdog. Split backwards (--dpp-split-backward) are one optional
feature object, split_backward.py's SplitBackward, which registers its own handlers.

Start from `executor.make_forward_backward_dpp(config.DPPConfig(...), transport, microbatch_work,
activation_bytes_fn)` (a model's ModelSpec gives both functions): a `ForwardBackwardDPP`, called
like Megatron's forward_backward_func, with its `session`, `last_record` and `close()`. What a rank
ran is one record, its scheduler's `RunLog` (megatron_dpp.pipeline.run_log); Megatron-Core's schedule
steps, prologue and epilogue come from megatron_dpp.mcore.schedules.
Nothing is imported here, so `runtime.config` (the flags' defaults) loads without Megatron-Core.
"""
