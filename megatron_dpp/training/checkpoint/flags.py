"""The checkpoint flags' checks that need no process group: --ckpt-format (argparse's choices are
its check), what --load may name and what it restores (LoadScope). Standard library only (training/flags.py adds --ckpt-format
to the checkpointing group and calls check_load_dir before launch; save_load.py resolves
--load at run time with the same helpers)."""
from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass

from megatron_dpp.flag_errors import require, require_input_dir

# torch_dist: Megatron-Core's distributed checkpoint (megatron.core.dist_checkpointing), Megatron-
# LM 0.16's default; loads at another tensor/pipeline/virtual-pipeline layout. torch: our earlier
# per-rank files (rank_RRRRR.pt), which resume only at the layout that saved them.
CHECKPOINT_FORMATS = ("torch_dist", "torch")
DEFAULT_CHECKPOINT_FORMAT = "torch_dist"
# Megatron-LM's layout: SAVE/iter_NNNNNNN/ and the tracker naming the latest one.
TRACKER_FILE = "latest_checkpointed_iteration.txt"
_ITERATION_FOLDER = re.compile(r"iter_(\d{7})")


def _checkpoint_format(value: str) -> str:
    """--ckpt-format's value; Megatron-LM's fsdp_dtensor (Megatron FSDP's format) refused in one
    line naming why (argparse's choices list would not)."""
    if value == "fsdp_dtensor":
        raise argparse.ArgumentTypeError(
            "fsdp_dtensor is Megatron FSDP's checkpoint format, and FSDP is not a layout here "
            "(data parallelism is Megatron-Core's DDP); use torch_dist")
    return value


def add_checkpoint_format_args(group) -> None:
    """Into the checkpointing argument group (an argparse group or parser)."""
    group.add_argument(
        "--ckpt-format", type=_checkpoint_format, choices=CHECKPOINT_FORMATS,
        default=DEFAULT_CHECKPOINT_FORMAT,
        help="Format --save writes: torch_dist (default, as Megatron-LM 0.16): Megatron-Core's "
             "distributed checkpoint, which Megatron-LM reads and which resumes at another "
             "tensor/pipeline/virtual-pipeline layout, with or without --use-dpp; torch: this "
             "project's earlier per-rank files, which resume only at the same layout. --load "
             "reads either (it tells them apart by their files).")


def add_load_scope_args(group) -> None:
    """Megatron-LM's flags for what --load restores beyond the model."""
    group.add_argument("--no-load-optim", action="store_true", default=None,  # Megatron-LM's
                       help="With --load: leave the optimizer's state and the learning-rate "
                            "schedule as this run starts them (the fp32 main parameters of "
                            "--bf16/--fp16 are taken from the loaded model).")
    group.add_argument("--no-load-rng", action="store_true", default=None,  # Megatron-LM's
                       help="With --load: leave the RNG states as --seed sets them.")
    group.add_argument("--finetune", action="store_true",
                       help="With --load: load the model only (as --no-load-optim "
                            "--no-load-rng) and start at iteration 0 at the start of the data.")


def check_load_scope_args(args) -> None:
    for flag, given in (("--finetune", args.finetune), ("--no-load-optim", args.no_load_optim),
                        ("--no-load-rng", args.no_load_rng)):
        require(not given or args.load is not None, f"{flag} needs --load DIR")


@dataclass(frozen=True)
class LoadScope:
    """What a load restores beyond the model (--no-load-optim, --no-load-rng, --finetune)."""

    optimizer: bool = True  # the optimizer's state and the learning-rate schedule
    rng: bool = True  # the RNG states (at the layout that saved them only, in any case)
    position: bool = True  # the iteration and the data position (--finetune starts at 0)

    @classmethod
    def from_args(cls, args) -> "LoadScope":
        # --skip-train never steps the optimizer: Megatron-LM then turns --no-load-optim on.
        skip_train = getattr(args, "skip_train", False)
        return cls(optimizer=not (args.finetune or args.no_load_optim or skip_train),
                   rng=not (args.finetune or args.no_load_rng), position=not args.finetune)


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


def check_load_dir(load: str, save: str | None, exit_on_missing_checkpoint: bool = False) -> None:
    """Before launch: --load names a directory with a checkpoint (a tracker or iteration folders)
    or an iteration folder. One that does not exist or holds no checkpoint starts the run from
    randomly initialized weights, as Megatron-LM's load_checkpoint does (the run says so: a
    warning, or where --load is also --save, as Megatron-LM's scripts pass it, that the first run
    starts from scratch), unless --exit-on-missing-checkpoint: then it is refused here. Raises
    ArgsError."""
    if not exit_on_missing_checkpoint and (same_directory(load, save) or not os.path.exists(load)):
        return
    require_input_dir("--load", load, "a --save directory")
    require(not exit_on_missing_checkpoint or iteration_of_folder(load) is not None
            or holds_checkpoints(load), no_checkpoint_words(load))
