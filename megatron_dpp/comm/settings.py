"""Transport settings from the command line (--p2p-transport, --workload, --shm-*, --p2p-timeout)."""
from __future__ import annotations

import argparse

from megatron_dpp.comm.router import make_transport
from megatron_dpp.comm.transport import Transport


def shm_config_from_args(args: argparse.Namespace):
    import shm_tensor

    return shm_tensor.ShmConfig(
        num_slots=args.shm_num_slots,
        slot_bytes=args.shm_slot_mb << 20,
        copy_threads=args.shm_copy_threads,
        bytes_per_thread=args.workload,
        timeout_s=args.p2p_timeout,
        zero_copy_receive=args.shm_zero_copy_min_kb > 0,
        zero_copy_min_bytes=max(1, args.shm_zero_copy_min_kb) << 10,
    )


def make_transport_from_args(args: argparse.Namespace, peers=None) -> Transport:
    """make_transport(args.p2p_transport) with the --workload/--shm-*/--p2p-timeout settings."""
    shm_config = shm_config_from_args(args) if args.p2p_transport == "shm" else None
    return make_transport(args.p2p_transport, peers, shm_config=shm_config,
                          timeout_s=args.p2p_timeout)
