"""Transport settings from the command line (--p2p-transport, --workload, --shm-*, --p2p-timeout,
--multi-node/--node-ips).

The shm flags' defaults are shm_tensor.ShmConfig's (pure Python, shm_tensor/config.py), and their
checks are ShmConfig.validate(): each lives once. Reading them loads no compiled code.
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Optional

from rdma_tensor.config import RdmaConfig
from shm_tensor.config import ShmConfig, ShmConfigError

if TYPE_CHECKING:
    from megatron_dpp.comm.transport import Transport

SHM_DEFAULTS = ShmConfig()

# ShmConfig field -> the flag that sets it, so a failed check names the flag.
SHM_FLAG_OF_FIELD = {
    "num_slots": "--shm-num-slots",
    "slot_bytes": "--shm-slot-mb",
    "copy_threads": "--shm-copy-threads",
    "bytes_per_thread": "--workload",
    "timeout_s": "--p2p-timeout",
    "zero_copy_min_bytes": "--shm-zero-copy-min-kb",
}


def shm_config_from_args(args: argparse.Namespace) -> ShmConfig:
    return ShmConfig(
        num_slots=args.shm_num_slots,
        slot_bytes=args.shm_slot_mb << 20,
        copy_threads=args.shm_copy_threads,
        bytes_per_thread=args.workload,
        timeout_s=args.p2p_timeout,
        zero_copy_receive=args.shm_zero_copy_min_kb > 0,
        zero_copy_min_bytes=max(1, args.shm_zero_copy_min_kb) << 10,
    )


def check_shm_args(args: argparse.Namespace) -> None:
    """ShmConfig.validate() on the flags' values; ValueError whose message starts with the flag."""
    try:
        shm_config_from_args(args).validate()
    except ShmConfigError as error:
        flag = SHM_FLAG_OF_FIELD.get(error.field)
        if flag is None:  # a setting no flag sets: the flags cannot have caused it
            raise
        raise ValueError(f"{flag}: {error}") from None


def largest_message_bytes(args: argparse.Namespace) -> Optional[int]:
    """One activation (seq x micro-batch x hidden, fp32 at most): the largest pipeline message;
    None when the flags do not say (a transport test without a model)."""
    sizes = [getattr(args, name, None) for name in ("seq_length", "micro_batch_size", "hidden_size")]
    if None in sizes:
        return None
    seq, mbs, hidden = sizes
    return seq * mbs * hidden * 4


def rdma_config_from_args(args: argparse.Namespace) -> RdmaConfig:
    return RdmaConfig(timeout_s=args.p2p_timeout)


def make_transport_from_args(args: argparse.Namespace, peers=None) -> "Transport":
    """make_transport(args.p2p_transport) with the --workload/--shm-*/--p2p-timeout settings and,
    with --multi-node, the nodes of --node-ips."""
    from megatron_dpp.comm.router import make_transport  # torch: not needed to check the flags

    kind = args.p2p_transport
    return make_transport(
        kind, peers,
        shm_config=shm_config_from_args(args) if kind in ("shm", "auto") else None,
        rdma_config=rdma_config_from_args(args) if kind in ("rdma", "auto") else None,
        timeout_s=args.p2p_timeout,
        node_ips=args.node_ips if getattr(args, "multi_node", False) else None,
        max_message_bytes=largest_message_bytes(args))
