"""The one error type of flag validation, shared by every package's flags module (standard library
only): a bad flag or flag combination raises `ArgsError` with one line that says how to fix it, and
`megatron_dpp.arguments.parse_args` prints that line and exits with code 2.

Also the Megatron-LM flags that cannot apply here: each is still a flag, in its group, so that
--help explains it and using it is refused with the reason, not "unrecognized". A group declares
them as {flag: why it cannot apply} (the error is "FLAG REASON; remove it")."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Collection, Iterable, Mapping, Optional


class ArgsError(ValueError):
    """A bad flag or flag combination; the message is one line that says how to fix it."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ArgsError(message)


def first_given(flags: Iterable[tuple[str, object]]) -> Optional[str]:
    """The first flag of (flag, given) pairs whose `given` is truthy, or None: for the one-line
    error of a flag that needs another one."""
    return next((flag for flag, given in flags if given), None)


def _refused_dest(flag: str) -> str:
    return "refused_" + flag.lstrip("-").replace("-", "_")


def each_refused(reason: str, *flags: str) -> dict[str, str]:
    """A refused-flags table's rows for several flags refused for one reason."""
    return {flag: reason for flag in flags}


def add_refused_flags(group, refused: Mapping[str, str], taking_a_value: Collection[str] = (),
                      taking_values: Collection[str] = ()) -> None:
    """Each flag of `refused` in `group`; those in `taking_a_value` take a value in Megatron-LM (or
    nsys), those in `taking_values` several, which are optional here so that the refusal, not
    argparse, explains the problem."""
    for flag, reason in refused.items():
        if flag in taking_values:
            extra = {"nargs": "*", "metavar": "VALUE"}
        elif flag in taking_a_value:
            extra = {"nargs": "?", "const": "", "metavar": "VALUE"}
        else:
            extra = {"action": "store_const", "const": True}
        group.add_argument(flag, dest=_refused_dest(flag), default=None,
                           help=f"Refused here: {flag} {reason}.", **extra)


def check_refused_flags(args: argparse.Namespace, refused: Mapping[str, str]) -> None:
    """The first flag of `refused` given: one line with its reason."""
    for flag, reason in refused.items():
        require(getattr(args, _refused_dest(flag)) is None, f"{flag} {reason}; remove it")


# The first words of the --help of every flag that states what always holds here (StatedFlag).
ALWAYS_SO_HERE = "Accepted for Megatron-LM command lines; always so here:"


@dataclass(frozen=True)
class StatedFlag:
    """A Megatron-LM flag that asks for what always holds here: accepted (and --help says what
    holds), for the values whose meaning holds; its other values are refused in one line."""

    holds: str
    """What always holds here, for --help."""

    values: tuple[str, ...] = ()
    """The values whose meaning holds here; empty: the flag takes no value."""

    otherwise: str = ""
    """Why Megatron-LM's other values cannot apply ("FLAG VALUE OTHERWISE; use ...")."""


def _stated_dest(flag: str) -> str:
    return "stated_" + flag.lstrip("-").replace("-", "_")


def add_stated_flags(group, stated: Mapping[str, StatedFlag]) -> None:
    """Each flag of `stated` in `group`, its --help saying what always holds here."""
    for flag, spec in stated.items():
        if spec.values:
            group.add_argument(flag, dest=_stated_dest(flag), default=None, metavar="VALUE",
                               help=f"{ALWAYS_SO_HERE} {spec.holds} ({flag} "
                                    f"{' or '.join(spec.values)}; Megatron-LM's other values are "
                                    f"refused in one line).")
        else:
            group.add_argument(flag, dest=_stated_dest(flag), action="store_const", const=True,
                               default=None, help=f"{ALWAYS_SO_HERE} {spec.holds}.")


def check_stated_flags(args: argparse.Namespace, stated: Mapping[str, StatedFlag]) -> None:
    """A value of a `stated` flag whose meaning does not hold here: one line with the reason."""
    for flag, spec in stated.items():
        value = getattr(args, _stated_dest(flag))
        if spec.values and value is not None:
            require(value in spec.values,
                    f"{flag} {value} {spec.otherwise}; use {flag} {spec.values[0]} or remove it")


def require_output_dir(flag: str, path: str) -> None:
    """A flag naming a directory the run writes into (--save, --trace-dir, --data-cache-path): an
    existing writable directory, or one that can be made with its missing parents (os.makedirs),
    i.e. no file on the path and a writable nearest existing ancestor."""
    require(bool(path), f"{flag} is empty; give a directory")
    require(not os.path.exists(path) or os.path.isdir(path),
            f"{flag} {path} exists and is not a directory; pick another path")
    if os.path.isdir(path):
        require(os.access(path, os.W_OK | os.X_OK),
                f"{flag} {path}: the directory is not writable; pick a writable path")
        return
    ancestor = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    require(os.path.isdir(ancestor) and os.access(ancestor, os.W_OK | os.X_OK),
            f"{flag} {path}: cannot create it in {ancestor}; pick a writable path")


def require_input_dir(flag: str, path: str, what: str) -> None:
    """A flag naming a directory the run reads (--load): it exists, is a directory and readable.
    what: what the directory should be, for the message ("a --save directory")."""
    require(os.path.exists(path), f"{flag} {path}: no such directory; point it at {what}")
    require(os.path.isdir(path), f"{flag} {path} is not a directory; point it at {what}")
    require(os.access(path, os.R_OK | os.X_OK),
            f"{flag} {path}: the directory is not readable; point it at {what}")
