"""The forward-backward function a training iteration calls.

`build_forward_backward(args)` returns a callable with Megatron-Core's forward_backward_func keyword
signature (forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
decoder_seq_length, forward_only, ...). The choice depends on the flags: Megatron's own schedule
(no pipelining, 1F1B or interleaved 1F1B, picked from parallel_state), a transport-backed variant,
or the dynamic pipeline runtime.
"""
from __future__ import annotations

import argparse
from typing import Callable

from megatron.core.pipeline_parallel import get_forward_backward_func


def build_forward_backward(args: argparse.Namespace) -> Callable:
    """Call after parallel_state is initialized (Megatron picks its schedule from it)."""
    if getattr(args, "use_dpp", False):
        return _build_dpp(args)
    return get_forward_backward_func()


def _build_dpp(args: argparse.Namespace) -> Callable:
    """--use-dpp: forward_backward_dpp over the --p2p-transport transport."""
    from megatron_dpp.comm import make_transport
    from megatron_dpp.schedule.dpp_config import DPPConfig
    from megatron_dpp.schedule.runtime import make_forward_backward_dpp

    config = DPPConfig(policy=args.dpp_policy, memory_budget_bytes=args.dpp_memory_budget_bytes,
                       timeout_s=args.dpp_timeout)
    return make_forward_backward_dpp(config, make_transport(args.p2p_transport))
