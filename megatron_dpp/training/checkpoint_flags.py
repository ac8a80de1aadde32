"""The checkpoint flags' checks that need no process group: --ckpt-format (argparse's choices are
its check) and what --load may name. Standard library only (training/flags.py adds --ckpt-format
to the checkpointing group and calls check_load_dir before launch; checkpointing.py resolves
--load at run time with the same helpers)."""
from __future__ import annotations

import os
import re

from megatron_dpp.flag_errors import require, require_input_dir

# torch_dist: Megatron-Core's distributed checkpoint (megatron.core.dist_checkpointing), Megatron-
# LM 0.16's default; loads at another tensor/pipeline/virtual-pipeline layout. torch: our earlier
# per-rank files (rank_RRRRR.pt), which resume only at the layout that saved them.
CHECKPOINT_FORMATS = ("torch_dist", "torch")
DEFAULT_CHECKPOINT_FORMAT = "torch_dist"
# Megatron-LM's layout: SAVE/iter_NNNNNNN/ and the tracker naming the latest one.
TRACKER_FILE = "latest_checkpointed_iteration.txt"
_ITERATION_FOLDER = re.compile(r"iter_(\d{7})")


def add_checkpoint_format_args(group) -> None:
    """Into the checkpointing argument group (an argparse group or parser)."""
    group.add_argument(
        "--ckpt-format", choices=CHECKPOINT_FORMATS, default=DEFAULT_CHECKPOINT_FORMAT,
        help="Format --save writes: torch_dist (default, as Megatron-LM 0.16): Megatron-Core's "
             "distributed checkpoint, which Megatron-LM reads and which resumes at another "
             "tensor/pipeline/virtual-pipeline layout, with or without --use-dpp; torch: this "
             "project's earlier per-rank files, which resume only at the same layout. --load "
             "reads either (it tells them apart by their files).")


def iteration_of_folder(path: str) -> int | None:
    """N when `path` is an iteration folder iter_NNNNNNN (an existing directory), else None."""
    match = _ITERATION_FOLDER.fullmatch(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match and os.path.isdir(path) else None


def iteration_folders(path: str) -> list[str]:
    """The iter_NNNNNNN folders in `path`, oldest first."""
    try:
        names = os.listdir(path)
    except OSError:
        return []
    return sorted(name for name in names if _ITERATION_FOLDER.fullmatch(name)
                  and os.path.isdir(os.path.join(path, name)))


def holds_checkpoints(path: str) -> bool:
    return os.path.isfile(os.path.join(path, TRACKER_FILE)) or bool(iteration_folders(path))


def same_directory(path: str, other: str | None) -> bool:
    return other is not None and os.path.realpath(path) == os.path.realpath(other)


def no_checkpoint_words(load: str) -> str:
    return (f"--load {load} holds no checkpoint (no {TRACKER_FILE}, no iter_NNNNNNN folder); "
            f"point it at a --save directory or one of its iter_NNNNNNN folders, or give the same "
            f"directory to --save to start from scratch")


def check_load_dir(load: str, save: str | None) -> None:
    """Before launch: --load names a directory with a checkpoint (a tracker or iteration folders)
    or an iteration folder, unless it is also --save (Megatron-LM's scripts pass one directory to
    both: the first run starts from scratch, and says so). Raises ArgsError."""
    if same_directory(load, save):
        return
    require_input_dir("--load", load, "a --save directory")
    require(iteration_of_folder(load) is not None or holds_checkpoints(load),
            no_checkpoint_words(load))
