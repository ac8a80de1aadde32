"""Where run-time recording will live: per-rank task events with clock alignment across ranks and
nodes, NVTX ranges on GPUs, the Chrome-trace writer the simulator also uses, and the aggregation
behind `profiling/aggregate.py`. Nothing is recorded yet; today the runtime keeps one
IterationRecord per call (megatron_dpp.runtime) and the simulator writes its own Chrome trace."""
