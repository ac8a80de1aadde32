"""Write Megatron-LM's whole training flag list (tests/data/megatron_lm_core_v0.16.1_flags.txt).

The list is what Megatron-LM's own parser holds: megatron/training/arguments.py at a tag, read
from a git directory, builds its parser (add_megatron_arguments) on the Megatron-Core installed
here, so the flags it generates from Megatron-Core's config dataclasses (TransformerConfig, ...)
and the --no-... forms of its BooleanOptionalAction flags are in it; a scan of the file's source
adds the option strings of add_argument calls that only run where an optional package is present
(the NVIDIA Kitchen flags). One flag a line; a flag that takes a value is followed by a plausible
one (its first choice, else its default, else one of its type), for tests/test_megatron_flag_list.py.

    python tools/megatron_lm_flags.py /work/.mirror/NVIDIA+Megatron-LM/repo core_v0.16.1 \
        > tests/data/megatron_lm_core_v0.16.1_flags.txt

With --defaults it writes instead, as JSON, the value each destination of that parser holds when no
flag is given (its parse of an empty command line, with LOCAL_RANK and WORLD_SIZE unset: two
defaults read them), for tests/test_megatron_lm_defaults.py; its "_made_by" key holds the command,
"_flag_dests" each flag's destination. What Megatron-LM's validate_args derives later from other
flags (ffn_hidden_size = 4 x hidden, global_batch_size = micro x data-parallel, ...) is not in it:

    python tools/megatron_lm_flags.py /work/.mirror/NVIDIA+Megatron-LM/repo core_v0.16.1 \
        --defaults > tests/data/megatron_lm_core_v0.16.1_defaults.json

Megatron-Core's version must match the tag's (0.16.1 for core_v0.16.1).
"""
from __future__ import annotations

import argparse
import ast
import enum
import json
import os
import subprocess
import sys
import tempfile
import types
import warnings
from pathlib import Path


def _training_package(git_dir: str, tag: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", git_dir, "archive", tag, "megatron/training"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "x", "-C", str(into)], input=archive, check=True)
    return into / "megatron" / "training"


def _megatron_lm_parser(training_dir: Path) -> argparse.ArgumentParser:
    """Megatron-LM's parser, imported without megatron/training/__init__.py (which starts its
    whole training stack) and with its utils module's four helpers that arguments.py imports
    (used only when it validates, which this never does) left out."""
    package = types.ModuleType("megatron.training")
    package.__path__ = [str(training_dir)]
    sys.modules["megatron.training"] = package
    utils = types.ModuleType("megatron.training.utils")
    for name in ("get_device_arch_version", "update_use_dist_ckpt", "print_rank_0", "warn_rank_0"):
        setattr(utils, name, lambda *args, **kwargs: None)
    sys.modules["megatron.training.utils"] = utils
    from megatron.training.arguments import add_megatron_arguments

    return add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


def _literal_option_strings(source: str) -> set[str]:
    """The "--..." string constants of every add_argument call in the source."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            found.update(arg.value for arg in node.args if isinstance(arg, ast.Constant)
                         and isinstance(arg.value, str) and arg.value.startswith("--"))
    return found


def _example_value(action: argparse.Action) -> str | None:
    """None for a flag without a value; else a value it accepts."""
    if action.nargs == 0:
        return None
    if action.choices:
        choice = list(action.choices)[0]
        return str(getattr(choice, "name", choice))
    if action.default not in (None, "", [], ()) and not isinstance(action.default, bool):
        default = action.default[0] if isinstance(action.default, (list, tuple)) else action.default
        return str(getattr(default, "name", default))
    kind = action.type
    return "1" if kind is int else "0.5" if kind is float else "x"


def _json_value(value):
    """A default as JSON: an enum member by its name (AttnBackend.auto -> "auto", as the flag's
    value is written), a tuple as a list; None, bools, numbers, strings and lists as they are."""
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        return [_json_value(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"no JSON form for the default {value!r}")


def _write_defaults(parser: argparse.ArgumentParser, tag: str) -> None:
    """{"_made_by": the command, "_flag_dests": {flag: dest}, dest: default, ...} to stdout."""
    defaults = vars(parser.parse_args([]))
    flag_dests = {option: action.dest for action in parser._actions
                  for option in action.option_strings if option.startswith("--")
                  and option != "--help"}
    document = {"_made_by": f"python tools/megatron_lm_flags.py GIT_DIR {tag} --defaults "
                            f"(GIT_DIR: a clone of NVIDIA/Megatron-LM; Megatron-Core of the same "
                            f"version installed)",
                "_flag_dests": dict(sorted(flag_dests.items())),
                **{dest: _json_value(defaults[dest]) for dest in sorted(defaults)}}
    json.dump(document, sys.stdout, indent=1)
    print()


def main() -> None:
    git_dir, tag = sys.argv[1], sys.argv[2]
    write_defaults = sys.argv[3:] == ["--defaults"]
    warnings.simplefilter("ignore")
    # --local-rank's and --world-size's defaults are these variables' values (0 and 1 unset).
    for name in ("LOCAL_RANK", "WORLD_SIZE"):
        os.environ.pop(name, None)
    with tempfile.TemporaryDirectory() as tmp:
        training_dir = _training_package(git_dir, tag, Path(tmp))
        parser = _megatron_lm_parser(training_dir)
        literal = _literal_option_strings((training_dir / "arguments.py").read_text())
    if write_defaults:
        _write_defaults(parser, tag)
        return
    values: dict[str, str | None] = {}
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--") and option != "--help":
                values[option] = _example_value(action)
    for option in literal - set(values):  # added only where their optional package is installed
        values[option] = "x"
    print(f"# Megatron-LM {tag}'s training flags (megatron/training/arguments.py), {len(values)} "
          f"option strings, made by:")
    print(f"#   python tools/megatron_lm_flags.py GIT_DIR {tag} > THIS_FILE")
    print("# (GIT_DIR: a clone of NVIDIA/Megatron-LM; Megatron-Core of the same version installed).")
    print("# One flag a line; a flag that takes a value is followed by a plausible one.")
    for option in sorted(values):
        print(option if values[option] is None else f"{option} {values[option]}")


if __name__ == "__main__":
    main()
