"""Measure this cluster's HardwareProfile and write it as Galvatron's hardware files.

Runs under torchrun, one process per rank (run_scripts/profile_hardware.sh starts it):

    torchrun --standalone --nproc-per-node 2 -m megatron_dpp.search.hardware_measurement \\
        --output-dir runs/hardware [--quick]

Backend: NCCL on cuda:LOCAL_RANK where torch sees a GPU, else gloo on the CPU (platform.py's rule).
Every figure is the slowest rank's (times: the maximum over ranks), for every group at once: all
groups of one size run their collectives concurrently, as the data-parallel groups of a training
step do.

- all-reduce bus bandwidth, per group size (the world, halved down to 2) and contiguity
  (consecutive ranks, or strided by the number of groups as Galvatron forms them):
  2(n-1)/n * bytes / time, averaged over --bandwidth-sizes-mb (nccl-tests' "Avg bus bandwidth",
  which Galvatron records).
- point-to-point bandwidth per pipeline size (2, 4, ... up to the world or --max-pp-size), stages
  strided as Megatron and Galvatron place them: every rank sends to its next stage and receives
  from its previous one (nccl-tests' sendrecv ring) through OUR transports (megatron_dpp.comm's
  router, --p2p-transport: shm_tensor on one node, rdma_tensor across nodes, torch.distributed
  where neither runs); bytes / time, averaged over --bandwidth-sizes-mb.
- latency (ours): per consecutive all-reduce group size and per pipeline size, the intercept alpha
  of the least-squares line t = alpha + bytes / rate through the times of LATENCY_SIZES_BYTES
  messages (4 KB to 1 MB, LATENCY_ITERS_FACTOR x --iters each), at least 0; the cost model prices a message as
  alpha + bytes / bandwidth.
- overlap coefficient, Galvatron's definition: max(matmul loop time while all-reduces run in
  another thread (another CUDA stream) / alone, all-reduce loop time while matmuls run / alone),
  at least 1.
- sp_time: all-reduce and all-to-all times of each --sp-sizes-mb message per consecutive group
  size (Galvatron's sequence-parallel file; its reader fits a line through at least 8 sizes).
  all_to_all_single where the backend has it; where it does not, only all-reduce is written and
  the source says so.
- matmul TFLOP/s per dtype: square --matmul-size matmuls, 2n^3 flops each (our companion file).

Rank 0 writes the files with write_hardware_dir into --output-dir and prints a summary table.
Every wait has a timeout (--timeout): the process group's collectives, the transport's waits and
the background thread of the overlap measurement.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import socket
import sys
import threading
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_dpp.comm.defaults import DEFAULT_TRANSPORT_KIND, TRANSPORT_KINDS
from megatron_dpp.exit_codes import BAD_INPUT
from megatron_dpp.one_line_errors import OneLineErrorParser
from megatron_dpp.search.hardware import (
    GB, MB, SP_OPS, HardwareProfile, collective_group, group_sizes, pipeline_group, pipeline_sizes,
    write_hardware_dir)

PROG = "profile_hardware"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Every default, full run and --quick, in one place.
DEFAULTS = {
    "bandwidth_sizes_mb": ((16, 64, 256), (1, 4)),
    "sp_sizes_mb": (tuple(1 << i for i in range(11)), tuple(range(1, 9))),  # 1..1024 like Galvatron
    "iters": (10, 3),
    "warmup": (2, 1),
    "overlap_ms": (1000.0, 100.0),
    "overlap_mb": (64, 4),
    "dtypes": (("bf16", "fp16", "fp32"), ("fp32",)),
}
MATMUL_SIZE = {"cuda": 8192, "cpu": 1024, "quick": 256}
LATENCY_SIZES_BYTES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20)  # small messages
LATENCY_ITERS_FACTOR = 5  # small messages are fast and noisy: 5x --iters repetitions each
GALVATRON_MIN_SP_SIZES = 8  # Galvatron's sp_time reader asserts at least 8 message sizes


def _mb_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole MB, comma-separated, e.g. 1,4,16")
    if not values or any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give positive whole MB, comma-separated")
    return tuple(sorted(set(values)))


def _dtype_list(text: str) -> tuple[str, ...]:
    values = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [value for value in values if value not in DTYPES]
    if not values or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: pick from {','.join(DTYPES)}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog=PROG, allow_abbrev=False,
                                 description=__doc__.split("\n\n")[0])
    full, quick = ({name: value[i] for name, value in DEFAULTS.items()} for i in (0, 1))
    parser.add_argument("--output-dir", required=True,
                        help="directory the hardware files are written to (created if missing; "
                             "profile_hardware.sh: or OUTPUT_DIR)")
    parser.add_argument("--quick", action="store_true",
                        help="small messages and few repetitions, for tests: every default below "
                             "takes its --quick value")
    parser.add_argument("--bandwidth-sizes-mb", type=_mb_list, default=None,
                        help="message sizes (MB) of the all-reduce and p2p bandwidths, averaged "
                             f"(default {_join(full['bandwidth_sizes_mb'])}; "
                             f"--quick {_join(quick['bandwidth_sizes_mb'])})")
    parser.add_argument("--sp-sizes-mb", type=_mb_list, default=None,
                        help="message sizes (MB) of the sp_time file, at least "
                             f"{GALVATRON_MIN_SP_SIZES} (Galvatron fits a line through them; "
                             f"default 1,2,4,...,1024; --quick {_join(quick['sp_sizes_mb'])})")
    parser.add_argument("--iters", type=int, default=None,
                        help=f"timed repetitions of every measurement (default {full['iters']}; "
                             f"--quick {quick['iters']})")
    parser.add_argument("--warmup", type=int, default=None,
                        help=f"untimed repetitions before them (default {full['warmup']}; "
                             f"--quick {quick['warmup']})")
    parser.add_argument("--overlap-ms", type=float, default=None,
                        help="how long the overlap test's matmul loop runs alone, in ms "
                             f"(default {full['overlap_ms']:g}; --quick {quick['overlap_ms']:g})")
    parser.add_argument("--overlap-mb", type=int, default=None,
                        help="all-reduce message of the overlap test, in MB "
                             f"(default {full['overlap_mb']}; --quick {quick['overlap_mb']})")
    parser.add_argument("--matmul-size", type=int, default=None,
                        help="n of the n x n matmuls (TFLOP/s and the overlap test; default "
                             f"{MATMUL_SIZE['cuda']} on GPUs, {MATMUL_SIZE['cpu']} on CPU; "
                             f"--quick {MATMUL_SIZE['quick']})")
    parser.add_argument("--dtypes", type=_dtype_list, default=None,
                        help=f"matmul dtypes to measure (default {_join(full['dtypes'])}; "
                             f"--quick {_join(quick['dtypes'])})")
    parser.add_argument("--max-pp-size", type=int, default=None,
                        help="largest pipeline size of the p2p measurement (default: the world)")
    parser.add_argument("--p2p-transport", choices=TRANSPORT_KINDS, default=DEFAULT_TRANSPORT_KIND,
                        help="route table of the p2p measurement, as the trainer's flag: auto "
                             "(same node shm_tensor, other node rdma_tensor, else "
                             "torch.distributed), torch, shm, rdma")
    parser.add_argument("--node-ips", default=None, metavar="IP[,IP...]",
                        help="every node's address in node-rank order, as the trainer's "
                             "--node-ips: nodes told apart by node rank, rdma_tensor listens on "
                             "this node's address (default: nodes told apart by host name)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds any one wait (a collective, a message, a thread) may take "
                             "before the run fails naming it (default 300)")
    parser.add_argument("--check-flags-only", action="store_true",
                        help="check the flags and exit, outside torchrun (profile_hardware.sh runs "
                             "this before starting the ranks)")
    return parser


def _join(values) -> str:
    return ",".join(str(value) for value in values)


@dataclasses.dataclass(frozen=True)
class Settings:
    """The resolved flags: --quick and the device's defaults applied."""

    output_dir: str
    bandwidth_sizes_mb: tuple[int, ...]
    sp_sizes_mb: tuple[int, ...]
    iters: int
    warmup: int
    overlap_ms: float
    overlap_mb: int
    matmul_size: int
    dtypes: tuple[str, ...]
    max_pp_size: Optional[int]
    p2p_transport: str
    node_ips: Optional[list[str]]
    timeout_s: float


def resolve(parser: argparse.ArgumentParser, args: argparse.Namespace,
            cuda: bool) -> Settings:
    """Apply defaults and check every flag; a bad one exits through parser.error (one line)."""
    pick = 1 if args.quick else 0
    values = {name: getattr(args, name) if getattr(args, name) is not None else default[pick]
              for name, default in DEFAULTS.items()}
    matmul_size = args.matmul_size if args.matmul_size is not None else MATMUL_SIZE[
        "quick" if args.quick else ("cuda" if cuda else "cpu")]
    if len(values["sp_sizes_mb"]) < GALVATRON_MIN_SP_SIZES:
        parser.error(f"--sp-sizes-mb needs at least {GALVATRON_MIN_SP_SIZES} sizes (Galvatron's "
                     f"sp_time reader fits a line through them); got {_join(values['sp_sizes_mb'])}")
    if values["iters"] < 1 or values["warmup"] < 0:
        parser.error("--iters must be at least 1 and --warmup at least 0")
    if values["overlap_ms"] <= 0 or values["overlap_mb"] < 1 or matmul_size < 1:
        parser.error("--overlap-ms, --overlap-mb and --matmul-size must be positive")
    if args.max_pp_size is not None and args.max_pp_size < 2:
        parser.error(f"--max-pp-size {args.max_pp_size}: a pipeline has at least 2 stages")
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    node_ips = None
    if args.node_ips is not None:
        from megatron_dpp.comm.nodes import parse_node_ips

        try:
            node_ips = parse_node_ips(args.node_ips)
        except ValueError as error:
            parser.error(f"--node-ips {args.node_ips}: {error}")
    return Settings(output_dir=args.output_dir, matmul_size=matmul_size,
                    max_pp_size=args.max_pp_size, p2p_transport=args.p2p_transport,
                    node_ips=node_ips, timeout_s=args.timeout, **values)


# ----------------------------------------------------------------------------------------------
# timing helpers
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Context:
    """This rank's place and the things every measurement uses."""

    rank: int
    world_size: int
    device: torch.device
    settings: Settings
    notes: list[str]  # what the source string says beyond the figures (fallbacks, gaps)

    def synchronize(self, stream=None) -> None:
        if self.device.type == "cuda":
            (stream or torch.cuda.current_stream()).synchronize()

    def slowest(self, seconds: float) -> float:
        """The largest of every rank's `seconds`."""
        value = torch.tensor([seconds], dtype=torch.float64, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value.item())

    def all_agree(self, ok: bool) -> bool:
        value = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return bool(value.item())

    def progress(self, message: str) -> None:
        if self.rank == 0:
            print(f"[{PROG}] {message}", flush=True)

    def timed(self, step: Callable[[], None], iters: Optional[int] = None) -> float:
        """Seconds per `step` on the slowest rank, after the warm-up; ranks start together."""
        iters = iters or self.settings.iters
        for _ in range(self.settings.warmup):
            step()
        self.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            step()
        self.synchronize()
        return self.slowest((time.perf_counter() - start) / iters)


def _elements(megabytes: int) -> int:
    return megabytes * MB // 4  # float32 elements


def _my_group(ctx: Context, size: int, groups: list[list[int]]):
    """new_group for every group (collective: every rank creates each), this rank's returned."""
    mine = None
    for ranks in groups:
        handle = dist.new_group(ranks, timeout=datetime.timedelta(seconds=ctx.settings.timeout_s))
        if ctx.rank in ranks:
            mine = handle
    return mine


def collective_groups(ctx: Context) -> dict[tuple[int, bool], object]:
    """(group size, consecutive) -> this rank's process group, for every size Galvatron profiles."""
    world = ctx.world_size
    groups = {}
    for size in group_sizes(world):
        for consecutive in ((True,) if size == world else (True, False)):
            members = [collective_group(world, size, consecutive, i) for i in range(world // size)]
            groups[(size, consecutive)] = (dist.group.WORLD if size == world else
                                           _my_group(ctx, size, members))
    return groups


# ----------------------------------------------------------------------------------------------
# measurements
# ----------------------------------------------------------------------------------------------
def latency_ms(ctx: Context, step_of: Callable[[torch.Tensor], Callable[[], None]]) -> float:
    """alpha of t = alpha + bytes / rate, least squares over LATENCY_SIZES_BYTES messages (the
    slowest rank's times), in ms, at least 0. step_of(tensor) -> one message of that tensor."""
    iters = LATENCY_ITERS_FACTOR * ctx.settings.iters
    times = []
    for nbytes in LATENCY_SIZES_BYTES:
        tensor = torch.ones(nbytes // 4, dtype=torch.float32, device=ctx.device)
        times.append(ctx.timed(step_of(tensor), iters) * 1e3)
    count = len(times)
    mean_x, mean_t = sum(LATENCY_SIZES_BYTES) / count, sum(times) / count
    slope = (sum((x - mean_x) * (t - mean_t) for x, t in zip(LATENCY_SIZES_BYTES, times))
             / sum((x - mean_x) ** 2 for x in LATENCY_SIZES_BYTES))
    return max(0.0, mean_t - slope * mean_x)


def measure_allreduce_latency(ctx: Context, groups) -> dict[int, float]:
    """Consecutive group size -> all-reduce latency in ms (tensor-parallel groups are consecutive)."""
    latency = {}
    for (size, consecutive), group in groups.items():
        if consecutive:
            latency[size] = latency_ms(ctx, lambda tensor: lambda: dist.all_reduce(tensor, group=group))
            ctx.progress(f"all-reduce {size} ranks: latency {latency[size]:.3f} ms")
    return latency


def measure_allreduce(ctx: Context, groups) -> dict[tuple[int, bool], float]:
    busbw = {}
    for (size, consecutive), group in groups.items():
        samples = []
        for megabytes in ctx.settings.bandwidth_sizes_mb:
            tensor = torch.ones(_elements(megabytes), dtype=torch.float32, device=ctx.device)
            seconds = ctx.timed(lambda: dist.all_reduce(tensor, group=group))
            samples.append(2 * (size - 1) / size * megabytes * MB / seconds / GB)
        busbw[(size, consecutive)] = sum(samples) / len(samples)
        ctx.progress(f"all-reduce {size} ranks {'consecutive' if consecutive else 'strided'}: "
                     f"{busbw[(size, consecutive)]:.3f} GB/s bus bandwidth")
    return busbw


def _transport_name(transport, peer: int) -> str:
    from megatron_dpp.comm.router import RoutedTransport

    inner = transport.route(peer) if isinstance(transport, RoutedTransport) else transport
    module = type(inner).__module__
    for name in ("shm_tensor", "rdma_tensor"):
        if module.startswith(name):
            return name
    return "torch.distributed"


def measure_p2p(ctx: Context) -> tuple[dict[int, float], dict[int, list[str]], dict[int, float]]:
    """pp size -> GB/s, pp size -> the transports that carried its messages (all ranks), and pp
    size -> latency in ms (`latency_ms`)."""
    from megatron_dpp.comm.router import make_transport
    from shm_tensor.config import ShmConfig

    settings = ctx.settings
    largest = max(settings.bandwidth_sizes_mb) * MB
    # One message in flight per direction and peer: two slots of the largest message each.
    shm_config = ShmConfig(num_slots=2, slot_bytes=largest, timeout_s=settings.timeout_s)
    tag = 0
    bandwidth, carried_by, latency = {}, {}, {}
    for pp_size in pipeline_sizes(ctx.world_size, settings.max_pp_size):
        stages = pipeline_group(ctx.world_size, pp_size, ctx.rank % (ctx.world_size // pp_size))
        position = stages.index(ctx.rank)
        next_stage, prev_stage = stages[(position + 1) % pp_size], stages[position - 1]
        # A transport per pipeline size, to its two neighbours only (collective: every rank).
        transport = make_transport(
            settings.p2p_transport, [next_stage, prev_stage], shm_config=shm_config,
            timeout_s=settings.timeout_s, device=ctx.device, node_ips=settings.node_ips,
            max_message_bytes=largest, log=False)
        try:
            def exchange(payload):
                nonlocal tag
                tag += 1
                receive = transport.irecv(prev_stage, tag)
                send = transport.isend(payload, next_stage, tag)
                receive.wait(timeout=settings.timeout_s)  # the received tensor is dropped at once
                send.wait(timeout=settings.timeout_s)

            samples = []
            for megabytes in settings.bandwidth_sizes_mb:
                payload = torch.ones(_elements(megabytes), dtype=torch.float32, device=ctx.device)
                seconds = ctx.timed(lambda: exchange(payload))
                samples.append(megabytes * MB / seconds / GB)
            bandwidth[pp_size] = sum(samples) / len(samples)
            latency[pp_size] = latency_ms(ctx, lambda tensor: lambda: exchange(tensor))
            names: list[Optional[str]] = [None] * ctx.world_size
            dist.all_gather_object(names, _transport_name(transport, next_stage))
            carried_by[pp_size] = sorted(set(names))
        finally:
            dist.barrier()
            transport.close()
        ctx.progress(f"p2p pipeline of {pp_size}: {bandwidth[pp_size]:.3f} GB/s, latency "
                     f"{latency[pp_size]:.3f} ms over {', '.join(carried_by[pp_size])}")
    return bandwidth, carried_by, latency


def _all_to_all_works(ctx: Context) -> str:
    """"" when the backend runs all_to_all_single here, else why not (every rank agrees)."""
    problem = ""
    try:
        probe = torch.ones(ctx.world_size, device=ctx.device)
        dist.all_to_all_single(torch.empty_like(probe), probe)
    # A backend without the collective raises one of these (gloo builds differ in which).
    except (RuntimeError, NotImplementedError, ValueError) as error:
        problem = str(error).splitlines()[0] if str(error) else type(error).__name__
    if not ctx.all_agree(not problem):
        return problem or "all_to_all_single failed on another rank"
    return ""


def measure_sp_time(ctx: Context, groups) -> dict[tuple[str, int, int], float]:
    times = {}
    no_all_to_all = _all_to_all_works(ctx)
    if no_all_to_all:
        ctx.notes.append(f"sp_time has no all2all: torch.distributed {dist.get_backend()} lacks "
                         f"all_to_all_single here ({no_all_to_all})")
    for (size, consecutive), group in groups.items():
        if not consecutive:
            continue  # Galvatron's sp_time is for consecutive groups (tensor parallel)
        for megabytes in ctx.settings.sp_sizes_mb:
            tensor = torch.ones(_elements(megabytes), dtype=torch.float32, device=ctx.device)
            times[("allreduce", size, megabytes)] = 1e3 * ctx.timed(
                lambda: dist.all_reduce(tensor, group=group))
            if not no_all_to_all:
                output = torch.empty_like(tensor)
                times[("all2all", size, megabytes)] = 1e3 * ctx.timed(
                    lambda: dist.all_to_all_single(output, tensor, group=group))
        ctx.progress(f"sp_time {size} ranks: {len(ctx.settings.sp_sizes_mb)} sizes of all-reduce"
                     f"{'' if no_all_to_all else ' and all-to-all'}")
    return times


def measure_matmul(ctx: Context) -> dict[str, float]:
    n = ctx.settings.matmul_size
    tflops = {}
    for name in ctx.settings.dtypes:
        problem = ""
        try:
            a = torch.randn(n, n, device=ctx.device).to(DTYPES[name])
            b = torch.randn(n, n, device=ctx.device).to(DTYPES[name])
            torch.matmul(a, b)
        # A dtype the device has no matmul kernel for raises one of these.
        except (RuntimeError, NotImplementedError) as error:
            problem = str(error).splitlines()[0]
        if not ctx.all_agree(not problem):
            ctx.notes.append(f"no {name} matmul on {ctx.device.type}: {problem or 'another rank failed'}")
            continue
        seconds = ctx.timed(lambda: torch.matmul(a, b))
        tflops[name] = 2 * n ** 3 / seconds / 1e12
        ctx.progress(f"matmul {name} {n}x{n}: {tflops[name]:.4f} TFLOP/s")
    return tflops


class _Background:
    """Runs `body(stop)` in a thread; `finish` joins it with a timeout and re-raises its error."""

    def __init__(self, ctx: Context, what: str, body: Callable[[threading.Event], None]):
        self.ctx, self.what, self.stop, self.error = ctx, what, threading.Event(), None

        def run():
            try:
                if ctx.device.type == "cuda":
                    torch.cuda.set_device(ctx.device)
                body(self.stop)
            except BaseException as error:  # re-raised by finish() in the main thread
                self.error = error

        self.thread = threading.Thread(target=run, name=what, daemon=True)
        self.thread.start()

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(timeout=self.ctx.settings.timeout_s)
        if self.thread.is_alive():
            raise TimeoutError(f"{PROG}: the {self.what} thread did not end within "
                               f"{self.ctx.settings.timeout_s} s")
        if self.error is not None:
            raise self.error


def measure_overlap(ctx: Context) -> tuple[float, float, float]:
    """(coefficient, compute slowdown, communication slowdown), Galvatron's definition."""
    settings = ctx.settings
    n = settings.matmul_size
    a, b = torch.randn(n, n, device=ctx.device), torch.randn(n, n, device=ctx.device)
    message = torch.ones(_elements(settings.overlap_mb), dtype=torch.float32, device=ctx.device)
    cuda = ctx.device.type == "cuda"
    comm_stream = torch.cuda.Stream() if cuda else None
    compute_stream = torch.cuda.current_stream() if cuda else None

    def matmul():
        torch.matmul(a, b)

    def allreduce():
        if cuda:
            with torch.cuda.stream(comm_stream):
                dist.all_reduce(message)
        else:
            dist.all_reduce(message)

    # Alone. The loop lengths are agreed (the slowest rank's) so every rank runs the same number
    # of collectives.
    matmul_s = ctx.timed(matmul)
    matmul_iters = max(1, math.ceil(settings.overlap_ms / 1e3 / matmul_s))
    allreduce_s = ctx.timed(lambda: (allreduce(), ctx.synchronize(comm_stream)))
    compute_alone = ctx.timed(matmul, matmul_iters) * matmul_iters
    # All-reduces enough to outlast the compute loop even if they slow down by half.
    allreduce_iters = max(2, math.ceil(1.5 * compute_alone / allreduce_s))

    def comm_loop(_stop=None):
        for _ in range(allreduce_iters):
            allreduce()
        ctx.synchronize(comm_stream)

    comm_alone = ctx.timed(comm_loop, 1)

    # Compute while all-reduces run.
    dist.barrier()
    background = _Background(ctx, "all-reduce", comm_loop)
    start = time.perf_counter()
    for _ in range(matmul_iters):
        matmul()
    ctx.synchronize(compute_stream)
    compute_overlapped = time.perf_counter() - start
    background.finish()
    compute_overlapped = ctx.slowest(compute_overlapped)

    def compute_loop(stop):
        while not stop.is_set():
            matmul()
            ctx.synchronize(compute_stream)  # never queue far ahead of the stop

    # All-reduces while matmuls run.
    dist.barrier()
    background = _Background(ctx, "matmul", compute_loop)
    start = time.perf_counter()
    comm_loop()
    comm_overlapped = time.perf_counter() - start
    background.finish()
    comm_overlapped = ctx.slowest(comm_overlapped)

    compute_slowdown = compute_overlapped / compute_alone
    comm_slowdown = comm_overlapped / comm_alone
    coefficient = max(1.0, compute_slowdown, comm_slowdown)
    ctx.progress(f"overlap: matmul x{compute_slowdown:.3f} while all-reducing, all-reduce "
                 f"x{comm_slowdown:.3f} while computing -> {coefficient:.3f}")
    return coefficient, compute_slowdown, comm_slowdown


# ----------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------
def _torchrun_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None or not value.isdigit():
        print(f"{PROG}: error: ${name} is {value!r}; run under torchrun (run_scripts/"
              f"profile_hardware.sh), one process per rank", file=sys.stderr, flush=True)
        sys.exit(BAD_INPUT)
    return int(value)


def _source(ctx: Context, num_nodes: int, gpus_per_node: int, carried_by, overlap) -> str:
    hosts: list[Optional[str]] = [None] * ctx.world_size
    dist.all_gather_object(hosts, socket.gethostname())
    if ctx.device.type == "cuda":
        device = torch.cuda.get_device_name(ctx.device)
    else:
        device = f"CPU, {torch.get_num_threads()} thread(s) per rank"
    transports = "; ".join(f"pp {size}: {', '.join(names)}" for size, names in carried_by.items())
    settings = ctx.settings
    parts = [
        f"measured by megatron_dpp.search.hardware_measurement on {','.join(sorted(set(hosts)))} "
        f"({num_nodes} node(s) x {gpus_per_node} ranks, {device}) at "
        f"{datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%dT%H:%MZ')}",
        f"all-reduce, sp_time and overlap over torch.distributed {dist.get_backend()}",
        f"p2p over --p2p-transport {settings.p2p_transport} ({transports})",
        f"bandwidths averaged over {_join(settings.bandwidth_sizes_mb)} MB, {settings.iters} "
        f"iterations each",
        f"overlap: matmul x{overlap[1]:.3f}, all-reduce x{overlap[2]:.3f} "
        f"({settings.overlap_mb} MB all-reduce, {settings.matmul_size}^2 matmuls)",
        f"matmul {settings.matmul_size}x{settings.matmul_size}",
        *ctx.notes,
    ]
    return "; ".join(parts)


def print_summary(profile: HardwareProfile, carried_by, backend: str, paths) -> None:
    print(f"\nall-reduce bus bandwidth (torch.distributed {backend})")
    print(f"  {'group':>5}  {'ranks':<11}  {'GB/s':>10}")
    for (size, consecutive), bw in sorted(profile.allreduce_busbw_gbps.items(),
                                          key=lambda item: (-item[0][0], not item[0][1])):
        print(f"  {size:>5}  {'consecutive' if consecutive else 'strided':<11}  {bw:>10.3f}")
    print("point-to-point bandwidth")
    print(f"  {'pp':>5}  {'GB/s':>10}  transport")
    for size, bw in sorted(profile.p2p_gbps.items()):
        print(f"  {size:>5}  {bw:>10.3f}  {', '.join(carried_by[size])}")
    print("latency (ms, small messages)")
    for size, ms in sorted(profile.allreduce_latency_ms.items()):
        print(f"  all-reduce {size:>4} ranks  {ms:>10.3f}")
    for size, ms in sorted(profile.p2p_latency_ms.items()):
        print(f"  p2p pipeline of {size:>4}  {ms:>10.3f}")
    print(f"overlap coefficient: {profile.overlap_coefficient:.3f} (torch.distributed {backend})")
    print("sp_time (ms)")
    for (op, size, mb), ms in sorted(profile.sp_time_ms.items(),
                                     key=lambda item: (SP_OPS.index(item[0][0]), *item[0][1:])):
        print(f"  {op:<9} {size:>4} ranks {mb:>5} MB  {ms:>10.3f}")
    print("matmul TFLOP/s")
    for dtype, value in sorted(profile.matmul_tflops.items()):
        print(f"  {dtype:<5} {value:.4f}")
    print(f"source: {profile.source}")
    print("wrote " + ", ".join(str(path) for path in paths), flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    settings = resolve(parser, args, cuda)
    if args.check_flags_only:
        return 0
    rank, world_size = _torchrun_int("RANK"), _torchrun_int("WORLD_SIZE")
    local_rank, gpus_per_node = _torchrun_int("LOCAL_RANK"), _torchrun_int("LOCAL_WORLD_SIZE")
    num_nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if world_size < 2 or num_nodes * gpus_per_node != world_size:
        print(f"{PROG}: error: WORLD_SIZE={world_size} with {num_nodes} node(s) x {gpus_per_node} "
              f"per node; the profile needs at least 2 ranks, the same number on every node",
              file=sys.stderr, flush=True)
        return BAD_INPUT
    if settings.node_ips is not None:
        # As the trainer's --multi-node: gloo and NCCL on this node's --node-ips interface.
        from megatron_dpp.comm.nodes import check_node_count, this_node_rank, use_node_network

        try:
            check_node_count(settings.node_ips, num_nodes)
            network = use_node_network(settings.node_ips, this_node_rank())
        except ValueError as error:
            print(f"{PROG}: error: --node-ips: {error}", file=sys.stderr, flush=True)
            return BAD_INPUT
        if local_rank == 0:
            print(f"[{PROG}]{network.describe()}", flush=True)
    # platform.py's rule: a GPU per rank with NCCL, else the CPU with gloo.
    if cuda:
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=settings.timeout_s),
                            **({"device_id": device} if cuda else {}))
    ctx = Context(rank=rank, world_size=world_size, device=device, settings=settings, notes=[])
    try:
        ctx.progress(f"{world_size} ranks ({num_nodes} node(s) x {gpus_per_node}), "
                     f"torch.distributed {backend} on {device.type}")
        groups = collective_groups(ctx)
        allreduce = measure_allreduce(ctx, groups)
        allreduce_latency = measure_allreduce_latency(ctx, groups)
        p2p, carried_by, p2p_latency = measure_p2p(ctx)
        overlap = measure_overlap(ctx)
        sp_time = measure_sp_time(ctx, groups)
        matmul = measure_matmul(ctx)
        source = _source(ctx, num_nodes, gpus_per_node, carried_by, overlap)
        if rank == 0:
            profile = HardwareProfile(
                num_nodes=num_nodes, gpus_per_node=gpus_per_node, allreduce_busbw_gbps=allreduce,
                p2p_gbps=p2p, overlap_coefficient=overlap[0], sp_time_ms=sp_time,
                matmul_tflops=matmul, source=source, allreduce_latency_ms=allreduce_latency,
                p2p_latency_ms=p2p_latency)
            paths = write_hardware_dir(profile, settings.output_dir)
            print_summary(profile, carried_by, backend, paths)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
