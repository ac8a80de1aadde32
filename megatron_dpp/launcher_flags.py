"""The launchers' flag assembly: the user's flags, over the launcher's defaults, over a recipe's.

A Megatron-LM user's command line must train what it says. So, as `run_scripts/_launch.sh` calls it:
- a recipe (`examples/<model>/<name>.sh`) applies only when asked for (`RECIPE=name`) or when the
  user's flags give no model shape at all (`SHAPE_FLAGS`; the README's zero-argument command
  still trains the tiny model); every other flag the user leaves out takes the trainer's default,
  which is Megatron-LM's;
- a flag the user gives replaces every recipe, strategy or launcher flag of the same choice
  (`CHOICES`: warmup by iterations, fraction or samples is one choice; so are the run's length,
  the data), and the flags that follow it (`FOLLOWERS`: a recipe's warmup and decay lengths were
  sized for its own length, its FFN width for its hidden size, a tokenizer's files and vocabulary
  for its type);
- `--dry-run` names each flag that did not come from the user, and each one the user's replaced.

Pure: no torch, no Megatron; `python -m megatron_dpp.launcher_flags` is the launchers' interface.
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from typing import Iterable, Sequence

RECIPE, STRATEGY, LAUNCHER, USER = "recipe", "strategy", "launcher", "user"
SOURCES = (RECIPE, STRATEGY, LAUNCHER, USER)
"""Where a flag comes from, weakest first: a later source's flag replaces an earlier one's."""

SHAPE_FLAGS = ("--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size",
               "--kv-channels", "--num-query-groups", "--encoder-num-layers",
               "--decoder-num-layers")
"""Flags that give a model shape: with any of them the user describes a model, and no recipe
applies unless RECIPE names one."""

_CHOICE_GROUPS = {
    "run length": ("--train-iters", "--train-samples"),
    "warmup": ("--lr-warmup-iters", "--lr-warmup-fraction", "--lr-warmup-samples"),
    "decay length": ("--lr-decay-iters", "--lr-decay-samples"),
    "WSD decay length": ("--lr-wsd-decay-iters", "--lr-wsd-decay-samples"),
    "precision": ("--fp16", "--bf16"),
    "data": ("--data-path", "--mock-data", "--train-data-path", "--valid-data-path",
             "--test-data-path", "--data-args-path", "--per-split-data-args-path"),
    "virtual pipeline": ("--num-virtual-stages-per-pipeline-rank",
                         "--num-layers-per-virtual-pipeline-stage"),
}
CHOICES: dict[str, str] = {flag: choice for choice, flags in _CHOICE_GROUPS.items()
                           for flag in flags}
"""A flag -> the choice it makes, where several flags make one choice (a flag not here is a
choice of its own)."""

FOLLOWERS: dict[str, tuple[str, ...]] = {
    "run length": ("warmup", "decay length", "WSD decay length"),
    "--tokenizer-type": ("--vocab-file", "--merge-file", "--tokenizer-model", "--vocab-size",
                         "--vocab-extra-ids", "--tiktoken-pattern", "--tiktoken-num-special-tokens",
                         "--tiktoken-special-tokens", "--tokenizer-special-tokens"),
    "data": ("--split",),
    "--hidden-size": ("--ffn-hidden-size", "--kv-channels"),
    "--num-attention-heads": ("--kv-channels", "--num-query-groups"),
    "--seq-length": ("--max-position-embeddings",),
}
"""A choice -> the choices whose value another source sized for its own value of it: a user's
choice replaces those too, so that they take the trainer's default (Megatron-LM's), which
follows the user's value (decay over the whole run, no warmup; FFN 4 x hidden; head size hidden /
heads; a split of Megatron-LM's default for the user's data; the files of the user's tokenizer).
A follower given alone replaces only itself (`--vocab-size N` keeps the tokenizer type)."""

_FLAG_WORD = re.compile(r"--[A-Za-z]")


def choice_of(name: str) -> str:
    """The choice a flag (`--name`) makes; `--no-x` makes the choice `--x` does."""
    if name in CHOICES:
        return CHOICES[name]
    if name.startswith("--no-"):
        positive = "--" + name[len("--no-"):]
        return CHOICES.get(positive, positive)
    return name


@dataclass(frozen=True)
class Flag:
    """One flag as written: its words (`--lr 3e-3`, `--save=DIR`, `--data-path 1 A 1 B`)."""

    words: tuple[str, ...]
    source: str

    @property
    def name(self) -> str:
        return self.words[0].split("=", 1)[0]

    @property
    def choice(self) -> str:
        return choice_of(self.name)

    def text(self) -> str:
        return " ".join(self.words)


def split_flags(words: Sequence[str], source: str) -> list[Flag]:
    """Words -> flags: a word `--name` (or `--name=value`) starts one, and the words up to the
    next such word are its values (a negative number is a value). Words before the first flag
    are refused: argparse would refuse them too, so the launcher says so at once."""
    flags: list[list[str]] = []
    for word in words:
        if _FLAG_WORD.match(word):
            flags.append([word])
        elif not flags:
            raise ValueError(f"{word!r} is not a flag (flags start with --) and follows none")
        else:
            flags[-1].append(word)
    return [Flag(tuple(flag), source) for flag in flags]


def gives_model_shape(flags: Iterable[Flag]) -> bool:
    return any(flag.name in SHAPE_FLAGS for flag in flags)


def _replaced_choices(choices: set[str]) -> set[str]:
    """The choices made, and those that follow them (FOLLOWERS, transitively)."""
    replaced, todo = set(), list(choices)
    while todo:
        choice = todo.pop()
        if choice not in replaced:
            replaced.add(choice)
            todo.extend(FOLLOWERS.get(choice, ()))
    return replaced


@dataclass(frozen=True)
class Assembly:
    """The trainer's flags, in order (recipe's, strategy's, launcher's, then the user's), and the
    flags the user's (or a stronger source's) replaced."""

    flags: tuple[Flag, ...]
    replaced: tuple[Flag, ...]
    recipe_applied: bool

    def words(self) -> list[str]:
        return [word for flag in self.flags for word in flag.words]

    def from_source(self, source: str) -> list[Flag]:
        return [flag for flag in self.flags if flag.source == source]


def assemble(by_source: dict[str, Sequence[str]], recipe_asked_for: bool) -> Assembly:
    """Every source's words -> the trainer's flags. The recipe's apply only when asked for or when
    the user gives no model shape; a source's flags replace the weaker sources' of the same choice
    (and those following it); the user's are kept as given (argparse's last one wins among them)."""
    parsed = {source: split_flags(by_source.get(source, ()), source) for source in SOURCES}
    recipe_applied = recipe_asked_for or not gives_model_shape(parsed[USER])
    if not recipe_applied:
        parsed[RECIPE] = []
    kept: list[Flag] = []
    replaced: list[Flag] = []
    for index, source in enumerate(SOURCES):
        later = [flag for stronger in SOURCES[index + 1:] for flag in parsed[stronger]]
        lost = _replaced_choices({flag.choice for flag in later})
        restated = {flag.words for flag in later}  # the launcher's PP, as the user's flag gave it
        for flag in parsed[source]:
            if flag.choice not in lost:
                kept.append(flag)
            elif flag.words not in restated:
                replaced.append(flag)
    order = {source: index for index, source in enumerate(SOURCES)}
    kept.sort(key=lambda flag: order[flag.source])  # stable: each source's own order kept
    return Assembly(tuple(kept), tuple(replaced), recipe_applied)


def provenance_lines(assembly: Assembly, recipe: str) -> list[str]:
    """What --dry-run prints under the command: each flag the user did not give, by source, and
    each flag the user's replaced."""
    lines = []
    names = {RECIPE: f"recipe {recipe}", STRATEGY: "the strategy file",
             LAUNCHER: "the launcher's defaults"}
    for source in (RECIPE, STRATEGY, LAUNCHER):
        flags = assembly.from_source(source)
        if flags:
            lines.append(f"from {names[source]}: " + " ".join(flag.text() for flag in flags))
    if assembly.replaced:
        lines.append("replaced by a later choice (yours or the strategy's): "
                     + " ".join(f"[{flag.source}] {flag.text()}" for flag in assembly.replaced))
    if not assembly.recipe_applied:
        lines.append(f"no recipe: your flags give the model shape, so every flag you leave out "
                     f"takes the trainer's default (Megatron-LM's); RECIPE={recipe} would fill "
                     f"them from {recipe}")
    return lines


def _split_sections(argv: Sequence[str]) -> dict[str, list[str]]:
    """`::recipe W... ::strategy W... ::launcher W... ::user W...` -> {source: words}."""
    sections: dict[str, list[str]] = {}
    current = None
    for word in argv:
        if word.startswith("::") and word[2:] in SOURCES:
            current = sections.setdefault(word[2:], [])
        elif current is None:
            raise ValueError(f"{word!r} comes before any ::SOURCE section")
        else:
            current.append(word)
    return sections


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--gives-shape"]:  # before the layout defaults: is this the user's own model?
        try:
            user = split_flags(_split_sections(argv[1:]).get(USER, []), USER)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        print("shape" if gives_model_shape(user) else "no shape")
        return 0
    parser = argparse.ArgumentParser(
        prog="python -m megatron_dpp.launcher_flags",
        description="Assemble a launcher's trainer flags: writes them NUL-separated to --output "
                    "and the --dry-run provenance lines to --provenance; prints 'recipe applied' "
                    "or 'recipe unused'. (`--gives-shape ::user WORDS...` alone prints 'shape' "
                    "or 'no shape': whether the user's flags give a model shape.)")
    parser.add_argument("--recipe", required=True, help="the recipe's name (for the lines)")
    parser.add_argument("--recipe-asked-for", action="store_true",
                        help="RECIPE was set: the recipe applies even under the user's shape")
    parser.add_argument("--output", required=True, help="file for the NUL-separated flags")
    parser.add_argument("--provenance", required=True, help="file for the provenance lines")
    parser.add_argument("sections", nargs=argparse.REMAINDER,
                        help="::recipe W... ::strategy W... ::launcher W... ::user W...")
    args = parser.parse_args(argv)
    try:
        assembly = assemble(_split_sections(args.sections), args.recipe_asked_for)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    with open(args.output, "wb") as out:
        out.write(b"".join(word.encode() + b"\0" for word in assembly.words()))
    with open(args.provenance, "w") as out:
        out.write("".join(line + "\n" for line in provenance_lines(assembly, args.recipe)))
    print("recipe applied" if assembly.recipe_applied else "recipe unused")
    return 0


if __name__ == "__main__":
    sys.exit(main())
