"""The checkpoint format flag (Megatron-LM's --ckpt-format); argparse's choices are its check.
Standard library only (training/flags.py adds it to the checkpointing group)."""
from __future__ import annotations

import argparse

# torch_dist: Megatron-Core's distributed checkpoint (megatron.core.dist_checkpointing), Megatron-
# LM 0.16's default; loads at another tensor/pipeline/virtual-pipeline layout. torch: our earlier
# per-rank files (rank_RRRRR.pt), which resume only at the layout that saved them.
CHECKPOINT_FORMATS = ("torch_dist", "torch")
DEFAULT_CHECKPOINT_FORMAT = "torch_dist"


def add_checkpoint_format_args(group) -> None:
    """Into the checkpointing argument group (an argparse group or parser)."""
    group.add_argument(
        "--ckpt-format", choices=CHECKPOINT_FORMATS, default=DEFAULT_CHECKPOINT_FORMAT,
        help="Format --save writes: torch_dist (default, as Megatron-LM 0.16): Megatron-Core's "
             "distributed checkpoint, which Megatron-LM reads and which resumes at another "
             "tensor/pipeline/virtual-pipeline layout, with or without --use-dpp; torch: this "
             "project's earlier per-rank files, which resume only at the same layout. --load "
             "reads either (it tells them apart by their files).")

