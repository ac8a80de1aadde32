"""Pipeline schedules measured with timed stages in real processes over shm_tensor.

For each scenario (uniform, varlen, straggler) and V in --virtual-stages, P ranks run one global batch
of M microbatches under every schedule: Megatron-Core's 1F1B / interleaved 1F1B over the same
transport (megatron_dpp.comm's P2PCommunicator), every DPP policy and 1f1b-sorted through
forward_backward_dpp, and torch.distributed.pipelining's Schedule1F1B / ScheduleInterleaved1F1B (over
gloo; equal-size microbatches only). Each row: measured iteration time (median of --repeats, after
--warmup; the repeats run in rounds, every schedule once per round), the simulator's prediction for
the same sampled durations, the lower bound (busiest rank's work) and the peak activation bytes a rank
held. --trace also keeps every DPP repeat's executed task order per rank and replays it in the
simulator, which separates what a dynamic policy's run-time decisions cost from timing noise. Stages sleep for their durations (benchmarks/
timed_stage.py), so the numbers measure the schedule, not the CPU.

Packed long-context scenarios (packed8k, packed32k; not in the default list): windows of 8k or
32k tokens packed whole from lognormal documents (mean 2048, CV 1.5; megatron_dpp.sim's
PackedLongContext), each microbatch item carrying its documents' cu_seqlens as packed data does.
Every window holds the same tokens (activation bytes) but its work is W + c * sum of s_i^2 with c
the causal attention's cost per token pair of a hidden-4096 GPT layer (1/(12h)); the runtime
prices each item with the model's own work function (models/gpt.py gpt_microbatch_work). Rows:
Megatron's 1F1B, 1F1B+W (its order with split backwards, through the DPP runtime), dpp:adaptive
and dpp:adaptive+W, each DPP row at the default budget and at 1.25x (PACKED_BUDGET); with -V 2 also
the v placement with split backwards (ZB-V's order and dpp:adaptive, PACKED_V_SCHEDULES), against
the same 1F1B (V=1). Each row's peak per rank is reported against 1F1B's fullest rank (W's stash
counted: a split row's timed stage holds its activation until W).

    python benchmarks/schedule_bench.py --json runs/schedule_bench.json
    python benchmarks/schedule_bench.py --quick
    python benchmarks/schedule_bench.py --scenarios varlen -V 1 --trace --json runs/varlen_trace.json
    python benchmarks/schedule_bench.py --scenarios packed8k packed32k -V 1 -P 4 --json runs/packed.json
    python benchmarks/schedule_bench.py --scenarios packed32k -V 1 2 --schedules 1f1b \
        dpp:adaptive+W@1.25x zb-v+W/v dpp:adaptive+W/v
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Dict, List

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SCENARIOS = ("uniform", "varlen", "straggler")
# Packed long-context scenarios: name -> window tokens.
PACKED_SCENARIOS = {"packed8k": 8192, "packed32k": 32768}
PACKED_HIDDEN = 4096  # the layer whose attention prices a pack (the h)
PACKED_BUDGET = "1.25x"  # --dpp-memory-budget's relative form: 1.25 x 1F1B's fullest rank
PACKED_SCHEDULES = ("1f1b", "1f1b+W", "dpp:adaptive", "dpp:adaptive+W",
                    f"dpp:adaptive@{PACKED_BUDGET}", f"dpp:adaptive+W@{PACKED_BUDGET}")
# On the v placement (V=2), against the same 1F1B (V=1): ZB-V's order and dpp:adaptive, split.
PACKED_V_SCHEDULES = ("zb-v+W/v", "dpp:adaptive+W/v")
# The target: packed 32k, P=4, M=16, the best DPP row / Megatron's 1F1B, every rank
# within 1.25 x 1F1B's fullest-rank memory.
PACKED_TARGET = ("packed32k", 4, 16, 0.85, 1.25)
TORCH_SCHEDULES = {1: "torch:Schedule1F1B", 2: "torch:ScheduleInterleaved1F1B"}
# Rows of the DPP runtime with split backwards (--dpp-split-backward) end in SPLIT_SUFFIX, rows on
# the v placement (--dpp-stage-placement v) in V_SUFFIX, and rows under a --dpp-memory-budget mode
# other than auto in "@<mode>", as in benchmarks/schedule_sim.py.
SPLIT_SUFFIX = "+W"
V_SUFFIX = "/v"
SPLIT_SCHEDULES = ("dpp:adaptive+W", "dpp:adaptive+W@provisioned")
# The v placement's rows (V=2): ZB-V's own order and dpp:adaptive on it, fused and split.
V_PLACEMENT_ROWS = ("zb-v/v", "zb-v+W/v", "dpp:adaptive/v", "dpp:adaptive+W/v")
# The zero-bubble issue's target: the best v row / Megatron's 1F1B (V=1), uniform sizes, every rank
# holding at most what 1F1B holds on its first rank. Beside it ZB-V's bound: the simulator's time
# for zb-v+W/v over 1f1b's on the sampled durations with no overhead (0.868 at P=4, M=16 when
# F = B = W per chunk).
V_TARGET = 0.89
ZBV_BOUND_ROW = "zb-v+W/v"
# The weight-gradient issue's targets: the best dpp:adaptive+W row / Megatron's, per (scenario, V).
SPLIT_TARGETS = {("uniform", 1): 0.92, ("uniform", 2): 0.95, ("varlen", 1): 0.70, ("varlen", 2): 0.80}
PREDICTION_TOLERANCE = 0.10  # |measured - predicted| / predicted the simulator should stay within


def parse_schedule(label: str):
    """A row's schedule label -> (schedule name, split backwards?, budget mode or None)."""
    name, _, budget = label.partition("@")
    name = name.removesuffix(V_SUFFIX)
    split = name.endswith(SPLIT_SUFFIX)
    if split:
        name = name[:-len(SPLIT_SUFFIX)]
    return name, split, (budget or None)


def placement_of(label: str) -> str:
    """A row's stage placement (pipeline/placement.py's PLACEMENT_NAMES)."""
    from megatron_dpp.pipeline.placement import INTERLEAVED, V_SHAPE

    return V_SHAPE if label.partition("@")[0].endswith(V_SUFFIX) else INTERLEAVED


@dataclass(frozen=True)
class Scenario:
    name: str
    P: int
    V: int
    M: int
    mean_tokens: int
    forward_ms: float  # mean forward time of one microbatch on a whole rank (all its chunks)
    cv: float
    straggler_prob: float
    straggler_factor: float
    bytes_per_token: int
    seed: int

    @property
    def key(self) -> str:
        return f"{self.name}/V{self.V}"

    @property
    def packed(self) -> bool:
        return self.name in PACKED_SCENARIOS

    @property
    def max_tokens(self) -> int:
        # The longest sample a batch may contain: what fixed schedules must provision memory for.
        if self.packed:
            return PACKED_SCENARIOS[self.name]
        return 3 * self.mean_tokens if self.name == "varlen" else self.mean_tokens

    def workload(self):
        """The packed scenario's windows (megatron_dpp.sim.PackedLongContext), priced with the
        attention of a hidden-PACKED_HIDDEN GPT layer by the models' FLOP count."""
        from megatron_dpp.models.memory_model import (causal_attention_work_per_token_pair,
                                                      model_shape)
        from megatron_dpp.sim import PackedLongContext

        shape = model_shape("gpt", 1, PACKED_HIDDEN, PACKED_HIDDEN // 128, 1, 1)
        return PackedLongContext(PACKED_SCENARIOS[self.name],
                                 causal_attention_work_per_token_pair(shape))

    def packs(self):
        return self.workload().packs(self.M, np.random.default_rng(self.seed))

    def tokens(self) -> List[int]:
        """Each microbatch's tokens (what its activation bytes count)."""
        if self.packed:
            return [self.max_tokens] * self.M
        if self.name != "varlen":
            return [self.mean_tokens] * self.M
        rng = np.random.default_rng(self.seed)
        sigma = math.sqrt(math.log(1.0 + self.cv ** 2))
        draws = rng.lognormal(math.log(self.mean_tokens) - sigma ** 2 / 2, sigma, self.M)
        return [int(min(self.max_tokens, max(1, round(x)))) for x in draws]

    def sizes(self) -> List[int]:
        """Each microbatch's work (the task graph's sizes): its tokens, or a pack's work."""
        if self.packed:
            return self.workload().work(self.packs())
        return self.tokens()

    def act_bytes(self, tokens: List[int]) -> List[int]:
        return [s * self.bytes_per_token for s in tokens]

    def graph(self, split_backward: bool = False, placement: str = "interleaved"):
        from megatron_dpp.pipeline import TaskGraph
        from megatron_dpp.pipeline.placement import named_placement

        return TaskGraph(self.P, self.V, self.M, self.sizes(), self.act_bytes(self.tokens()),
                         max_act_bytes=self.max_tokens * self.bytes_per_token,
                         split_backward=split_backward,
                         placement=named_placement(placement, self.P, self.V))

    def items(self) -> List[dict]:
        """What the first stage's data iterator yields: each microbatch's tokens and index, and
        for packs its documents' boundaries (cu_seqlens, the packed data's contract)."""
        import torch

        from timed_stage import microbatch_item

        items = [microbatch_item(m, tokens) for m, tokens in enumerate(self.tokens())]
        if self.packed:
            for item, pack in zip(items, self.packs()):
                item["cu_seqlens"] = torch.tensor([0, *np.cumsum(pack.segments)], dtype=torch.int32)
        return items

    def duration_model(self, forward_overhead: float = 0.0, backward_overhead: float = 0.0):
        from megatron_dpp.sim import DurationModel

        # A forward of the mean microbatch takes forward_ms (packs: the mean window's work).
        mean_work = statistics.fmean(self.sizes()) if self.packed else self.mean_tokens
        return DurationModel(
            forward_overhead=forward_overhead,
            backward_overhead=backward_overhead,
            linear=self.forward_ms / mean_work,
            backward_ratio=2.0,
            straggler_prob=self.straggler_prob if self.name == "straggler" else 0.0,
            straggler_factor=self.straggler_factor if self.name == "straggler" else 1.0,
            straggler_scope="task",
        )


# ------------------------------------------------------------------------------------------------
# one rank
# ------------------------------------------------------------------------------------------------
def _build_runner(schedule: str, scenario: Scenario, model, transport, stash):
    """A callable(forward_step_func, data_iterator, model, num_microbatches, seq_length, ...).
    Split rows defer their W work into `stash` (timed_stage.TimedStash)."""
    from functools import partial

    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from timed_stage import microbatch_work

    from megatron_dpp.models.gpt import gpt_microbatch_work
    from megatron_dpp.runtime.config import DPPConfig
    from megatron_dpp.runtime.executor import make_forward_backward_dpp

    if schedule in ("1f1b", "interleaved-1f1b"):
        from megatron.core.pipeline_parallel.schedules import (
            forward_backward_pipelining_with_interleaving,
            forward_backward_pipelining_without_interleaving,
        )

        from megatron_dpp.comm.megatron_p2p import TransportP2PCommunicator

        config = model[0].config
        megatron_schedule = (forward_backward_pipelining_without_interleaving if schedule == "1f1b"
                             else forward_backward_pipelining_with_interleaving)
        communicator = TransportP2PCommunicator(parallel_state.get_pipeline_model_parallel_group(),
                                                config, transport)
        return partial(megatron_schedule, p2p_communicator=communicator,
                       pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    policy, split, budget = parse_schedule(schedule)
    # Packs: the runtime prices each item as training does (GPT's work function at the
    # scenario's c, from the item's cu_seqlens); their activation bytes count tokens only.
    work = (partial(gpt_microbatch_work, scenario.workload().per_token_pair) if scenario.packed
            else microbatch_work)
    # With split backwards a timed stage holds the activation itself until W (the simulator's
    # split graph), so the stash adds no bytes of its own to the budget's count.
    return make_forward_backward_dpp(
        DPPConfig(policy=policy, timeout_s=120.0, split_backward=split,
                  memory_budget_bytes=budget_value(budget), placement=placement_of(schedule)),
        transport, work,
        activation_bytes_fn=lambda _config, tokens, _mbs, _V, _P: scenario.act_bytes(list(tokens)),
        microbatch_tokens=microbatch_work,
        stash=stash if split else None,
        weight_grad_bytes_fn=(lambda _models, sizes, _dtype: [0] * len(sizes)) if split else None)


def budget_value(mode):
    """A row's budget mode ("provisioned", "1.25x", None: auto) as --dpp-memory-budget parses it."""
    from megatron_dpp.pipeline import parse_memory_budget

    return None if mode is None else parse_memory_budget(mode)


def _torch_pipelining_runner(schedule: str, scenario: Scenario, model, sizes: List[int]):
    """torch.distributed.pipelining over gloo: one PipelineStage per local chunk."""
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    from timed_stage import HIDDEN

    P, V, M = scenario.P, scenario.V, scenario.M
    rank = model[0].rank

    class _Wrapped(torch.nn.Module):
        def __init__(self, stage):
            super().__init__()
            self.stage = stage

        def forward(self, x):
            return self.stage(x)

    # Static shapes: without them the stages would infer shapes by running a forward on empty
    # tensors, and a timed stage reads its microbatch index from its input.
    example = torch.zeros(sizes[0], 1, HIDDEN)
    stages = [PipelineStage(_Wrapped(model[c]), c * P + rank, P * V, torch.device("cpu"),
                            input_args=example, output_args=example, input_grads=example,
                            output_grads=example)
              for c in range(V)]
    loss_fn = lambda output, _target: output.mean()  # noqa: E731
    if V == 1:
        schedule_obj = Schedule1F1B(stages[0], n_microbatches=M, loss_fn=loss_fn)
    else:
        schedule_obj = ScheduleInterleaved1F1B(stages, n_microbatches=M, loss_fn=loss_fn)

    def run():
        if rank == 0:
            batch = torch.zeros(M * sizes[0], 1, HIDDEN)
            for m in range(M):
                batch[m * sizes[0], 0, 0] = float(m)
            schedule_obj.step(batch)
        elif rank == P - 1:
            schedule_obj.step(target=torch.zeros(M * sizes[0], 1, HIDDEN), losses=[])
        else:
            schedule_obj.step()

    return run


def start_pipeline_rank(rank: int, P: int, port: int, pin: bool = True):
    """This process as pipeline rank `rank` of P (gloo, tp=1): its shm_tensor transport; with
    `pin`, on core rank mod cores (pinned_rank.pin_to_core): on 2 cores neighbouring ranks, every
    message's two ends, run on different cores, and no rank migrates mid-task. Its timed stages'
    sleeps end on time (precise_sleeps)."""
    if pin:
        from pinned_rank import pin_to_core

        pin_to_core(rank)  # first, so that every thread the imports below start inherits it
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(P), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from timed_stage import precise_sleeps

    from megatron_dpp.comm import make_transport
    from megatron_dpp.platform import setup_platform

    torch.set_num_threads(1)
    precise_sleeps()
    setup_platform()
    dist.init_process_group("gloo", rank=rank, world_size=P)
    # Megatron's schedules are called directly (not via get_forward_backward_func) and read the
    # virtual size from the model config, so one process group serves V=1 and V=2 alike.
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                             pipeline_model_parallel_size=P)
    return make_transport("shm")


def end_pipeline_rank(transport) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    transport.close()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _worker(rank: int, scenarios: List[Scenario], schedules_of: Dict[str, List[str]], warmup: int,
            repeats: int, trace: bool, pin: bool, port: int, results_queue) -> None:
    try:
        transport = start_pipeline_rank(rank, scenarios[0].P, port, pin)
        rows = []
        for scenario in scenarios:
            rows.extend(_run_schedules(rank, scenario, schedules_of[scenario.key], warmup, repeats,
                                       transport, trace))
        end_pipeline_rank(transport)
        if rank == 0:
            results_queue.put(("ok", rows))
    except BaseException:  # report any failure to the parent instead of dying silently
        results_queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))


def _gather_timeline(record, start: float, P: int) -> List[List[list]]:
    """Every rank's executed tasks of one repeat as [phase, microbatch, chunk, start ms, end ms]
    from the earliest rank's start (perf_counter is one clock for all processes of a machine)."""
    import torch.distributed as dist

    mine = (start, [(int(ran.task.phase), ran.task.microbatch, ran.task.chunk, ran.started, ran.ended)
                    for ran in record.ran])
    gathered = [None] * P
    dist.all_gather_object(gathered, mine)
    origin = min(rank_start for rank_start, _ in gathered)
    return [[[phase, m, c, (begin - origin) * 1e3, (end - origin) * 1e3] for phase, m, c, begin, end in tasks]
            for _, tasks in gathered]


def simulated_timeline(result, P: int) -> List[List[list]]:
    """A SimResult's timeline in _gather_timeline's format."""
    per_rank: List[List[list]] = [[] for _ in range(P)]
    for rank, task, begin, end in sorted(result.timeline, key=lambda item: item[2]):
        per_rank[rank].append([int(task.phase), task.microbatch, task.chunk, begin, end])
    return per_rank


def _run_schedules(rank: int, scenario: Scenario, schedules: List[str], warmup: int, repeats: int,
                   transport, trace: bool) -> List[dict]:
    import torch
    import torch.distributed as dist

    from megatron_dpp.pipeline import Phase
    from megatron_dpp.pipeline.budget import budget_bytes_for, default_budget_bytes
    from megatron_dpp.sim import CommModel, simulate
    from timed_stage import (ActivationMeter, TimedStage, TimedStash, forward_step,
                             timed_stage_config)

    P, V, M = scenario.P, scenario.V, scenario.M
    graph = scenario.graph()
    split_graph = scenario.graph(split_backward=True)
    # (split backwards?, placement) -> the task graph of a row
    graph_of = {(split, placement): scenario.graph(split, placement)
                for split in (False, True) for placement in {placement_of(s) for s in schedules}}
    sizes = scenario.tokens()  # torch's pipelining splits a batch of equal tokens
    durations = scenario.duration_model().sample(graph, np.random.default_rng(scenario.seed))
    # The same draws with every backward divided into B and W (DurationModel.weight_grad_fraction).
    split_durations = scenario.duration_model().sample(split_graph, np.random.default_rng(scenario.seed))
    meter = ActivationMeter()
    stash = TimedStash()
    config = timed_stage_config(P, V)
    model = [TimedStage(config, rank, c, durations, graph.act_bytes, meter,
                        split_durations=split_durations, stash=stash) for c in range(V)]

    def row_budget(schedule: str) -> int:
        """The bytes this rank may hold under the row's schedule: the DPP policy's budget, or for
        Megatron's and torch's own loops what Megatron's order needs (default_budget_bytes)."""
        _name, split, mode = parse_schedule(schedule)
        if executor_of(schedule) != "dpp":
            return default_budget_bytes(graph, rank)
        return budget_bytes_for(budget_value(mode), graph_of[(split, placement_of(schedule))], rank)

    # Per phase, the measured cost of each DPP-runtime task beyond its requested sleep (ms), and the
    # DPP runtime's setup before the first task (agreeing on sizes, building the schedule).
    overheads: Dict[int, List[float]] = {int(Phase.F): [], int(Phase.B): [], int(Phase.W): []}
    setups: List[float] = []
    runs = {}
    for schedule in schedules:
        fb = None
        if schedule.startswith("torch:"):
            run = _torch_pipelining_runner(schedule, scenario, model, sizes)
        else:
            fb = _build_runner(schedule, scenario, model, transport, stash)

            def run(fb=fb):
                iterators = [iter(scenario.items()) if (rank == 0 and c == 0) else None
                             for c in range(V)]
                fb(forward_step_func=forward_step,
                   data_iterator=iterators if V > 1 else iterators[0],
                   model=model if V > 1 else model[0],
                   num_microbatches=M, seq_length=scenario.max_tokens, micro_batch_size=1,
                   forward_only=False)
        runs[schedule] = (run, fb)
    times = {schedule: [] for schedule in schedules}
    peaks = {schedule: [] for schedule in schedules}
    rank_peaks = {schedule: [0] * P for schedule in schedules}  # per rank, over the repeats
    over_budget = {schedule: False for schedule in schedules}  # any rank above its budget
    timelines = {schedule: [] for schedule in schedules}
    # Rounds: every schedule runs once per round, so a burst of load from other jobs (seconds long)
    # falls on one repeat of several schedules, not on consecutive repeats of one.
    for repeat in range(warmup + repeats):
        for schedule in schedules:
            run, fb = runs[schedule]
            meter.reset()
            dist.barrier()
            start = time.perf_counter()
            run()
            measured = torch.tensor([time.perf_counter() - start, float(meter.peak),
                                     float(meter.peak > row_budget(schedule))], dtype=torch.float64)
            dist.all_reduce(measured, op=dist.ReduceOp.MAX)
            per_rank = torch.zeros(P, dtype=torch.float64)
            per_rank[rank] = float(meter.peak)
            dist.all_reduce(per_rank, op=dist.ReduceOp.SUM)
            if repeat < warmup:
                continue
            times[schedule].append(measured[0].item() * 1e3)
            peaks[schedule].append(int(measured[1].item()))
            rank_peaks[schedule] = [max(a, int(b)) for a, b in zip(rank_peaks[schedule],
                                                                  per_rank.tolist())]
            over_budget[schedule] |= measured[2].item() > 0
            record = getattr(fb, "last_record", None)
            if record is not None:
                split = parse_schedule(schedule)[1]
                for ran in record.ran:
                    task = ran.task
                    requested = model[task.chunk].seconds(task.phase, task.microbatch, split)
                    overheads[int(task.phase)].append((ran.turn_seconds - requested) * 1e3)
                if rank == 0:
                    setups.append((record.ran[0].started - start) * 1e3)
                if trace:
                    timelines[schedule].append(_gather_timeline(record, start, P))
    # Each row's budget on the fullest rank (the table's column), from every rank's own.
    budgets = [None] * P
    dist.all_gather_object(budgets, {schedule: row_budget(schedule) for schedule in schedules})
    rows = []
    if rank == 0:
        for schedule in schedules:
            rows.append({
                "scenario": scenario.name, "P": P, "V": V, "M": M, "schedule": schedule,
                "executor": executor_of(schedule), "time": statistics.median(times[schedule]),
                "split_backward": parse_schedule(schedule)[1],
                "placement": placement_of(schedule),
                "peak_activation": max(peaks[schedule]),
                "peak_activation_per_rank": rank_peaks[schedule],
                "budget": max(per_rank[schedule] for per_rank in budgets),
                "within_budget": not over_budget[schedule],
                "megatron_budget": max(default_budget_bytes(graph, r) for r in range(P)),
                "times": times[schedule],
            })
            if timelines[schedule]:
                rows[-1]["timelines"] = timelines[schedule]
    # Late wake-ups from sleep, over every schedule of this scenario (all executors pay them).
    oversleep = {int(phase): [x for stage in model for x in stage.oversleep_ms[phase]]
                 for phase in (Phase.F, Phase.B, Phase.W)}
    gathered = [None] * P
    dist.all_gather_object(gathered, (overheads, oversleep))
    if rank != 0:
        return []

    def pooled_median(which: int, phase: Phase) -> float:
        return statistics.median([x for per_rank in gathered for x in per_rank[which][int(phase)]] or [0.0])

    # Pooled over every rank, task and DPP-runtime schedule of this scenario: one calibration that
    # predicts every row, rather than one fitted to each row's own time.
    # The model has one overhead for B and W alike: B's (W tasks run the stored work only).
    forward_ms, backward_ms = pooled_median(0, Phase.F), pooled_median(0, Phase.B)
    weight_grad_ms = pooled_median(0, Phase.W)
    setup_ms = max(0.0, statistics.median(setups)) if setups else 0.0
    oversleep_ms = {"forward": pooled_median(1, Phase.F), "backward": pooled_median(1, Phase.B),
                    "weight_grad": pooled_median(1, Phase.W)}
    calibrated = scenario.duration_model(max(0.0, forward_ms), max(0.0, backward_ms))
    for row in rows:
        name, split, budget = parse_schedule(row["schedule"])
        row_graph = graph_of[(split, placement_of(row["schedule"]))]
        sim_name = {"torch:Schedule1F1B": "1f1b",
                    "torch:ScheduleInterleaved1F1B": "interleaved-1f1b"}.get(name, name)
        # Megatron's interleaved loop receives a forward's and a backward's inputs together: the
        # simulator runs its order with that pairing (PairedReceiveScheduler) to predict that loop.
        sim_schedule = (paired_receive_factory(sim_name) if row["executor"] == "megatron" and V > 1
                        else sim_name)
        options = {"budget_bytes": budget_value(budget)} if isinstance(sim_schedule, str) else {}
        plain = simulate(row_graph, sim_schedule, scenario.duration_model(), CommModel(),
                         seed=scenario.seed, **options)
        with_overhead = simulate(row_graph, sim_schedule, calibrated, CommModel(),
                                 seed=scenario.seed, **options)
        row.update({
            # The simulator starts at the first task; the runtime's setup comes before it.
            "predicted_time": setup_ms + with_overhead.makespan,
            "predicted_time_no_overhead": plain.makespan,
            "task_overhead_ms": {"forward": forward_ms, "backward": backward_ms,
                                 "weight_grad": weight_grad_ms},
            "setup_ms": setup_ms,
            "oversleep_ms": oversleep_ms,
            "lower_bound": plain.lower_bound,
            "pipeline_bound": plain.pipeline_bound,
        })
        if "timelines" in row:
            row["simulated_timeline"] = simulated_timeline(with_overhead, P)
            row["replayed_times"] = [setup_ms + replay_executed_order(row_graph, timeline, calibrated,
                                                                      scenario.seed)
                                     for timeline in row["timelines"]]
    return rows


def replay_executed_order(graph, timeline: List[List[list]], duration_model, seed: int) -> float:
    """The simulator's makespan when every rank runs the task order it executed in `timeline` (a
    _gather_timeline result) with the modelled durations: what the executed order costs, apart
    from the timing noise of the run itself."""
    from megatron_dpp.pipeline import Phase, Task
    from megatron_dpp.pipeline.budget import default_budget_bytes
    from megatron_dpp.pipeline.scheduler import StaticOrderScheduler
    from megatron_dpp.sim import CommModel, simulate

    orders = [[Task(Phase(phase), m, c) for phase, m, c, _begin, _end in tasks] for tasks in timeline]

    def executed(g, rank):
        return StaticOrderScheduler("executed", g, rank, default_budget_bytes(g, rank), list(range(g.M)),
                                    orders[rank])

    return simulate(graph, executed, duration_model, CommModel(), seed=seed).makespan


def paired_receive_factory(name: str):
    """Scheduler factory for the simulator: static order `name` run as Megatron's interleaved loop runs it."""
    from megatron_dpp.pipeline import make_scheduler
    from megatron_dpp.pipeline.scheduler import PairedReceiveScheduler

    def factory(graph, rank: int):
        return PairedReceiveScheduler(make_scheduler(name, graph, rank))
    factory.__name__ = name
    return factory


def executor_of(schedule: str) -> str:
    """Who runs the schedule: Megatron's own loop, torch.distributed.pipelining, or our runtime."""
    if schedule in ("1f1b", "interleaved-1f1b"):
        return "megatron"
    return "torch" if schedule.startswith("torch:") else "dpp"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_scenarios(scenarios: List[Scenario], schedules_of: Dict[str, List[str]], warmup: int,
                  repeats: int, timeout_s: float, trace: bool = False, pin: bool = True) -> List[dict]:
    """Start P processes (pinned to cores unless `pin` is False), run every scenario's
    schedules, return rank 0's rows; raise on failure."""
    return run_pipeline_ranks(_worker, (scenarios, schedules_of, warmup, repeats, trace, pin),
                              scenarios[0].P, timeout_s, "schedule_bench")


def run_pipeline_ranks(worker, worker_args: tuple, P: int, timeout_s: float, name: str):
    """Start P spawned processes worker(rank, *worker_args, port, queue) and return what rank 0
    puts on the queue as ("ok", payload); raise RuntimeError ("<name> failed: ...") on ("error",
    text) or no result in timeout_s (ranks left are killed)."""
    import multiprocessing as mp

    context = mp.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    processes = [context.Process(target=worker, args=(rank, *worker_args, port, queue), daemon=True)
                 for rank in range(P)]
    for process in processes:
        process.start()
    status, payload = "error", "interrupted"
    try:
        status, payload = queue.get(timeout=timeout_s)
    except Exception:
        status, payload = "error", f"no result within {timeout_s:.0f} s"
    finally:
        # After a failure the other ranks may wait on the failed one: do not wait for them.
        for process in processes:
            process.join(timeout=10 if status == "ok" else 0.1)
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
    if status != "ok":
        raise RuntimeError(f"{name} failed: {payload}")
    return payload


def schedule_fits(label: str, V: int) -> bool:
    """Whether a row's schedule runs at V model chunks per rank: Megatron's 1F1B and torch's
    Schedule1F1B at V=1 (split or not), the interleaved ones at V > 1, the v placement at V=2;
    the rest anywhere."""
    from megatron_dpp.pipeline.placement import V_SHAPE

    if placement_of(label) == V_SHAPE:
        return V == 2
    name = parse_schedule(label)[0]
    if name in ("1f1b", "torch:Schedule1F1B"):
        return V == 1
    if name in ("interleaved-1f1b", "torch:ScheduleInterleaved1F1B"):
        return V > 1
    return True


def chunk_counts_for(scenario: str, requested: List[int]) -> List[int]:
    """The V a scenario runs at: the requested ones; for a packed scenario V=1 (its reference,
    Megatron's 1F1B) and V=2 if requested (the v placement), no other."""
    if scenario in PACKED_SCENARIOS:
        return [1] + ([2] if 2 in requested else [])
    return list(requested)


def schedules_for(V: int, include_torch: bool, scenario: str) -> List[str]:
    if scenario in PACKED_SCENARIOS:
        return list(PACKED_SCHEDULES if V == 1 else PACKED_V_SCHEDULES)
    megatron = "1f1b" if V == 1 else "interleaved-1f1b"
    from megatron_dpp.pipeline import DYNAMIC_SCHEDULES

    names = [megatron, "1f1b-sorted", *DYNAMIC_SCHEDULES, *SPLIT_SCHEDULES]
    if V == 2:
        names += V_PLACEMENT_ROWS
    # torch.distributed.pipelining splits one batch tensor into equal microbatches: uniform sizes only.
    if include_torch and scenario != "varlen":
        names.append(TORCH_SCHEDULES[min(V, 2)])
    return names


def target_lines(rows: List[dict], reference: Dict[tuple, float]) -> List[str]:
    """The split-backward targets (best dpp:adaptive+W row within its budget / Megatron's) and
    how many rows the simulator predicted within PREDICTION_TOLERANCE. Reports; does not judge."""
    lines = []
    for (scenario, V), target in SPLIT_TARGETS.items():
        candidates = [row for row in rows if row["scenario"] == scenario and row["V"] == V
                      and row["schedule"] in SPLIT_SCHEDULES and row["within_budget"]]
        ref = reference.get((scenario, candidates[0]["P"], V)) if candidates else None
        if not ref:
            continue
        best = min(candidates, key=lambda row: row["time"])
        lines.append(f"# target {scenario} V={V}: best adaptive+W {best['time'] / ref:.3f} x Megatron "
                     f"({best['schedule']}), target <= {target}")
    lines.extend(v_target_lines(rows, reference))
    errors = [(row["time"] - row["predicted_time"]) / row["predicted_time"] for row in rows]
    within = sum(abs(error) <= PREDICTION_TOLERANCE for error in errors)
    lines.append(f"# simulator prediction within {PREDICTION_TOLERANCE:.0%} of the measurement: "
                 f"{within} of {len(rows)} rows (largest error {max(errors, key=abs):+.1%})")
    return lines


def v_memory_ratio(row: dict, one_f_one_b: dict) -> float:
    """The row's fullest rank against what Megatron's 1F1B (V=1) holds on its first rank, in the
    same unit: a chunk of V per rank holds 1/V of a rank's layers, so its activation is 1/V of a
    V=1 stage's (the scenarios count activation bytes per chunk)."""
    return (row["peak_activation"] / row["V"]) / one_f_one_b["megatron_budget"]


def v_target_lines(rows: List[dict], reference: Dict[tuple, float]) -> List[str]:
    """The zero-bubble target per scenario with v rows: the best v row / Megatron's 1F1B at V=1,
    among rows whose fullest rank holds at most what 1F1B holds on its first rank, beside ZB-V's
    bound. Reports; does not judge."""
    lines = []
    # The packed scenarios' v rows count toward the packed target (packed_lines) instead.
    for scenario in sorted({row["scenario"] for row in rows if row.get("placement") == "v"
                            and row["scenario"] not in PACKED_SCENARIOS}):
        one_f_one_b = [row for row in rows if row["scenario"] == scenario and row["V"] == 1
                       and row["schedule"] == "1f1b"]
        if not one_f_one_b:
            continue
        ref = one_f_one_b[0]
        v_rows = [row for row in rows if row["scenario"] == scenario and row.get("placement") == "v"]
        fitting = [row for row in v_rows if v_memory_ratio(row, ref) <= 1.0 and row["within_budget"]]
        for row in v_rows:
            lines.append(f"# {scenario} {row['schedule']}: {row['time'] / ref['time']:.3f} x Megatron "
                         f"1F1B (V=1), memory {v_memory_ratio(row, ref):.2f} x 1F1B's first rank")
        bounds = [row["predicted_time_no_overhead"] / ref["predicted_time_no_overhead"]
                  for row in v_rows if row["schedule"] == ZBV_BOUND_ROW]
        bound = f"; ZB-V's zero-overhead bound {bounds[0]:.3f}" if bounds else ""
        if fitting:
            best = min(fitting, key=lambda row: row["time"])
            lines.append(f"# target {scenario} v placement: best {best['time'] / ref['time']:.3f} x "
                         f"Megatron 1F1B ({best['schedule']}), target <= {V_TARGET}{bound}")
    return lines


def packed_lines(rows: List[dict]) -> List[str]:
    """Packed scenarios: each row against Megatron's 1F1B (measured, and the simulator's figure
    with its bound), its peak per rank against 1F1B's fullest rank, and the issue's target line
    (PACKED_TARGET). Reports; does not judge."""
    lines = []
    scenario, target_P, target_M, target, memory = PACKED_TARGET
    for key in sorted({(row["scenario"], row["P"], row["M"]) for row in rows
                       if row["scenario"] in PACKED_SCENARIOS}):
        group = [row for row in rows if (row["scenario"], row["P"], row["M"]) == key]
        reference = [row for row in group if row["schedule"] == "1f1b"]
        if not reference:
            continue
        ref = reference[0]
        fullest = ref["megatron_budget"]  # 1F1B's fullest rank: P full windows
        for row in group:
            spread = [t / ref["time"] for t in row["times"]]
            # A chunk holds 1/V of a rank's layers: its activation is 1/V of the counted bytes
            # (as v_memory_ratio says).
            memory_ratios = [peak / row["V"] / fullest for peak in row["peak_activation_per_rank"]]
            row["memory_vs_1f1b_fullest"] = memory_ratios
            # Interleaved rows at V > 1 say so; the v rows' label already does.
            label = row["schedule"] + (f" V={row['V']}" if row["V"] > 1
                                       and placement_of(row["schedule"]) != "v" else "")
            lines.append(
                f"# {key[0]} P={key[1]} M={key[2]} {label:<28} measured "
                f"{row['time'] / ref['time']:.3f} x 1F1B (repeats {min(spread):.3f}-{max(spread):.3f}), "
                f"simulator {row['predicted_time_no_overhead'] / ref['predicted_time_no_overhead']:.3f}, "
                f"bound {row['pipeline_bound'] / ref['predicted_time_no_overhead']:.3f}; memory per "
                f"rank x 1F1B's fullest: {' '.join(f'{r:.2f}' for r in memory_ratios)}")
        if key == (scenario, target_P, target_M):
            fitting = [row for row in group if row["executor"] == "dpp"
                       and row["schedule"].startswith("dpp:")
                       and max(row["memory_vs_1f1b_fullest"]) <= memory]
            if fitting:
                best = min(fitting, key=lambda row: row["time"])
                where = best["schedule"] + (f", V={best['V']}" if best["V"] > 1
                                            and placement_of(best["schedule"]) != "v" else "")
                lines.append(f"# target {scenario} P={target_P} M={target_M}: best DPP "
                             f"{best['time'] / ref['time']:.3f} x Megatron 1F1B ({where}), "
                             f"every rank within {memory} x 1F1B's fullest; target <= {target}")
    return lines


def format_table(rows: List[dict]) -> str:
    """pred0/err0: the simulator on the sampled durations alone; pred/err: plus the measured
    per-task overhead and setup of the DPP runtime (task_overhead_ms, setup_ms: the same for every
    row of a scenario). Then each row's repeats, and for traced rows what each repeat's executed
    order costs when the simulator replays it."""
    header = (f"{'scenario':<10} {'P':>2} {'V':>2} {'M':>3} {'schedule':<30} {'exec':<8} {'time ms':>9} "
              f"{'pred0 ms':>9} {'err0':>6} {'pred ms':>9} {'err':>6} {'/LB':>6} {'/megatron':>9} "
              f"{'peak act':>10} {'budget':>10}")
    # budget: the row's own (the DPP policy's; Megatron's need for the fixed loops), on the fullest
    # rank; '!' marks a row where some rank held more than its own budget.
    lines = [header, "-" * len(header)]
    reference: Dict[tuple, float] = {}
    for row in rows:
        if row["schedule"] in ("1f1b", "interleaved-1f1b"):
            reference[(row["scenario"], row["P"], row["V"])] = row["time"]
    for row in rows:
        ref = reference.get((row["scenario"], row["P"], row["V"]))
        ratio = f"{row['time'] / ref:9.3f}" if ref else f"{'-':>9}"
        error = (row["time"] - row["predicted_time"]) / row["predicted_time"]
        plain = row["predicted_time_no_overhead"]
        lines.append(
            f"{row['scenario']:<10} {row['P']:>2} {row['V']:>2} {row['M']:>3} {row['schedule']:<30} "
            f"{row['executor']:<8} {row['time']:9.1f} {plain:9.1f} {(row['time'] - plain) / plain:+6.1%} "
            f"{row['predicted_time']:9.1f} {error:+6.1%} "
            f"{row['time'] / row['lower_bound']:6.3f} {ratio} {row['peak_activation']:>10} "
            f"{row['budget']:>10}{'' if row['within_budget'] else ' !'}")
    overheads = {(row["scenario"], row["V"]): (row["task_overhead_ms"], row["oversleep_ms"], row["setup_ms"])
                 for row in rows}
    for (scenario, V), (cost, late, setup) in overheads.items():
        lines.append(f"# {scenario} V={V}: DPP runtime per-task overhead (median, all ranks) "
                     f"forward {cost['forward']:.2f} ms, backward {cost['backward']:.2f} ms, "
                     f"W {cost['weight_grad']:.2f} ms; of which sleeps ending late: forward "
                     f"{late['forward']:.2f} ms, backward {late['backward']:.2f} ms, W "
                     f"{late['weight_grad']:.2f} ms; setup before the first task {setup:.1f} ms")
    lines.extend(target_lines(rows, reference))
    lines.extend(packed_lines(rows))
    for row in rows:
        repeats = " ".join(f"{t:.0f}" for t in row["times"])
        lines.append(f"# {row['scenario']} V={row['V']} {row['schedule']}: repeats {repeats} ms")
        if "replayed_times" in row:
            replayed = " ".join(f"{t:.0f}" for t in row["replayed_times"])
            lines.append(f"#   executed orders replayed by the simulator: {replayed} ms "
                         f"(the simulator's own order: {row['predicted_time']:.0f} ms)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# the real tiny GPT: DPP vs Megatron's 1F1B with variable-length data
# ------------------------------------------------------------------------------------------------
_ELAPSED = "elapsed time per iteration (ms): "


def gpt_comparison(args) -> List[dict]:
    """Train the tiny GPT at pp=2 on variable-length samples under Megatron's 1F1B and under --use-dpp
    (both over shm_tensor); median time per iteration after the first --gpt-skip iterations."""
    import subprocess

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sample = os.path.join(repo, "data", "sample")
    if not os.path.isfile(os.path.join(sample, "sample_text_document.idx")):
        subprocess.run([sys.executable, "-m", "megatron_dpp.data.prepare_sample", "--output-dir", sample],
                       check=True, cwd=repo, timeout=600)
    base = ["--data-path", os.path.join(sample, "sample_text_document"),
            "--vocab-file", os.path.join(sample, "vocab.json"),
            "--merge-file", os.path.join(sample, "merges.txt"), "--split", "98,2,0",
            "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", str(args.gpt_seq_length), "--max-position-embeddings", str(args.gpt_seq_length),
            "--micro-batch-size", "1", "--global-batch-size", str(args.gpt_microbatches),
            "--train-iters", str(args.gpt_iters), "--lr", "1e-3", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--log-interval", "1", "--eval-iters", "0",
            "--pipeline-model-parallel-size", "2", "--variable-seq-lengths", "--p2p-transport", "shm"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    variants = [("megatron 1f1b", [])] + [(policy, ["--use-dpp", "--dpp-policy", policy])
                                          for policy in args.gpt_policies]
    measured: Dict[str, List[float]] = {label: [] for label, _ in variants}
    round_medians: Dict[str, List[float]] = {label: [] for label, _ in variants}
    # Rounds alternate the variants, so load from other jobs hits them alike.
    for _round in range(args.gpt_rounds):
        for label, extra in variants:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc-per-node=2", "-m", "megatron_dpp.pretrain_gpt", *base, *extra]
            result = subprocess.run(command, capture_output=True, text=True, cwd=repo, env=env,
                                    timeout=args.timeout)
            if result.returncode != 0:
                raise RuntimeError(f"GPT run {label} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
            times = [float(line.split(_ELAPSED, 1)[1].split()[0]) for line in result.stdout.splitlines()
                     if _ELAPSED in line]
            measured[label].extend(times[args.gpt_skip:])
            round_medians[label].append(statistics.median(times[args.gpt_skip:]))
    reference = round_medians[variants[0][0]]
    rows = []
    for label, times in measured.items():
        # Per round, the ratio to Megatron's run of the same round: the spread of the comparison.
        ratios = [mine / theirs for mine, theirs in zip(round_medians[label], reference)]
        quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
        rows.append({"schedule": label, "iterations": len(times), "time": statistics.median(times),
                     "time_q1": quartiles[0], "time_q3": quartiles[2],
                     "round_medians": round_medians[label], "round_ratios": ratios, "times": times})
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline-size", "-P", type=int, default=4)
    parser.add_argument("--virtual-stages", "-V", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--microbatches", "-M", type=int, default=16)
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS),
                        choices=(*SCENARIOS, *PACKED_SCENARIOS),
                        help="packed8k and packed32k (packed long-context windows) run at V=1, "
                             "and with -V 2 also on the v placement.")
    parser.add_argument("--schedules", nargs="+", default=None,
                        help="Subset of schedules (default: Megatron's, 1f1b-sorted, every DPP policy, "
                             "torch pipelining where it fits)")
    parser.add_argument("--mean-tokens", type=int, default=64, help="Mean microbatch size in tokens.")
    parser.add_argument("--forward-ms", type=float, default=20.0,
                        help="Mean forward time of one microbatch on one rank (backward: 2x).")
    parser.add_argument("--cv", type=float, default=0.5, help="Size coefficient of variation (varlen).")
    parser.add_argument("--straggler-prob", type=float, default=0.1,
                        help="Probability that a task is slowed down (straggler scenario).")
    parser.add_argument("--straggler-factor", type=float, default=3.0)
    parser.add_argument("--bytes-per-token", type=int, default=4096,
                        help="Activation bytes one token holds on one chunk.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=1)
    # Five: a median of five repeats stays put when two of them catch a burst of load from other
    # jobs, which on shared cores adds 5-70% to single repeats of any schedule.
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="Do not pin rank r to core r mod cores (the default pins, so that "
                             "neighbouring ranks run on different cores and none migrates).")
    parser.add_argument("--no-torch-pipelining", action="store_true",
                        help="Skip torch.distributed.pipelining's schedules.")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="Seconds the whole run may take before its processes are killed.")
    parser.add_argument("--quick", action="store_true",
                        help="Small smoke run: P=4, V=1 and 2, M=8, 5 ms forwards, 1 repeat, no warmup.")
    parser.add_argument("--json", type=str, default=None, help="Write {'results': [...]} here.")
    parser.add_argument("--trace", action="store_true",
                        help="For each DPP-runtime row, keep every repeat's executed tasks per rank with start "
                             "and end times ('timelines' in --json, beside the simulator's "
                             "'simulated_timeline') and print the simulator's time for each executed order.")
    parser.add_argument("--gpt", action="store_true",
                        help="Also train the tiny GPT (pp=2, --variable-seq-lengths) under Megatron's 1F1B "
                             "and under --use-dpp and compare their time per iteration.")
    parser.add_argument("--gpt-only", action="store_true", help="Only the tiny-GPT comparison.")
    parser.add_argument("--gpt-policies", nargs="+", default=["dpp:adaptive", "1f1b-sorted"],
                        help="DPP policies the GPT comparison runs beside Megatron's 1F1B.")
    parser.add_argument("--gpt-rounds", type=int, default=3, help="Runs of each variant, alternated.")
    parser.add_argument("--gpt-iters", type=int, default=40)
    parser.add_argument("--gpt-skip", type=int, default=5, help="Warm-up iterations left out.")
    parser.add_argument("--gpt-microbatches", type=int, default=16)
    parser.add_argument("--gpt-seq-length", type=int, default=256)
    args = parser.parse_args(argv)
    if args.quick:
        args.microbatches, args.forward_ms, args.repeats, args.warmup = 8, 5.0, 1, 0
    if args.pipeline_size < 2:
        parser.error("--pipeline-size must be at least 2")
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    for V in args.virtual_stages:
        if V < 1 or (V > 1 and args.microbatches % args.pipeline_size):
            parser.error(f"V={V}: need V >= 1, and M a multiple of P for interleaving")
    if args.schedules:
        chunk_counts = {V for name in args.scenarios
                        for V in chunk_counts_for(name, args.virtual_stages)}
        unfit = [label for label in args.schedules
                 if not any(schedule_fits(label, V) for V in chunk_counts)]
        if unfit:
            parser.error(f"--schedules {' '.join(unfit)}: fit none of the runs' chunk counts "
                         f"(-V {' '.join(map(str, sorted(chunk_counts)))}; the v placement needs "
                         f"-V 2, Megatron's interleaved schedule V > 1, its 1f1b V=1)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    scenarios, schedules_of = [], {}
    for name in args.scenarios:
        for V in chunk_counts_for(name, args.virtual_stages):
            scenario = Scenario(name=name, P=args.pipeline_size, V=V, M=args.microbatches,
                                mean_tokens=args.mean_tokens, forward_ms=args.forward_ms, cv=args.cv,
                                straggler_prob=args.straggler_prob,
                                straggler_factor=args.straggler_factor,
                                bytes_per_token=args.bytes_per_token, seed=args.seed)
            scenarios.append(scenario)
            if args.schedules:
                # Each V runs the listed schedules that fit it (the v rows at V=2 only, ...).
                schedules_of[scenario.key] = [label for label in args.schedules
                                              if schedule_fits(label, V)]
            else:
                schedules_of[scenario.key] = schedules_for(V, not args.no_torch_pipelining, name)
    started = time.time()
    report = {"results": []}
    if not args.gpt_only:
        report["results"] = run_scenarios(scenarios, schedules_of, args.warmup, args.repeats, args.timeout,
                                          args.trace, args.pin)
        print(format_table(report["results"]))
        print(f"# {len(report['results'])} rows in {time.time() - started:.1f} s")
    if args.gpt or args.gpt_only:
        report["gpt_varlen_pp2"] = gpt_comparison(args)
        reference = report["gpt_varlen_pp2"][0]["time"]
        for row in report["gpt_varlen_pp2"]:
            ratios = row["round_ratios"]
            print(f"tiny GPT pp=2 varlen  {row['schedule']:<14} {row['time']:8.1f} ms/iteration "
                  f"(median of {row['iterations']}, quartiles {row['time_q1']:.1f}-{row['time_q3']:.1f})  "
                  f"x{row['time'] / reference:.3f}  per-round ratios {min(ratios):.3f}-{max(ratios):.3f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
