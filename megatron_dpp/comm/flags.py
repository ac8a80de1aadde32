"""The transport flags (--p2p-transport, --workload, --shm-*, --p2p-timeout, --heartbeat-*) and the
multi-node flags (--multi-node, --node-ips), and their checks: --help's "transport" and
"multi-node" groups. The defaults and the checks of the values live once, in comm/settings.py
(ShmConfig), router.py, transport.py, heartbeat.py and nodes.py; this module maps them onto
flags. megatron_dpp.arguments composes it.

The compiled shm_tensor and rdma_tensor are imported only to check a transport the flags ask for.
"""
from __future__ import annotations

import argparse
import importlib.util
import os

from megatron_dpp.comm import heartbeat
from megatron_dpp.comm.job_key import job_key_problem
from megatron_dpp.comm.nodes import (NODE_RANK_VARIABLE, NodeNetworkError, check_node_count,
                                     num_nodes, parse_node_ips, use_node_network)
from megatron_dpp.comm.defaults import DEFAULT_TIMEOUT_S, DEFAULT_TRANSPORT_KIND, TRANSPORT_KINDS
from megatron_dpp.comm.settings import SHM_DEFAULTS, check_shm_args, largest_message_bytes
from megatron_dpp.cuda_presence import cuda_available
from megatron_dpp.exit_codes import LOST_PEER
from megatron_dpp.flag_errors import ArgsError, require


# ----------------------------------------------------------------------------------------------
# point-to-point transports
# ----------------------------------------------------------------------------------------------
def add_transport_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("transport")
    group.add_argument("--p2p-transport", type=str, default=DEFAULT_TRANSPORT_KIND,
                       choices=TRANSPORT_KINDS,
                       help="Pipeline point-to-point transport. auto (default): shm_tensor between "
                            "ranks of one node (shared memory; CUDA IPC for GPU tensors), rdma_tensor "
                            "between nodes (UCX: InfiniBand/RoCE or TCP), torch.distributed only where "
                            "neither can run; each rank logs the route every peer got and why. shm: "
                            "shm_tensor on the node, torch.distributed across nodes. rdma: rdma_tensor "
                            "for every peer. torch: torch.distributed send/recv for every peer.")
    group.add_argument("--workload", type=int, default=SHM_DEFAULTS.bytes_per_thread,
                       help="shm: bytes each copy thread handles; a message gets one thread per this "
                            "many bytes, up to --shm-copy-threads (smaller messages are copied inline).")
    group.add_argument("--shm-copy-threads", type=int, default=SHM_DEFAULTS.copy_threads,
                       help="shm: most threads that copy one message.")
    group.add_argument("--shm-slot-mb", type=int, default=SHM_DEFAULTS.slot_bytes >> 20,
                       help="shm: payload MiB of one slot; every CPU pipeline message must fit in "
                            "one (GPU messages need only a descriptor there, unless torch's "
                            "expandable segments stop CUDA IPC from exporting their memory).")
    group.add_argument("--shm-num-slots", type=int, default=SHM_DEFAULTS.num_slots,
                       help="shm: slots per directed pair of ranks, 1..64 (messages in flight before a "
                            "send waits for the receiver; up to half of them may be lent to received "
                            "tensors, see --shm-zero-copy-min-kb).")
    group.add_argument("--shm-zero-copy-min-kb", type=int, default=SHM_DEFAULTS.zero_copy_min_bytes >> 10,
                       help="shm: a received CPU message of at least this many KiB borrows the slot it "
                            "arrived in (no copy out) while fewer than half the slots from that sender "
                            "are lent; 0 copies every message out.")
    group.add_argument("--p2p-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                       help="Seconds a pipeline send or receive may wait before failing with the peer "
                            "and tag it waited for.")
    group.add_argument("--heartbeat-interval", type=float, default=heartbeat.DEFAULT_INTERVAL_S,
                       help="Seconds between the heartbeats each rank sends every other rank (one "
                            "UDP datagram, from its node's --node-ips address; 127.0.0.1 on one "
                            "node), from a thread that beats while the rank computes or waits. "
                            "Each datagram is authenticated with the job's key, DPP_JOB_KEY in the "
                            "environment (hex; the one-node launcher draws one, run_slurm_*.sh "
                            "draws one for all nodes; across nodes started by hand give each node "
                            "the same, from `python -m megatron_dpp.comm.job_key new`).")
    group.add_argument("--heartbeat-timeout", type=float, default=heartbeat.DEFAULT_TIMEOUT_S,
                       help="Seconds without heartbeats, in either direction, after which a rank "
                            "declares a peer lost: it names the peer (rank, node, address, which "
                            f"direction went silent) and exits with code {LOST_PEER}. So a stopped "
                            "process, a frozen node or a link down ends the job within about this "
                            "time, while a slow but running rank (a long iteration, a checkpoint "
                            f"save) is never lost. At least {heartbeat.MIN_BEATS_PER_TIMEOUT} x "
                            "--heartbeat-interval. 0 turns heartbeats off, for a network that drops "
                            "UDP between the nodes: a silent peer then ends the job only through "
                            "--p2p-timeout, --dpp-timeout or --distributed-timeout-minutes.")


def validate_transport_args(args: argparse.Namespace) -> None:
    require(args.p2p_timeout > 0, f"--p2p-timeout must be positive seconds, got {args.p2p_timeout}")
    try:
        heartbeat.check_heartbeat_settings(args.heartbeat_interval, args.heartbeat_timeout)
    except ValueError as error:
        raise ArgsError(str(error)) from None
    key_problem = job_key_problem(os.environ)
    require(not key_problem, str(key_problem))
    if args.p2p_transport == "rdma":
        import rdma_tensor

        problem = rdma_tensor.unavailable_reason()
        require(not problem, f"--p2p-transport rdma: {problem}")
    if args.p2p_transport not in ("shm", "auto"):
        return
    # Flag units first (MiB, KiB), then the transport's own checks of the values they set.
    require(args.shm_slot_mb >= 1, "--shm-slot-mb must be at least 1")
    require(args.shm_zero_copy_min_kb >= 0,
            f"--shm-zero-copy-min-kb must be >= 0 (0 turns zero-copy receive off), got {args.shm_zero_copy_min_kb}")
    try:
        check_shm_args(args)
    except ValueError as error:
        raise ArgsError(str(error)) from None
    if args.p2p_transport == "auto":
        return  # auto falls back to torch.distributed where shm_tensor cannot run, and logs why
    require(importlib.util.find_spec("shm_tensor._C") is not None,
            "--p2p-transport shm needs the compiled shm_tensor._C; run "
            "`pip install --no-build-isolation -e .` in the repository")
    if cuda_available():
        # GPU tensors travel by CUDA IPC, which needs libcudart loadable by shm_tensor.
        import shm_tensor

        cuda_problem = shm_tensor.cuda_runtime_error()
        require(not cuda_problem,
                "--p2p-transport shm on a CUDA machine needs the CUDA runtime, which did not load ("
                + cuda_problem.replace("\n", " ") + "); use --p2p-transport torch")
    # One activation (seq x micro-batch x hidden, fp32 at most) must fit in one slot.
    needed = largest_message_bytes(args)
    if needed is not None:
        require(needed <= args.shm_slot_mb << 20,
                f"--shm-slot-mb {args.shm_slot_mb} is too small for one activation of {needed} B "
                f"(seq x micro-batch x hidden x 4); raise --shm-slot-mb to "
                f"{-(-needed // (1 << 20))}")


# ----------------------------------------------------------------------------------------------
# multi-node (the node list and its checks live in megatron_dpp.comm.nodes)
# ----------------------------------------------------------------------------------------------
def add_multinode_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multi-node")
    group.add_argument("--multi-node", action="store_true",
                       help="The job spans several nodes (torchrun --nnodes N): each node checks at "
                            "startup that its --node-ips address is one of its own and points gloo "
                            "and NCCL at that interface (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, "
                            "unless already set). Needs --node-ips.")
    group.add_argument("--node-ips", type=str, default=None, metavar="IP[,IP...]",
                       help="With --multi-node: the address of each node, InfiniBand or Ethernet, "
                            "IPv4 or IPv6, comma-separated in node-rank order (torchrun's "
                            "--node-rank), exactly one per node (torchrun's --nnodes).")


def validate_multinode_args(args: argparse.Namespace) -> None:
    if not args.multi_node:
        require(args.node_ips is None, "--node-ips needs --multi-node; add it, or drop --node-ips "
                                       "on one node")
        return
    require(args.node_ips is not None, "--multi-node needs --node-ips IP[,IP...], the address of "
                                       "each node in node-rank order")
    text = args.node_ips
    try:
        args.node_ips = parse_node_ips(text)
    except ValueError as error:
        raise ArgsError(f"--node-ips {text}: {error}") from None
    try:
        node_count = num_nodes()
    except ValueError as error:
        raise ArgsError(f"--multi-node: {error}") from None
    try:
        check_node_count(args.node_ips, node_count)
    except ValueError as error:
        raise ArgsError(f"--node-ips {text}: {error}") from None
    # This node's address must be one of its own (the startup check, training/setup.py, refuses it
    # otherwise on every rank after launch). A job of one node is node 0; on several nodes the
    # node rank is torchrun's GROUP_RANK, which the check sees in every rank (and in a pre-check
    # that sets it).
    if node_count == 1:
        node_rank = 0
    elif os.environ.get(NODE_RANK_VARIABLE) is not None:
        try:
            node_rank = int(os.environ[NODE_RANK_VARIABLE])
        except ValueError:
            raise ArgsError(f"--multi-node: {NODE_RANK_VARIABLE}="
                            f"{os.environ[NODE_RANK_VARIABLE]!r} (the rank of this node) is not an "
                            f"integer") from None
    else:
        return
    try:  # on a copy of the environment: the startup check sets the socket variables itself
        use_node_network(args.node_ips, node_rank, environ=dict(os.environ))
    except NodeNetworkError as error:
        one_node = ("; on one node, drop --multi-node and --node-ips" if node_count == 1 else "")
        raise ArgsError(f"{error}{one_node}") from None
