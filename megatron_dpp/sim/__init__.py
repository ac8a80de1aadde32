"""Discrete-event simulator for pipeline schedules: `simulate(graph, schedule, duration_model,
comm_model, seed) -> SimResult` drives the same RankScheduler objects the runtime uses."""
from megatron_dpp.sim.models import CommModel, DurationModel, TaskDurations
from megatron_dpp.sim.simulator import SimResult, SimulationDeadlock, simulate

__all__ = ["CommModel", "DurationModel", "SimResult", "SimulationDeadlock", "TaskDurations", "simulate"]
