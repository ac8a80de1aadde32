"""What one task's step costs when tasks come back to back and when they come after a pause.

Megatron-Core's forward_step and backward_step, with autograd, on a timed stage asked to hold 0 ms
(benchmarks/timed_stage.py), in one process: first back to back, then with a sleep of `--pause`
seconds before every step, as a pipeline rank's steps come between the waits for its timed work.
On this project's 2-core VM the same step costs four to five times more after a 10 ms pause than
back to back: the per-task cost the timed-stage benchmark measures (schedule_bench.py's overhead
line) is mostly this, and a schedule with more tasks per microbatch pays it more often.

    python benchmarks/cold_step.py --json runs/cold_step.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TOKENS = 512  # rows of the carried activation (timed_stage.HIDDEN wide)
ACT_BYTES = 262144  # what the stage's forward allocates and keeps to its backward


def _zero_durations(_rank, _task) -> float:
    return 0.0


def measure(pauses, steps: int) -> list:
    """Median forward-step and backward-step time (µs) for each pause before a step (s)."""
    import torch

    from timed_stage import ActivationMeter, TimedStage, forward_step as stage_forward_step
    from timed_stage import precise_sleeps, timed_stage_config

    from megatron_dpp.mcore.schedules import backward_step, forward_step

    torch.set_num_threads(1)
    precise_sleeps()
    config = timed_stage_config(2, 1)
    stage = TimedStage(config, 1, 0, _zero_durations, [ACT_BYTES] * steps, ActivationMeter())

    def forward(m):
        input_tensor = torch.zeros(TOKENS, 1, 4)
        input_tensor[0, 0, 0] = float(m)
        input_tensor.requires_grad_(True)
        output, _tokens = forward_step(
            stage_forward_step, None, stage, 1, input_tensor, [], config, cp_group_size=1,
            collect_non_loss_data=False, checkpoint_activations_microbatch=None,
            is_first_microbatch=False, current_microbatch=m, vp_stage=None, is_last_stage=False)
        return input_tensor, output

    rows = []
    for pause in pauses:
        forward_us, backward_us = [], []
        for m in range(steps):
            if pause:
                time.sleep(pause)
            start = time.perf_counter()
            input_tensor, output = forward(m)
            forward_us.append((time.perf_counter() - start) * 1e6)
            if pause:
                time.sleep(pause)
            start = time.perf_counter()
            backward_step(input_tensor, output, torch.ones_like(output), stage.model_type, config)
            backward_us.append((time.perf_counter() - start) * 1e6)
        rows.append({"pause_s": pause, "steps": steps,
                     "forward_us_median": statistics.median(forward_us),
                     "backward_us_median": statistics.median(backward_us)})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pause", type=float, nargs="+", default=[0.0, 0.001, 0.01],
                        help="Seconds of sleep before each step, one measurement each "
                             "(0: back to back).")
    parser.add_argument("--steps", type=int, default=300, help="Forward-backward pairs per pause.")
    parser.add_argument("--json", help="Write {'results': [...]} here.")
    args = parser.parse_args(argv)
    if args.steps < 1 or any(pause < 0 for pause in args.pause):
        parser.error("--steps must be >= 1 and every --pause >= 0")
    rows = measure(args.pause, args.steps)
    print("Megatron-Core forward_step / backward_step on a 0 ms timed stage, median of "
          f"{args.steps} (each includes the stage's sleep(0))")
    for row in rows:
        print(f"  pause {row['pause_s'] * 1e3:6.1f} ms before each step: forward "
              f"{row['forward_us_median']:6.0f} us, backward {row['backward_us_median']:6.0f} us")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"results": rows}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
