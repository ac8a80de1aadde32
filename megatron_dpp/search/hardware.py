"""The cluster's figures the search prices layouts with, in Galvatron's files, and named presets.

A `HardwareProfile` holds all-reduce bus bandwidth per group size and contiguity, point-to-point
bandwidth per pipeline size, the overlap slowdown, optional sequence-parallel collective times and
(our addition) dense matmul TFLOP/s per dtype. `read_hardware_dir` / `write_hardware_dir` use
Galvatron's file names and keys (docs/search.md, "Hardware profile"), so a directory written by
Galvatron's profiler reads here and one written here reads in Galvatron's search engine:

    allreduce_bandwidth_{N}nodes_{G}gpus_per_node.json  {"allreduce_size_{g}_consec_{0|1}": GB/s}
    p2p_bandwidth_{N}nodes_{G}gpus_per_node.json        {"pp_size_{s}": GB/s}
    overlap_coefficient.json                            {"overlap_coe": x}
    sp_time_{N}nodes_{G}gpus_per_node.json   {"allreduce_size_{g}_{m}MB_time": ms,
                                              "all2all_size_{g}_{m}MB_time": ms}   (optional)
    megatron_dpp_compute_{N}nodes_{G}gpus_per_node.json  {"matmul_tflops": {dtype: TFLOP/s},
                                                          "source": "...",
                                     "allreduce_latency_ms": {"{g}": ms},   (optional)
                                     "p2p_latency_ms": {"{s}": ms}}         (optional)
                                                                        (ours, optional)

A message's time is alpha + bytes / bandwidth: alpha, the latency, from our compute file (fitted
by profile_hardware.sh on small messages), 0 where it has none (Galvatron's files, the presets:
their bandwidths are for large messages, and no datasheet gives a latency).

Units: bandwidths in GB/s (1e9 B/s), times in ms, sp_time message sizes in MB (2**20 B).

A directory without our compute file (Galvatron's) has no matmul rate: `with_matmul_rates` adds a
preset's, or our quick measurement on this machine (`quick_matmul_tflops`), with the line that
says which.
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
import types
from typing import Callable, Mapping, Optional

from megatron_dpp.search.errors import SearchInputError

GB = 1e9  # Galvatron's bandwidths are GB/s (nccl-tests' unit)
MB = 1 << 20  # Galvatron's message sizes
SP_OPS = ("allreduce", "all2all")  # sp_time's collectives, by Galvatron's key prefix

# Galvatron's file names, one place each.
ALLREDUCE_FILE = "allreduce_bandwidth_{n}nodes_{g}gpus_per_node.json"
P2P_FILE = "p2p_bandwidth_{n}nodes_{g}gpus_per_node.json"
OVERLAP_FILE = "overlap_coefficient.json"
SP_TIME_FILE = "sp_time_{n}nodes_{g}gpus_per_node.json"
# Ours: Galvatron keeps compute in its model profiles; the simulator also wants a matmul rate.
COMPUTE_FILE = "megatron_dpp_compute_{n}nodes_{g}gpus_per_node.json"

# Each file's keys: the pattern, and how an error message spells it.
_ALLREDUCE_KEY = (re.compile(r"allreduce_size_(\d+)_consec_([01])"), "allreduce_size_{g}_consec_{0|1}")
_P2P_KEY = (re.compile(r"pp_size_(\d+)"), "pp_size_{s}")
_SP_KEY = (re.compile(r"(allreduce|all2all)_size_(\d+)_(\d+)MB_time"),
           "allreduce_size_{g}_{m}MB_time or all2all_size_{g}_{m}MB_time")
_OVERLAP_KEY = "overlap_coe"


def group_sizes(world_size: int) -> list[int]:
    """The collective group sizes Galvatron profiles: the world, then halved while at least 2
    (only sizes that divide the world: each must split it into whole groups)."""
    sizes, size = [], world_size
    while size >= 2:
        if world_size % size == 0:
            sizes.append(size)
        size //= 2
    return sizes


def pipeline_sizes(world_size: int, max_pp_size: Optional[int] = None) -> list[int]:
    """The pipeline sizes Galvatron profiles p2p for: 2, 4, 8, ... up to the world (or max)."""
    limit = world_size if max_pp_size is None else min(world_size, max_pp_size)
    sizes, size = [], 2
    while size <= limit:
        if world_size % size == 0:
            sizes.append(size)
        size *= 2
    return sizes


def collective_group(world_size: int, group_size: int, consecutive: bool, index: int) -> list[int]:
    """Ranks of group `index` of `group_size` as Galvatron forms them: consecutive ranks, or ranks
    strided by the number of groups (non-consecutive: one from each consecutive block)."""
    num_groups = world_size // group_size
    if consecutive:
        return list(range(index * group_size, (index + 1) * group_size))
    return list(range(index, world_size, num_groups))


def pipeline_group(world_size: int, pp_size: int, index: int) -> list[int]:
    """Ranks of pipeline `index` of `pp_size` stages as Galvatron (and Megatron, whose pipeline is
    the outermost dimension) forms them: strided by the number of pipelines."""
    return list(range(index, world_size, world_size // pp_size))


def _nearest_not_smaller(table: Mapping[int, float], size: int) -> float:
    above = [measured for measured in table if measured >= size]
    return table[min(above) if above else max(table)]


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """What one cluster shape can do. Lookups of sizes never measured follow one rule (see
    `allreduce_busbw` and `p2p_bandwidth`)."""

    num_nodes: int  # nodes in the cluster
    gpus_per_node: int  # ranks per node (CPU processes on a machine without GPUs)
    # (group size, consecutive ranks?) -> all-reduce bus bandwidth in GB/s, nccl-tests' busbw:
    # 2(n-1)/n * bytes / time.
    allreduce_busbw_gbps: Mapping[tuple[int, bool], float]
    p2p_gbps: Mapping[int, float]  # pipeline size -> point-to-point GB/s (Galvatron's pp_size_N)
    overlap_coefficient: float  # >= 1: how much slower compute and communication run overlapped
    # ("allreduce" | "all2all", group size, message MB) -> ms; empty when not profiled.
    sp_time_ms: Mapping[tuple[str, int, int], float]
    # dtype ("bf16" | "fp16" | "fp32") -> dense matmul TFLOP/s; not in Galvatron's files (ours:
    # COMPUTE_FILE); empty for a directory Galvatron wrote.
    matmul_tflops: Mapping[str, float]
    # Which figures these are: "measured ... on ..." or "preset NAME: <published source>".
    source: str
    # group size -> all-reduce latency (alpha) in ms, and pipeline size -> point-to-point latency
    # in ms; ours (COMPUTE_FILE); empty: 0.
    allreduce_latency_ms: Mapping[int, float] = dataclasses.field(default_factory=dict)
    p2p_latency_ms: Mapping[int, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        # Every check of a profile's figures lives here: the reader, the presets and the profiler
        # all build profiles through this constructor.
        where = f"hardware profile ({self.source})"
        if self.num_nodes < 1 or self.gpus_per_node < 1:
            raise SearchInputError(f"{where}: num_nodes={self.num_nodes} and gpus_per_node="
                                   f"{self.gpus_per_node} must both be at least 1")
        for name in ("allreduce_busbw_gbps", "p2p_gbps", "sp_time_ms", "matmul_tflops"):
            table = dict(getattr(self, name))
            for key, value in table.items():
                if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                    raise SearchInputError(f"{where}: {name}[{key!r}] = {value!r}; every figure "
                                           f"must be a positive number")
            object.__setattr__(self, name, types.MappingProxyType(table))
        for name in ("allreduce_latency_ms", "p2p_latency_ms"):
            table = dict(getattr(self, name))
            for key, value in table.items():
                if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                    raise SearchInputError(f"{where}: {name}[{key!r}] = {value!r}; a latency "
                                           f"must be a number >= 0")
            object.__setattr__(self, name, types.MappingProxyType(table))
        for (size, _consecutive) in self.allreduce_busbw_gbps:
            if size < 2:
                raise SearchInputError(f"{where}: an all-reduce group of {size} rank has no bandwidth")
        for op, size, _mb in self.sp_time_ms:
            if op not in SP_OPS:
                raise SearchInputError(f"{where}: sp_time op {op!r} is not one of {SP_OPS}")
        if not (math.isfinite(self.overlap_coefficient) and self.overlap_coefficient >= 1.0):
            raise SearchInputError(f"{where}: overlap_coefficient={self.overlap_coefficient}; it is "
                                   f"a slowdown, at least 1")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def allreduce_busbw(self, group_size: int, consecutive: bool = True) -> float:
        """Bus GB/s of an all-reduce over `group_size` ranks. A group of the whole cluster is the
        same group either way, so it is looked up as consecutive. A size not measured takes the
        nearest measured size not smaller, else the largest measured, of the same contiguity; a
        contiguity never measured takes the other's figures. Nothing measured: SearchInputError."""
        if group_size >= self.world_size:
            consecutive = True
        table = {size: bw for (size, flag), bw in self.allreduce_busbw_gbps.items()
                 if flag == consecutive}
        if not table:
            table = {size: bw for (size, _flag), bw in self.allreduce_busbw_gbps.items()}
        if not table:
            raise SearchInputError(f"no all-reduce bandwidth in the hardware profile ({self.source})")
        return _nearest_not_smaller(table, group_size)

    def p2p_bandwidth(self, pp_size: int) -> float:
        """Point-to-point GB/s between the stages of a pipeline of `pp_size`: the nearest measured
        pipeline size not smaller, else the largest measured. Nothing measured: SearchInputError."""
        if not self.p2p_gbps:
            raise SearchInputError(f"no point-to-point bandwidth in the hardware profile "
                                   f"({self.source})")
        return _nearest_not_smaller(self.p2p_gbps, pp_size)

    def allreduce_latency(self, group_size: int) -> float:
        """ms of an all-reduce of any size over `group_size` ranks beyond its bandwidth term: the
        nearest measured size not smaller, else the largest; 0 when none was measured."""
        return _nearest_not_smaller(self.allreduce_latency_ms, group_size) if self.allreduce_latency_ms else 0.0

    def p2p_latency(self, pp_size: int) -> float:
        """The same for one point-to-point message in a pipeline of `pp_size`."""
        return _nearest_not_smaller(self.p2p_latency_ms, pp_size) if self.p2p_latency_ms else 0.0

    def allreduce_ms(self, nbytes: int, group_size: int, consecutive: bool = True) -> float:
        """Ring all-reduce of `nbytes` per rank: latency + 2(n-1)/n * nbytes / bus bandwidth, in
        ms; 0 for a group of one. Sizes not measured: see `allreduce_busbw`."""
        if group_size < 1:
            raise ValueError(f"allreduce_ms: group_size={group_size} must be at least 1")
        if group_size == 1 or nbytes == 0:
            return 0.0
        busbw = self.allreduce_busbw(group_size, consecutive)
        return (self.allreduce_latency(group_size)
                + 2.0 * (group_size - 1) / group_size * nbytes / (busbw * GB) * 1e3)

    def p2p_ms(self, nbytes: int, pp_size: int) -> float:
        """One message of `nbytes` between neighbouring stages: latency + nbytes / bandwidth, in
        ms; 0 for a pipeline of one stage. Sizes not measured: see `p2p_bandwidth`."""
        if pp_size < 1:
            raise ValueError(f"p2p_ms: pp_size={pp_size} must be at least 1")
        if pp_size == 1 or nbytes == 0:
            return 0.0
        return self.p2p_latency(pp_size) + nbytes / (self.p2p_bandwidth(pp_size) * GB) * 1e3

    def matmul_ms(self, flops: float, dtype: str) -> float:
        """`flops` of dense matmul at the profiled rate of `dtype`, in ms."""
        if dtype not in self.matmul_tflops:
            have = ", ".join(sorted(self.matmul_tflops)) or "none"
            raise SearchInputError(f"no matmul TFLOP/s for {dtype} in the hardware profile "
                                   f"({self.source}); profiled dtypes: {have}")
        return flops / (self.matmul_tflops[dtype] * 1e12) * 1e3


# ----------------------------------------------------------------------------------------------
# Galvatron's files
# ----------------------------------------------------------------------------------------------
def hardware_file_names(num_nodes: int, gpus_per_node: int) -> dict[str, str]:
    """The file name of each part for this cluster shape."""
    shape = dict(n=num_nodes, g=gpus_per_node)
    return {"allreduce": ALLREDUCE_FILE.format(**shape), "p2p": P2P_FILE.format(**shape),
            "overlap": OVERLAP_FILE, "sp_time": SP_TIME_FILE.format(**shape),
            "compute": COMPUTE_FILE.format(**shape)}


def _write_json(path: pathlib.Path, content: dict) -> pathlib.Path:
    path.write_text(json.dumps(content, indent=4) + "\n")
    return path


def write_hardware_dir(profile: HardwareProfile, directory) -> list[pathlib.Path]:
    """Write `profile` as Galvatron's files plus our compute file into `directory` (created if
    missing; files of the same names are replaced). The sp_time file only when it has figures.
    Returns the paths written."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = hardware_file_names(profile.num_nodes, profile.gpus_per_node)
    # Galvatron's order: largest group first, consecutive before not.
    allreduce = {f"allreduce_size_{size}_consec_{int(flag)}": bw for (size, flag), bw in sorted(
        profile.allreduce_busbw_gbps.items(), key=lambda item: (-item[0][0], not item[0][1]))}
    p2p = {f"pp_size_{size}": bw for size, bw in sorted(profile.p2p_gbps.items())}
    written = [_write_json(directory / names["allreduce"], allreduce),
               _write_json(directory / names["p2p"], p2p),
               _write_json(directory / names["overlap"], {_OVERLAP_KEY: profile.overlap_coefficient})]
    if profile.sp_time_ms:
        sp_time = {f"{op}_size_{size}_{mb}MB_time": ms for (op, size, mb), ms in sorted(
            profile.sp_time_ms.items(), key=lambda item: (SP_OPS.index(item[0][0]), -item[0][1],
                                                          item[0][2]))}
        written.append(_write_json(directory / names["sp_time"], sp_time))
    compute = {"matmul_tflops": dict(sorted(profile.matmul_tflops.items())), "source": profile.source}
    for name in ("allreduce_latency_ms", "p2p_latency_ms"):
        if getattr(profile, name):
            compute[name] = {str(size): ms for size, ms in sorted(getattr(profile, name).items())}
    written.append(_write_json(directory / names["compute"], compute))
    return written


def _read_json(path: pathlib.Path) -> dict:
    try:
        content = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SearchInputError(f"{path}: not readable as JSON ({error})") from None
    if not isinstance(content, dict):
        raise SearchInputError(f"{path}: expected a JSON object, got {type(content).__name__}")
    return content


def _number(path: pathlib.Path, key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SearchInputError(f"{path}: {key} = {value!r} is not a number")
    return float(value)


def _parse_keys(path: pathlib.Path, content: dict, key_format: tuple[re.Pattern, str]
                ) -> dict[tuple, float]:
    """{key groups: value} for every key of the file's format; any other key is an error (a typo
    would otherwise silently drop a figure)."""
    pattern, spelled = key_format
    parsed = {}
    for key, value in content.items():
        match = pattern.fullmatch(key)
        if match is None:
            raise SearchInputError(f"{path}: unexpected key {key!r} (expected {spelled})")
        parsed[match.groups()] = _number(path, key, value)
    return parsed


def read_hardware_dir(directory, num_nodes: int, gpus_per_node: int) -> HardwareProfile:
    """Read the files of `num_nodes` x `gpus_per_node` from `directory`. The all-reduce, p2p and
    overlap files are required; sp_time and our compute file are optional. Without the compute
    file, matmul_tflops is empty and `source` names the Galvatron files read. Missing or malformed
    files raise SearchInputError (one line)."""
    directory = pathlib.Path(directory)
    names = hardware_file_names(num_nodes, gpus_per_node)
    required = [names[part] for part in ("allreduce", "p2p", "overlap")]
    missing = [name for name in required if not (directory / name).is_file()]
    if missing:
        raise SearchInputError(f"hardware directory {directory} lacks {', '.join(missing)} (for "
                               f"{num_nodes} nodes x {gpus_per_node} GPUs per node; write them "
                               f"with run_scripts/profile_hardware.sh)")
    path = directory / names["allreduce"]
    allreduce = {(int(size), flag == "1"): bw for (size, flag), bw in
                 _parse_keys(path, _read_json(path), _ALLREDUCE_KEY).items()}
    path = directory / names["p2p"]
    p2p = {int(size): bw for (size,), bw in _parse_keys(path, _read_json(path), _P2P_KEY).items()}
    path = directory / names["overlap"]
    overlap_content = _read_json(path)
    if _OVERLAP_KEY not in overlap_content:
        raise SearchInputError(f"{path}: no {_OVERLAP_KEY!r} key")
    overlap = _number(path, _OVERLAP_KEY, overlap_content[_OVERLAP_KEY])
    read = list(required)
    sp_time = {}
    path = directory / names["sp_time"]
    if path.is_file():
        sp_time = {(op, int(size), int(mb)): ms for (op, size, mb), ms in
                   _parse_keys(path, _read_json(path), _SP_KEY).items()}
        read.append(names["sp_time"])
    path = directory / names["compute"]
    if path.is_file():
        compute = _read_json(path)
        tflops, source = compute.get("matmul_tflops"), compute.get("source")
        if not isinstance(tflops, dict) or not isinstance(source, str):
            raise SearchInputError(f"{path}: expected {{\"matmul_tflops\": {{dtype: TFLOP/s}}, "
                                   f"\"source\": \"...\"}}")
        matmul = {dtype: _number(path, f"matmul_tflops.{dtype}", value)
                  for dtype, value in tflops.items()}
        latency = {}
        for name in ("allreduce_latency_ms", "p2p_latency_ms"):
            table = compute.get(name, {})
            if not isinstance(table, dict) or not all(str(size).isdigit() for size in table):
                raise SearchInputError(f"{path}: {name} must be an object of size -> ms")
            latency[name] = {int(size): _number(path, f"{name}.{size}", ms) for size, ms in table.items()}
    else:
        matmul, latency = {}, {}
        source = f"Galvatron files read from {directory}: {', '.join(read)}"
    return HardwareProfile(num_nodes=num_nodes, gpus_per_node=gpus_per_node,
                           allreduce_busbw_gbps=allreduce, p2p_gbps=p2p, overlap_coefficient=overlap,
                           sp_time_ms=sp_time, matmul_tflops=matmul, source=source, **latency)


# ----------------------------------------------------------------------------------------------
# presets: published nominal figures
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class NodeSpec:
    """One kind of node, from its vendor's datasheet. Nominal peaks: what the links and the tensor
    cores can do at best, no efficiency factor (measure with profile_hardware.sh for real ones)."""

    name: str
    max_gpus_per_node: int  # GPUs in one node
    nvlink_gbps: float  # per GPU, one direction, GB/s: the bus bandwidth bound inside a node
    nic_gbps: float  # network per GPU (one NIC each), one direction, GB/s
    matmul_tflops: Mapping[str, float]  # dense (no sparsity) peak per dtype
    overlap_coefficient: float
    source: str


# The overlap slowdown is not on any datasheet. Galvatron documents 1.1 to 1.3 for GPUs; NCCL's
# kernels take SMs from the compute kernels they overlap with. We take the middle, 1.2, for both,
# so that neither overlapping nor serializing gradient sync is favoured before a measurement.
PRESET_OVERLAP_COEFFICIENT = 1.2

# NVIDIA H100 Tensor Core GPU datasheet (SXM5): NVLink 4 900 GB/s per GPU (both directions, so
# 450 GB/s each way), BF16/FP16 tensor 989.4 TFLOP/s dense (1,979 with sparsity), FP32 67 TFLOP/s
# (torch's default fp32 matmul does not use TF32); DGX H100: 8 GPUs, 8x 400 Gb/s NDR InfiniBand
# (ConnectX-7), one per GPU: 50 GB/s each way.
H100_NODE = NodeSpec(
    name="8xH100-nvlink-ib400", max_gpus_per_node=8, nvlink_gbps=450.0, nic_gbps=50.0,
    matmul_tflops={"bf16": 989.4, "fp16": 989.4, "fp32": 67.0},
    overlap_coefficient=PRESET_OVERLAP_COEFFICIENT,
    source="NVIDIA H100 Tensor Core GPU datasheet (SXM5: NVLink 4 900 GB/s per GPU, bf16/fp16 "
           "989.4 dense TFLOP/s, fp32 67 TFLOP/s) and DGX H100 (8x 400 Gb/s NDR InfiniBand per "
           "node, one per GPU); nominal peaks, overlap 1.2 chosen (Galvatron: 1.1-1.3)")

# NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB): NVLink 3 600 GB/s per GPU (300 GB/s each way),
# BF16/FP16 tensor 312 TFLOP/s dense (624 with sparsity), FP32 19.5 TFLOP/s; DGX A100: 8 GPUs,
# 8x 200 Gb/s HDR InfiniBand (ConnectX-6) for compute, one per GPU: 25 GB/s each way.
A100_NODE = NodeSpec(
    name="8xA100-nvlink-ib200", max_gpus_per_node=8, nvlink_gbps=300.0, nic_gbps=25.0,
    matmul_tflops={"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    overlap_coefficient=PRESET_OVERLAP_COEFFICIENT,
    source="NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB: NVLink 3 600 GB/s per GPU, bf16/fp16 "
           "312 dense TFLOP/s, fp32 19.5 TFLOP/s) and DGX A100 (8x 200 Gb/s HDR InfiniBand per "
           "node, one per GPU); nominal peaks, overlap 1.2 chosen (Galvatron: 1.1-1.3)")

# sp_time of a preset: Galvatron's message sizes (1 MB to 1 GB; its reader fits a line to them).
PRESET_SP_SIZES_MB = tuple(1 << i for i in range(11))


def _link_busbw(node: NodeSpec, ranks: list[int], gpus_per_node: int) -> float:
    """Nominal bus bandwidth of a ring over `ranks`: NVLink (through the NVSwitch every GPU of a node
    reaches every other at full rate) inside one node; across nodes each ring crosses a node boundary
    through one GPU's NIC, and NCCL runs one ring per NIC of the group's GPUs on a node, so the
    bound is (group's GPUs per node) x NIC bandwidth, at most NVLink's."""
    nodes = {rank // gpus_per_node for rank in ranks}
    if len(nodes) == 1:
        return node.nvlink_gbps
    per_node = len(ranks) // len(nodes)
    return min(node.nvlink_gbps, per_node * node.nic_gbps)


def _preset_profile(node: NodeSpec, num_nodes: int, gpus_per_node: int) -> HardwareProfile:
    if not 1 <= gpus_per_node <= node.max_gpus_per_node:
        raise SearchInputError(f"preset {node.name}: gpus_per_node={gpus_per_node}; its nodes "
                               f"have 1 to {node.max_gpus_per_node} GPUs")
    if num_nodes < 1:
        raise SearchInputError(f"preset {node.name}: num_nodes={num_nodes} must be at least 1")
    world = num_nodes * gpus_per_node
    allreduce = {}
    for size in group_sizes(world):
        for consecutive in ((True,) if size == world else (True, False)):
            ranks = collective_group(world, size, consecutive, 0)
            allreduce[(size, consecutive)] = _link_busbw(node, ranks, gpus_per_node)
    p2p = {}
    for size in pipeline_sizes(world):
        stages = pipeline_group(world, size, 0)
        # The slowest hop between neighbouring stages sets the pipeline's rate.
        p2p[size] = min(_link_busbw(node, pair, gpus_per_node)
                        for pair in zip(stages, stages[1:]))
    sp_time = {}
    for size in group_sizes(world):
        busbw = allreduce[(size, True)] * GB
        for mb in PRESET_SP_SIZES_MB:
            nbytes = mb * MB
            # nccl-tests' bus bandwidth definitions: all-reduce 2(n-1)/n, all-to-all (n-1)/n.
            sp_time[("allreduce", size, mb)] = 2 * (size - 1) / size * nbytes / busbw * 1e3
            sp_time[("all2all", size, mb)] = (size - 1) / size * nbytes / busbw * 1e3
    return HardwareProfile(num_nodes=num_nodes, gpus_per_node=gpus_per_node,
                           allreduce_busbw_gbps=allreduce, p2p_gbps=p2p,
                           overlap_coefficient=node.overlap_coefficient, sp_time_ms=sp_time,
                           matmul_tflops=node.matmul_tflops,
                           source=f"preset {node.name}: {node.source}")


def _preset(node: NodeSpec) -> Callable[[int, int], HardwareProfile]:
    def build(num_nodes: int, gpus_per_node: int) -> HardwareProfile:
        return _preset_profile(node, num_nodes, gpus_per_node)
    build.__doc__ = f"The {node.name} preset for num_nodes x gpus_per_node: {node.source}."
    return build


# name -> (num_nodes, gpus_per_node) -> HardwareProfile
PRESETS: Mapping[str, Callable[[int, int], HardwareProfile]] = types.MappingProxyType(
    {node.name: _preset(node) for node in (H100_NODE, A100_NODE)})


def load_hardware(spec: str, num_nodes: int, gpus_per_node: int) -> HardwareProfile:
    """`spec`: a preset name (PRESETS) or a directory of Galvatron hardware files. Anything else
    raises SearchInputError naming the presets."""
    if spec in PRESETS:
        return PRESETS[spec](num_nodes, gpus_per_node)
    if pathlib.Path(spec).is_dir():
        return read_hardware_dir(spec, num_nodes, gpus_per_node)
    raise SearchInputError(f"hardware {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a "
                           f"directory of hardware files")


# ----------------------------------------------------------------------------------------------
# compute rates for a directory without them (Galvatron's)
# ----------------------------------------------------------------------------------------------
_NODES: Mapping[str, NodeSpec] = types.MappingProxyType(
    {node.name: node for node in (H100_NODE, A100_NODE)})
# Our quick measurement: square matmuls of this size, the best of a few after one warm-up.
QUICK_MATMUL_SIZE = {"cuda": 4096, "cpu": 512}
QUICK_MATMUL_REPEATS = 5


def quick_matmul_tflops(dtype: str) -> tuple[float, str]:
    """Dense matmul TFLOP/s of `dtype` on this machine (its first GPU, else its CPU, one
    process): the best of QUICK_MATMUL_REPEATS square matmuls after one warm-up; and what ran."""
    import time

    import torch

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n = QUICK_MATMUL_SIZE[device.type]
    a = torch.randn(n, n, device=device).to(torch_dtype)
    b = torch.randn(n, n, device=device).to(torch_dtype)
    best = math.inf
    for repeat in range(QUICK_MATMUL_REPEATS + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if repeat:  # the first is the warm-up
            best = min(best, time.perf_counter() - start)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU, {torch.get_num_threads()} thread(s)"
    return 2 * n ** 3 / best / 1e12, f"{n}x{n} {dtype} matmul on this machine ({name})"


def with_matmul_rates(profile: HardwareProfile, dtype: str, preset: Optional[str] = None,
                      measure: Callable[[str], tuple[float, str]] = quick_matmul_tflops
                      ) -> tuple[HardwareProfile, str]:
    """The profile with a matmul rate for `dtype`, and the one line that says where it comes
    from: the preset `preset`'s datasheet rates when named (they replace the profile's); else
    the profile's own (our compute file, or a preset); else (a directory Galvatron wrote) our
    quick measurement on this machine (`quick_matmul_tflops`)."""
    if preset is not None:
        if preset not in _NODES:
            raise SearchInputError(f"--matmul-preset {preset!r} is not a preset "
                                   f"({', '.join(_NODES)})")
        rates = dict(_NODES[preset].matmul_tflops)
        how = (f"preset {preset} (datasheet: " + ", ".join(f"{d} {r:g}" for d, r in
                                                           sorted(rates.items())) + ")")
    elif dtype in profile.matmul_tflops:
        return profile, (f"matmul TFLOP/s: {dtype} {profile.matmul_tflops[dtype]:.4g} from the "
                         f"hardware profile ({profile.source.split(':')[0]})")
    else:
        tflops, what = measure(dtype)
        rates = {**profile.matmul_tflops, dtype: tflops}
        how = (f"measured: {dtype} {tflops:.4g}, quick {what}; the hardware profile has none "
               f"(--matmul-preset NAME takes a preset's instead)")
    line = f"matmul TFLOP/s: {how}"
    return dataclasses.replace(profile, matmul_tflops=rates,
                               source=f"{profile.source}; {line}"), line
