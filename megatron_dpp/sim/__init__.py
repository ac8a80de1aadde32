"""Discrete-event simulator for pipeline schedules: `simulate(graph, schedule, duration_model,
comm_model, seed) -> SimResult` drives the same RankScheduler objects the runtime uses;
workloads.py makes packed long-context batches (equal tokens, unequal attention work)."""
from megatron_dpp.sim.models import CommModel, DurationModel, TaskDurations
from megatron_dpp.sim.simulator import SimResult, SimulationDeadlock, simulate
from megatron_dpp.sim.workloads import Pack, PackedLongContext

__all__ = ["CommModel", "DurationModel", "Pack", "PackedLongContext", "SimResult",
           "SimulationDeadlock", "TaskDurations", "simulate"]
