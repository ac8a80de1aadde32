"""What a rank prints, and which rank prints the loss."""
from __future__ import annotations

import sys
from datetime import datetime

import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dpp.stage_placement import holds_the_loss


def is_logging_rank() -> bool:
    """The rank that holds the loss and prints: last pipeline stage, first tp and dp rank."""
    return (holds_the_loss()
            and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank() == 0)


def log(message: str) -> None:
    # One write, so that another rank's line (on the same terminal) cannot land inside it.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def log_rank0(message: str) -> None:
    if dist.get_rank() == 0:
        log(message)


def log_datetime(label: str) -> None:
    """Megatron-LM's print_datetime: every rank gets there, then rank 0 prints the time."""
    dist.barrier()
    log_rank0(f"[{label}] datetime: {datetime.now().strftime('%Y-%m-%d %H:%M:%S')}")
