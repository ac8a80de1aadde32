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

Megatron-Core's version must match the tag's (0.16.1 for core_v0.16.1).
"""
from __future__ import annotations

import argparse
import ast
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


def main() -> None:
    git_dir, tag = sys.argv[1], sys.argv[2]
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        training_dir = _training_package(git_dir, tag, Path(tmp))
        parser = _megatron_lm_parser(training_dir)
        literal = _literal_option_strings((training_dir / "arguments.py").read_text())
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
