"""Where the time of shm_tensor's isend goes: two processes exchange the tiny GPT's pipeline messages
(micro-batch 2 x seq 64..256 x hidden 128, float32: 64-256 KiB) in the order of Megatron's 1F1B
(each receive posted and waited for alone) or of the DPP runtime (every receive posted up front and
waited for with wait_any, forwards run ahead within a budget of 4, the last stage holding each
received activation until its backward), with CPU work standing in for the forward and backward
steps (the last stage about twice the first's, as in the real model). It reports, per isend, the
wall time and whether the thread was preempted inside it (an involuntary context switch), and the
transport's own account (Context.post_stats()).

    python tests/_shm_posting.py                 # both orders, 1 shared CPU and 1 CPU each,
                                                 # batch_while_sleeping off and on
    python tests/_shm_posting.py --iterations 6 --cpus shared --batch off

`--cpus shared` pins both processes to CPU 0: the oversubscribed case (more runnable threads than
cores) made deterministic, which is what a 2-core machine shared with other jobs is most of the
time. `--cpus own` gives each its own CPU (meaningful only on an otherwise idle machine).
tests/test_shm_posting.py uses `posting_round`.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shm_tensor  # noqa: E402
from shm_tensor import ShmConfig  # noqa: E402
from _shm_util import run_ranks  # noqa: E402

HIDDEN, MICRO_BATCH = 128, 2  # examples/gpt3/gpt3_tiny.sh
SEQS = (64, 256, 128, 192, 96, 256, 160, 224)  # tokens per sequence of microbatch m (variable lengths)
# CPU milliseconds of a step at 256 tokens: (first stage F, B), (last stage F with the loss, B); the
# medians of the traced tiny GPT at 256 tokens (docs/results/2026-12-02-scheduling-measurements.md)
# are about 10/14 and 21/22 ms.
WORK_MS = {0: (10.0, 14.0), 1: (21.0, 22.0)}
BUDGET = 4  # forwards the DPP order runs ahead on the first stage


def cpu_work(ms: float) -> None:
    """Busy for `ms` of this thread's CPU time (longer in wall time when the CPU is shared)."""
    end = time.thread_time() + ms / 1e3
    while time.thread_time() < end:
        pass


def _step_ms(rank: int, backward: bool, seq: int, scale: float) -> float:
    return scale * WORK_MS[rank][int(backward)] * (0.4 + 0.6 * seq / 256)


class _Poster:
    """isend with the caller's view: wall time and involuntary context switches inside the call."""

    def __init__(self, ctx):
        self.ctx, self.walls, self.preempted = ctx, [], 0
        self.handles = []

    def send(self, tensor, peer, tag):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw
        start = time.perf_counter()
        self.handles.append(self.ctx.isend(tensor, peer, tag))
        self.walls.append(time.perf_counter() - start)
        self.preempted += resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw > before

    def reap(self):
        self.handles = [h for h in self.handles if not h.test()]

    def drain(self):
        for handle in self.handles:
            handle.wait(timeout=60)
        self.handles = []


def _tensor(m: int, grad: bool) -> torch.Tensor:
    return torch.full((SEQS[m % len(SEQS)], MICRO_BATCH, HIDDEN), float(m) + (0.5 if grad else 0.0))


def _tag(iteration: int, m: int, grad: bool) -> int:
    return (iteration * 1000 + m) * 2 + int(grad)


def _wait(ctx, handle, waits):
    start = time.perf_counter()
    tensor = handle.wait(timeout=60)
    waits.append(time.perf_counter() - start)
    return tensor


def _iteration_1f1b(rank, ctx, poster, it, M, waits, scale):
    """Megatron's 1F1B at pp=2: rank 0 F0, then (F m+1, send, wait grad m, B m), then B M-1."""
    peer = 1 - rank
    if rank == 0:
        cpu_work(_step_ms(0, False, SEQS[0], scale))
        poster.send(_tensor(0, False), peer, _tag(it, 0, False))
        for m in range(M):
            if m + 1 < M:
                cpu_work(_step_ms(0, False, SEQS[(m + 1) % len(SEQS)], scale))
                poster.send(_tensor(m + 1, False), peer, _tag(it, m + 1, False))
            grad = _wait(ctx, ctx.irecv(peer, _tag(it, m, True)), waits)
            assert grad.shape[0] == SEQS[m % len(SEQS)]
            cpu_work(_step_ms(0, True, SEQS[m % len(SEQS)], scale))
            poster.reap()
    else:
        for m in range(M):
            activation = _wait(ctx, ctx.irecv(peer, _tag(it, m, False)), waits)
            seq = activation.shape[0]
            cpu_work(_step_ms(1, False, seq, scale))
            cpu_work(_step_ms(1, True, seq, scale))
            del activation
            poster.send(_tensor(m, True), peer, _tag(it, m, True))
            poster.reap()


def _iteration_dpp(rank, ctx, poster, it, M, waits, scale):
    """The DPP runtime's pattern: every receive posted up front, wait_any over what is missing, the
    first stage runs forwards ahead (BUDGET in flight), the last stage holds activations."""
    peer = 1 - rank
    pending = {m: ctx.irecv(peer, _tag(it, m, rank == 0)) for m in range(M)}
    arrived, held = {}, {}
    forwards = backwards = 0
    while backwards < M:
        for m, handle in list(pending.items()):
            if handle.test():
                arrived[m] = handle.wait()
                del pending[m]
        poster.reap()
        if rank == 0:
            ready_b = sorted(m for m in arrived if m < forwards)
            if ready_b:
                m = ready_b[0]
                del arrived[m]
                cpu_work(_step_ms(0, True, SEQS[m % len(SEQS)], scale))
                backwards += 1
                continue
            if forwards < M and forwards - backwards < BUDGET:
                m = forwards
                cpu_work(_step_ms(0, False, SEQS[m % len(SEQS)], scale))
                poster.send(_tensor(m, False), peer, _tag(it, m, False))
                forwards += 1
                continue
        else:
            if held:  # the last stage's backward follows its forward
                m = min(held)
                cpu_work(_step_ms(1, True, held[m].shape[0], scale))
                del held[m]
                poster.send(_tensor(m, True), peer, _tag(it, m, True))
                backwards += 1
                continue
            if arrived:
                m = min(arrived)
                held[m] = arrived.pop(m)  # kept until its backward, as an activation is
                cpu_work(_step_ms(1, False, held[m].shape[0], scale))
                continue
        handles = list(pending.values())
        start = time.perf_counter()
        ctx.wait_any(handles, timeout=60)
        waits.append(time.perf_counter() - start)


def posting_worker(rank, world, store, order, cpus, batch, iterations, microbatches, scale):
    if cpus == "shared":
        os.sched_setaffinity(0, {0})
    elif cpus == "own":
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    ctx = shm_tensor.create_context_with_store(
        store, rank=rank, world_size=world, peers=[1 - rank],
        config=ShmConfig(slot_bytes=1 << 20, timeout_s=60, batch_while_sleeping=batch))
    poster, waits = _Poster(ctx), []
    run = _iteration_1f1b if order == "1f1b" else _iteration_dpp
    iteration_s, stats_before = [], ctx.post_stats()
    for it in range(iterations):
        if it == 1:  # the first iteration warms up; counters and times from the second on
            poster.walls, poster.preempted, waits = [], 0, []
            stats_before = ctx.post_stats()
        start = time.perf_counter()
        run(rank, ctx, poster, it, microbatches, waits, scale)
        iteration_s.append(time.perf_counter() - start)
    poster.drain()
    stats = ctx.post_stats()
    stats = {k: v - stats_before[k] for k, v in stats.items()}
    fallback = ctx.batch_sleep_fallback()
    # Both sides finish before either closes (close is collective).
    ctx.isend(torch.zeros(1), 1 - rank, 10**9).wait(timeout=60)
    ctx.irecv(1 - rank, 10**9).wait(timeout=60)
    ctx.close()
    return {"walls": poster.walls, "preempted": poster.preempted, "stats": stats, "waits": waits,
            "iteration_s": iteration_s[1:], "fallback": fallback}


def posting_round(tmp_path, order, cpus, batch, iterations=4, microbatches=8, scale=1.0, background=0):
    """One exchange; `background` processes spin meanwhile ("other jobs"), on CPU 0, 1, ... in turn."""
    spinners = []
    try:
        for index in range(background):  # CPU 0, 1, ... in turn
            cpu = index % os.cpu_count()
            spinners.append(subprocess.Popen(
                [sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"]))
        return run_ranks(posting_worker, 2, tmp_path, order, cpus, batch, iterations, microbatches,
                         scale, timeout_s=240)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait(timeout=10)


def _summary(rank_result) -> str:
    walls = [w * 1e3 for w in rank_result["walls"]]
    stats = rank_result["stats"]
    n = max(1, stats["sends_posted"])
    cuts = statistics.quantiles(walls, n=10) if len(walls) > 1 else walls * 9
    return (f"isend ms mean {statistics.mean(walls):6.3f} p50 {statistics.median(walls):6.3f} "
            f"p90 {cuts[-1]:6.3f} max {max(walls):6.2f} | preempted {rank_result['preempted']:2d}/{len(walls)} | "
            f"C++ {stats['post_ns'] / n / 1e3:7.1f} us/send, of it in FUTEX_WAKE "
            f"{stats['wake_ns'] / n / 1e3:7.1f} us ({stats['wakes_at_post']} wakes), "
            f"{stats['bytes_copied_at_post'] / n / 1024:5.0f} KiB copied/send, queued {stats['queued_at_post']} | "
            f"sleeps {stats['sleeps']} (batch {stats['sleeps_as_batch']}) | "
            f"input wait ms mean {statistics.mean(rank_result['waits']) * 1e3 if rank_result['waits'] else 0:5.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--orders", default="1f1b,dpp")
    parser.add_argument("--cpus", default="shared,own", help="shared (both on CPU 0), own (one CPU each)")
    parser.add_argument("--batch", default="off,on", help="ShmConfig.batch_while_sleeping: off, on")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--work-scale", type=float, default=1.0, help="multiplies the CPU work of every step")
    parser.add_argument("--background", type=int, default=0,
                        help="processes that spin meanwhile, on CPU 0, 1, ... in turn (other jobs on a shared machine)")
    args = parser.parse_args()
    print(f"messages: {MICRO_BATCH} x seq {min(SEQS)}..{max(SEQS)} x {HIDDEN} float32; CPU ms per step "
          f"at 256 tokens: rank 0 F/B {WORK_MS[0]}, rank 1 F/B {WORK_MS[1]} x {args.work_scale}; {args.background} background spinners; load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    for cpus in args.cpus.split(","):
        for order in args.orders.split(","):
            for batch in args.batch.split(","):
                with tempfile.TemporaryDirectory() as tmp:
                    result = posting_round(Path(tmp), order, cpus, batch == "on", args.iterations,
                                           args.microbatches, args.work_scale, args.background)
                iteration_ms = statistics.mean(result[0]["iteration_s"]) * 1e3
                print(f"cpus={cpus} order={order} batch_while_sleeping={batch}: iteration {iteration_ms:.1f} ms"
                      + (f" (fallback: {result[0]['fallback']})" if batch == "on" and result[0]["fallback"] else ""))
                for rank in (0, 1):
                    print(f"  rank {rank}: {_summary(result[rank])}", flush=True)


if __name__ == "__main__":
    main()
