"""The DPP runtime's own cost per task: the real IterationRunner over shm_tensor, zero-work stages.

P ranks (processes) run global batches of M microbatches through `forward_backward_dpp`, with
benchmarks/timed_stage.py's stages asked to hold each task for 0 ms, so what is left of a task is
what the runtime and Megatron-Core's step wrappers cost. For every task the runtime records the wall
time of its loop turn (harvest arrivals, reap sends, decide, publish, run, post the output) and the
span of its step (Megatron-Core's forward_step/backward_step or the W handler). Per task:

- runtime: the turn minus the step (decision + bookkeeping + transport calls): the issue's target,
  at most 50 us on this machine;
- step: Megatron-Core's forward_step/backward_step (and autograd) around a stage that does nothing:
  every schedule, Megatron's own included, pays it;
- per task, wall: the busiest rank's iteration time divided by its task count (includes the waits of
  pipeline fill and drain, which with zero-work stages are message hops).

Waiting turns (nothing ready, the rank blocks on a message) are not a task's cost: they are bubble.

    python benchmarks/runtime_overhead.py                 # P=2, M=32, 30 repeats
    python benchmarks/runtime_overhead.py -P 4 --json runs/runtime_overhead.json
    python benchmarks/runtime_overhead.py --quick
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import traceback
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DEFAULT_SCHEDULES = ("dpp:adaptive", "dpp:adaptive+W", "1f1b-sorted")
TARGET_US = 50.0  # the bound on the runtime's own cost per task


def _scenario(args):
    from schedule_bench import Scenario

    # forward_ms 0: every task's requested hold is 0 ms (time.sleep(0)).
    return Scenario(name="uniform", P=args.pipeline_size, V=1, M=args.microbatches,
                    mean_tokens=args.tokens, forward_ms=0.0, cv=0.0, straggler_prob=0.0,
                    straggler_factor=1.0, bytes_per_token=args.bytes_per_token, seed=0)


def _worker(rank: int, args, port: int, results) -> None:
    try:
        import time

        import numpy as np
        import torch
        import torch.distributed as dist

        from schedule_bench import _build_runner, end_pipeline_rank, start_pipeline_rank
        from timed_stage import ActivationMeter, TimedStage, TimedStash, data_iterator, \
            forward_step, timed_stage_config

        P = args.pipeline_size
        transport = start_pipeline_rank(rank, P, port, pin=args.pin)
        scenario = _scenario(args)
        graph, split_graph = scenario.graph(), scenario.graph(split_backward=True)
        sizes = [int(s) for s in graph.sizes]
        durations = scenario.duration_model().sample(graph, np.random.default_rng(0))
        split_durations = scenario.duration_model().sample(split_graph, np.random.default_rng(0))
        stash = TimedStash()
        model = TimedStage(timed_stage_config(P, 1), rank, 0, durations, graph.act_bytes,
                           ActivationMeter(), split_durations=split_durations, stash=stash)
        runners = {schedule: _build_runner(schedule, scenario, [model], transport, stash)
                   for schedule in args.schedules}
        runtime_us: Dict[str, List[float]] = {s: [] for s in args.schedules}
        step_us: Dict[str, List[float]] = {s: [] for s in args.schedules}
        wall_per_task_us: Dict[str, List[float]] = {s: [] for s in args.schedules}
        # Rounds: every schedule once per round, so load from other jobs hits all alike.
        for repeat in range(args.warmup + args.repeats):
            for schedule, fb in runners.items():
                dist.barrier()
                start = time.perf_counter()
                fb(forward_step_func=forward_step, data_iterator=data_iterator(sizes) if rank == 0
                   else None, model=model, num_microbatches=scenario.M,
                   seq_length=scenario.max_tokens, micro_batch_size=1, forward_only=False)
                elapsed = time.perf_counter() - start
                record = fb.last_record
                per_task = torch.tensor([elapsed / len(record.tasks)], dtype=torch.float64)
                dist.all_reduce(per_task, op=dist.ReduceOp.MAX)
                if repeat < args.warmup:
                    continue
                for ran in record.ran:
                    step = ran.ended - ran.started
                    step_us[schedule].append(step * 1e6)
                    runtime_us[schedule].append((ran.turn_seconds - step) * 1e6)
                wall_per_task_us[schedule].append(per_task.item() * 1e6)
        gathered = [None] * P
        dist.all_gather_object(gathered, (runtime_us, step_us))
        end_pipeline_rank(transport)
        if rank == 0:
            results.put(("ok", (gathered, wall_per_task_us)))
    except BaseException:  # report any failure to the parent instead of dying silently
        results.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))


def _percentile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(schedules, gathered, wall_per_task_us) -> List[dict]:
    rows = []
    for schedule in schedules:
        runtime = [x for rank_runtime, _ in gathered for x in rank_runtime[schedule]]
        step = [x for _, rank_step in gathered for x in rank_step[schedule]]
        rows.append({
            "schedule": schedule,
            "tasks": len(runtime),
            "runtime_us_median": statistics.median(runtime),
            "runtime_us_mean": statistics.fmean(runtime),
            "runtime_us_p90": _percentile(runtime, 0.9),
            "step_us_median": statistics.median(step),
            "wall_per_task_us_median": statistics.median(wall_per_task_us[schedule]),
            "within_target": statistics.fmean(runtime) <= TARGET_US,
        })
    return rows


def format_table(rows: List[dict], args) -> str:
    lines = [f"# P={args.pipeline_size} M={args.microbatches} V=1, zero-work stages over shm_tensor, "
             f"{args.repeats} repeats after {args.warmup} warm-up; us per task, pooled over ranks",
             f"{'schedule':<18} {'tasks':>6} {'runtime med':>12} {'mean':>8} {'p90':>8} "
             f"{'step med':>9} {'wall/task':>10}"]
    for row in rows:
        lines.append(f"{row['schedule']:<18} {row['tasks']:>6} {row['runtime_us_median']:>12.1f} "
                     f"{row['runtime_us_mean']:>8.1f} {row['runtime_us_p90']:>8.1f} "
                     f"{row['step_us_median']:>9.1f} {row['wall_per_task_us_median']:>10.1f}")
    worst = max(rows, key=lambda row: row["runtime_us_mean"])
    lines.append(f"# target: the runtime's own cost per task (mean) <= {TARGET_US:g} us; worst "
                 f"{worst['runtime_us_mean']:.1f} us ({worst['schedule']})")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline-size", "-P", type=int, default=2, help="Ranks (processes).")
    parser.add_argument("--microbatches", "-M", type=int, default=32, help="Microbatches per batch.")
    parser.add_argument("--schedules", nargs="+", default=list(DEFAULT_SCHEDULES),
                        help="DPP policies (a '+W' suffix splits backwards).")
    parser.add_argument("--tokens", type=int, default=64, help="Tokens per microbatch.")
    parser.add_argument("--bytes-per-token", type=int, default=64,
                        help="Activation bytes per token (the message is tokens x 1 x 16 floats "
                             "whatever this says; it only feeds the memory budget).")
    parser.add_argument("--warmup", type=int, default=3, help="Batches per schedule left out.")
    parser.add_argument("--repeats", type=int, default=30, help="Measured batches per schedule.")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="Do not pin rank r to core r mod cores.")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="Seconds the whole run may take before its processes are killed.")
    parser.add_argument("--quick", action="store_true",
                        help="Smoke run: M=8, 2 repeats, 1 warm-up.")
    parser.add_argument("--json", type=str, default=None, help="Write {'results': [...]} here.")
    args = parser.parse_args(argv)
    if args.quick:
        args.microbatches, args.repeats, args.warmup = 8, 2, 1
    if args.pipeline_size < 2 or args.microbatches < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error("need --pipeline-size >= 2, --microbatches >= 1, --repeats >= 1, --warmup >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from schedule_bench import run_pipeline_ranks

    try:
        payload = run_pipeline_ranks(_worker, (args,), args.pipeline_size, args.timeout,
                                     "runtime_overhead")
    except RuntimeError as error:
        print(f"runtime_overhead: {error}", file=sys.stderr)
        return 1
    rows = summarize(args.schedules, *payload)
    print(format_table(rows, args))
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"config": vars(args), "results": rows}, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
