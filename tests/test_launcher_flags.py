"""A Megatron-LM user's command line trains what it says (megatron_dpp/launcher_flags.py, called by
run_scripts/_launch.sh):

(a) the assembly: a recipe applies only when RECIPE names it or the user gives no model shape; a
    user's flag replaces every recipe, strategy or launcher flag of the same choice, and those
    whose defaults follow it; the user's own flags are kept as given;
(b) the launchers' --dry-run, table-driven over the families of conflicts that the injected flags
    caused: a flag the user leaves out is absent from the command (the trainer's default, which is
    Megatron-LM's), a user flag is never refused because of a recipe's, and the lines under the
    command name every flag that did not come from the user.
"""
from __future__ import annotations

import shlex
import subprocess

import pytest

from _train_util import REPO_ROOT, _env, ensure_sample_data
from megatron_dpp.launcher_flags import (LAUNCHER, RECIPE, STRATEGY, USER, assemble,
                                         choice_of, split_flags)

SCRIPTS = REPO_ROOT / "run_scripts"
_LAUNCH_VARIABLES = ("NNODES", "NODE_RANK", "NODE_IPS", "MASTER_ADDR", "MASTER_PORT", "NPROC",
                     "PP", "TP", "VPP", "USE_DPP", "RECIPE", "DATA_ARGS", "DATA_DIR", "DPP_VENV")


# ----------------------------------------------------------------------------------------------
# (a) the assembly
# ----------------------------------------------------------------------------------------------
TINY_RECIPE = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
               "--ffn-hidden-size", "512", "--seq-length", "128", "--max-position-embeddings",
               "128", "--train-iters", "60", "--lr", "3e-3", "--lr-warmup-iters", "5",
               "--lr-decay-iters", "60", "--adam-beta2", "0.95", "--no-bias-gelu-fusion"]
SAMPLE = ["--data-path", "S/doc", "--vocab-file", "S/vocab.json", "--merge-file", "S/merges.txt",
          "--split", "98,2,0", "--pipeline-model-parallel-size", "2", "--use-dpp"]


def _assembled(user, recipe_asked_for=False, strategy=()):
    assembly = assemble({RECIPE: TINY_RECIPE, STRATEGY: list(strategy), LAUNCHER: SAMPLE,
                         USER: user}, recipe_asked_for)
    return assembly, {flag.text() for flag in assembly.flags}, {f.text() for f in assembly.replaced}


ASSEMBLY_CASES = {
    # name: (user flags, kept, replaced)
    "no flags: the recipe and the sample data": (
        [], {"--num-layers 4", "--lr-warmup-iters 5", "--data-path S/doc", "--split 98,2,0"}, set()),
    "warmup as a fraction replaces the recipe's warmup iterations": (
        ["--lr-warmup-fraction", "0.01"], {"--lr-warmup-fraction 0.01", "--train-iters 60"},
        {"--lr-warmup-iters 5"}),
    "a length in samples replaces the recipe's length and its schedule lengths": (
        ["--train-samples", "640"], {"--train-samples 640", "--lr 3e-3"},
        {"--train-iters 60", "--lr-warmup-iters 5", "--lr-decay-iters 60"}),
    "a length in iterations does too (the recipe's warmup was sized for its own length)": (
        ["--train-iters", "1"], {"--train-iters 1"},
        {"--train-iters 60", "--lr-warmup-iters 5", "--lr-decay-iters 60"}),
    "a tokenizer replaces the sample's tokenizer files, not its data": (
        ["--tokenizer-type", "NullTokenizer", "--vocab-size", "50304"],
        {"--tokenizer-type NullTokenizer", "--data-path S/doc", "--split 98,2,0"},
        {"--vocab-file S/vocab.json", "--merge-file S/merges.txt"}),
    "a vocabulary size alone keeps the tokenizer and its files": (
        ["--vocab-size", "1024"], {"--vocab-size 1024", "--vocab-file S/vocab.json"}, set()),
    "the user's data replaces the sample data and its split": (
        ["--mock-data"], {"--mock-data", "--vocab-file S/vocab.json"},
        {"--data-path S/doc", "--split 98,2,0"}),
    "a --flag=value form is the same choice": (
        ["--lr-warmup-samples=32"], {"--lr-warmup-samples=32"}, {"--lr-warmup-iters 5"}),
    "a --no- flag makes its positive flag's choice": (
        ["--bias-gelu-fusion"], {"--bias-gelu-fusion"}, {"--no-bias-gelu-fusion"}),
    "the launcher's layout flag restated by the user is not 'replaced'": (
        ["--pipeline-model-parallel-size", "2"], {"--pipeline-model-parallel-size 2"}, set()),
}


@pytest.mark.parametrize("user, kept, replaced", ASSEMBLY_CASES.values(), ids=ASSEMBLY_CASES)
def test_a_users_choice_replaces_the_same_choice_of_the_recipe_and_launcher(user, kept, replaced):
    assembly, flags, lost = _assembled(user)
    assert assembly.recipe_applied
    assert kept <= flags, kept - flags
    assert lost == replaced
    assert not (lost & flags)


def test_a_model_shape_means_no_recipe_and_the_recipe_when_asked_for():
    shape = ["--num-layers", "12", "--hidden-size", "512", "--num-attention-heads", "8"]
    assembly, flags, lost = _assembled(shape)
    assert not assembly.recipe_applied and lost == set()
    assert not any(flag.source == RECIPE for flag in assembly.flags)
    assert {"--num-layers 12", "--data-path S/doc"} <= flags
    # RECIPE named: the recipe fills the rest; the width's followers take the trainer's defaults.
    assembly, flags, lost = _assembled(["--hidden-size", "256"], recipe_asked_for=True)
    assert assembly.recipe_applied
    assert {"--hidden-size 256", "--num-layers 4", "--adam-beta2 0.95"} <= flags
    assert lost == {"--hidden-size 128", "--ffn-hidden-size 512"}
    # A longer sequence: the recipe's position table follows it (the trainer's default is the length).
    _, flags, lost = _assembled(["--seq-length", "256"], recipe_asked_for=True)
    assert lost == {"--seq-length 128", "--max-position-embeddings 128"}


def test_the_users_flags_come_last_and_are_kept_as_given():
    assembly, _, _ = _assembled(["--lr", "1e-4", "--lr", "2e-4", "--save=out"])
    words = assembly.words()
    assert words[-5:] == ["--lr", "1e-4", "--lr", "2e-4", "--save=out"]
    assert "3e-3" not in words  # the recipe's --lr went


def test_a_strategy_replaces_the_recipe_and_the_user_the_strategy():
    strategy = ["--hidden-size", "256", "--ffn-hidden-size", "1024", "--micro-batch-size", "4"]
    assembly, flags, lost = _assembled(["--micro-batch-size", "2"], strategy=strategy)
    assert assembly.recipe_applied  # the user gave no shape; the strategy's is not the user's
    assert {"--hidden-size 256", "--ffn-hidden-size 1024", "--micro-batch-size 2"} <= flags
    assert {"--hidden-size 128", "--ffn-hidden-size 512", "--micro-batch-size 4"} <= lost


def test_words_split_into_flags():
    flags = split_flags(["--data-path", "0.5", "A", "0.5", "B", "--init-method-std", "-1",
                         "--use-dpp"], USER)
    assert [flag.words for flag in flags] == [("--data-path", "0.5", "A", "0.5", "B"),
                                              ("--init-method-std", "-1"), ("--use-dpp",)]
    with pytest.raises(ValueError, match="'stray' is not a flag"):
        split_flags(["stray", "--lr", "1"], USER)
    assert choice_of("--lr-warmup-fraction") == choice_of("--lr-warmup-iters")
    assert choice_of("--lr") == "--lr"


# ----------------------------------------------------------------------------------------------
# (b) the launchers' --dry-run
# ----------------------------------------------------------------------------------------------
def _dry_run(model: str, flags: list[str], **variables: str) -> subprocess.CompletedProcess:
    env = _env()
    for name in _LAUNCH_VARIABLES:
        env.pop(name, None)
    env["DATA_DIR"] = str(ensure_sample_data())
    env.update(variables)
    return subprocess.run(["bash", str(SCRIPTS / f"run_single_{model}.sh"), "--dry-run", *flags],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)


def _command(stdout: str) -> list[str]:
    (line,) = [line for line in stdout.splitlines() if line.startswith("node 0: ")]
    argv = shlex.split(line[len("node 0: "):])
    return argv[argv.index("-m", argv.index("megatron_dpp.rank_launcher")) + 2:]


def _flag_values(argv: list[str]) -> dict[str, list[str]]:
    """Each flag of the trainer's command -> its values (the last one given)."""
    return {flag.name: list(flag.words[1:]) for flag in split_flags(argv, USER)}


SHAPE = ["--num-layers", "12", "--hidden-size", "512", "--num-attention-heads", "8",
         "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "1",
         "--global-batch-size", "8", "--train-iters", "10", "--lr", "1e-4"]
# Flags of each recipe that a user who gives a model shape must not receive (Megatron-LM's
# defaults differ: FFN 4 x hidden, dropout 0.1, beta2 0.999, no warmup, min-lr 0, linear decay
# for BERT, multi-head attention for Llama).
NOT_INJECTED = {"gpt": ["--ffn-hidden-size", "--hidden-dropout", "--attention-dropout",
                        "--adam-beta2", "--lr-warmup-iters", "--min-lr", "--lr-decay-style"],
                "bert": ["--ffn-hidden-size", "--lr-decay-style", "--lr-warmup-iters"],
                "llama": ["--ffn-hidden-size", "--num-query-groups", "--lr-warmup-iters"]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", sorted(NOT_INJECTED))
def test_a_user_with_a_model_shape_gets_megatron_lms_defaults(model):
    result = _dry_run(model, SHAPE)
    assert result.returncode == 0, result.stderr
    values = _flag_values(_command(result.stdout))
    for flag in NOT_INJECTED[model]:
        assert flag not in values, (flag, values)
    assert values["--hidden-size"] == ["512"] and values["--lr"] == ["1e-4"]
    assert "no recipe (your model shape)" in result.stdout
    assert "takes the trainer's default (Megatron-LM's)" in result.stdout
    # What the launcher adds is named: the sample data, the layout, the schedule.
    (launcher_line,) = [line for line in result.stdout.splitlines()
                        if "from the launcher's defaults: " in line]
    # Megatron-LM's layout for the user's own model: no pipeline unless asked for.
    assert "--data-path" in launcher_line and "--pipeline-model-parallel-size 1" in launcher_line
    assert "TP=1 PP=1" in result.stdout
    assert "from recipe" not in result.stdout


CONFLICTS = {
    # name: (model, user flags, variables, the user's flag kept, recipe/launcher flags gone)
    "warmup fraction": ("gpt", ["--lr-warmup-fraction", "0.01"], {},
                        {"--lr-warmup-fraction": ["0.01"]}, ["--lr-warmup-iters"]),
    "length in samples": ("gpt", ["--train-samples", "640"], {}, {"--train-samples": ["640"]},
                          ["--train-iters", "--lr-warmup-iters"]),
    "one iteration": ("gpt", ["--train-iters", "1"], {}, {"--train-iters": ["1"]},
                      ["--lr-warmup-iters"]),
    "NullTokenizer": ("gpt", ["--tokenizer-type", "NullTokenizer", "--vocab-size", "50304"], {},
                      {"--tokenizer-type": ["NullTokenizer"]}, ["--vocab-file", "--merge-file"]),
    "Llama at TP=4": ("llama", [], {"TP": "4", "NPROC": "8"},
                      {"--tensor-model-parallel-size": ["4"]}, []),
    "BERT warmup fraction": ("bert", ["--lr-warmup-fraction", "0.01"], {},
                             {"--lr-warmup-fraction": ["0.01"]}, ["--lr-warmup-iters"]),
    "layout as a flag": ("gpt", ["--pipeline-model-parallel-size", "1"], {},
                         {"--pipeline-model-parallel-size": ["1"]}, ["--use-dpp"]),
    # examples/llama/train_llama3_8b_h100_fp8.sh word-splits "--split '99,1,0'": the quotes stay
    "a split in the shell's quotes": ("gpt", ["--split", "'99,1,0'"], {},
                                      {"--split": ["'99,1,0'"]}, []),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model, flags, variables, kept, gone", CONFLICTS.values(), ids=CONFLICTS)
def test_a_recipe_never_refuses_the_users_own_flags(model, flags, variables, kept, gone):
    """Each family of the conflicts the recipes' flags caused: the run is accepted (the flag check
    passes), the user's flag is in the command, the recipe's flag of the same choice is not."""
    result = _dry_run(model, flags, **variables)
    assert result.returncode == 0, result.stderr
    values = _flag_values(_command(result.stdout))
    for flag, value in kept.items():
        assert values.get(flag) == value, (flag, values.get(flag))
    for flag in gone:
        assert flag not in values, (flag, values)


@pytest.mark.timeout(120)
def test_dry_run_names_each_flag_that_did_not_come_from_the_user():
    result = _dry_run("gpt", ["--lr-warmup-fraction", "0.01", "--lr", "1e-3"])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    (recipe_line,) = [line for line in lines if "from recipe gpt3_tiny: " in line]
    (launcher_line,) = [line for line in lines if "from the launcher's defaults: " in line]
    (replaced_line,) = [line for line in lines if "replaced by a later choice" in line]
    command = _command(result.stdout)
    # Every word of the command is the user's or named on one of the lines.
    named = split_flags(recipe_line.split(": ", 2)[2].split(), RECIPE) + \
        split_flags(launcher_line.split(": ", 2)[2].split(), LAUNCHER)
    theirs = {flag.words for flag in split_flags(command, USER)} - \
        {("--lr-warmup-fraction", "0.01"), ("--lr", "1e-3")}
    assert theirs == {flag.words for flag in named}
    assert "[recipe] --lr-warmup-iters 5" in replaced_line and "[recipe] --lr 3e-3" in replaced_line


@pytest.mark.timeout(60)
def test_layout_given_twice_and_disagreeing_is_one_line():
    result = _dry_run("gpt", ["--pipeline-model-parallel-size", "4"], PP="2")
    errors = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(errors) == 1, result.stderr
    assert "PP=2 and --pipeline-model-parallel-size 4 disagree" in errors[0]
    result = _dry_run("gpt", ["--tensor-model-parallel-size", "x"])
    assert result.returncode == 2 and "--tensor-model-parallel-size x is not a positive" in result.stderr
