"""Weights & Biases logging (--wandb-project), as Megatron-LM does it.

Megatron-LM's last rank starts a run with `wandb.init(dir=..., name=--wandb-exp-name,
project=--wandb-project, config=the flags, entity=--wandb-entity)` and logs each of its TensorBoard
scalars under the same tag at the iteration as W&B's step (the `vs samples` copies are
TensorBoard's only); `wandb.finish()` at the end. Here the rank that prints the log line does it
(training/observe/tensorboard_log.py's writer, which holds the same values), every
--tensorboard-log-interval iterations, with the same flags choosing what goes in. Megatron-LM
writes W&B only where it also writes TensorBoard; here --wandb-project alone is enough.

Files go to --wandb-save-dir, or to <--save>/wandb as in Megatron-LM. W&B's own environment
variables apply (WANDB_MODE=offline keeps the run on disk for `wandb sync`). The wandb package is
not a dependency: the flag check asks for it.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Optional

from megatron_dpp.parallel.layout import flags_and_layout

# The flags' values W&B can store as the run's config (vars(args) also holds derived objects).
_CONFIG_TYPES = (str, int, float, bool, type(None), list, tuple)


@dataclass(frozen=True)
class WandbConfig:
    """--wandb-project and where its run goes."""

    project: str
    name: str  # --wandb-exp-name
    directory: str  # --wandb-save-dir, else <--save>/wandb
    entity: Optional[str]  # --wandb-entity (W&B's default: the user's own)
    run_config: dict = field(compare=False)  # the flags, as the run's config


def save_dir(args: argparse.Namespace) -> Optional[str]:
    """--wandb-save-dir, else <--save>/wandb (Megatron-LM's default), else None."""
    if args.wandb_save_dir:
        return args.wandb_save_dir
    return os.path.join(args.save, "wandb") if args.save else None


def wandb_config_from_args(args: argparse.Namespace) -> Optional[WandbConfig]:
    if not args.wandb_project:
        return None
    return WandbConfig(
        project=args.wandb_project, name=args.wandb_exp_name, directory=save_dir(args),
        entity=args.wandb_entity or None,
        run_config={name: value for name, value in flags_and_layout(args).items()
                    if isinstance(value, _CONFIG_TYPES)})


class WandbInitError(RuntimeError):
    """wandb.init failed (no API key, W&B's service out of reach, ...): one line for the user."""


class WandbRun:
    """One W&B run: scalars by tag at the iteration, finished once."""

    def __init__(self, config: WandbConfig):
        import wandb

        os.makedirs(config.directory, exist_ok=True)
        arguments = dict(dir=config.directory, name=config.name, project=config.project,
                         config=config.run_config)
        if config.entity:
            arguments["entity"] = config.entity
        self.wandb = wandb
        try:
            self.run = wandb.init(**arguments)
        except Exception as error:  # W&B's own errors are many; each becomes this one line
            detail = " ".join(str(error).split()) or type(error).__name__
            raise WandbInitError(
                f"--wandb-project: wandb.init failed: {detail} (WANDB_MODE=offline keeps the run "
                f"on disk for `wandb sync`, without W&B's service)") from error

    def scalar(self, tag: str, value: float, iteration: int) -> None:
        self.wandb.log({tag: value}, step=iteration)

    def finish(self) -> None:
        if self.run is not None:
            self.wandb.finish()
            self.run = None
