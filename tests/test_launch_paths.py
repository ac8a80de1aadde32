"""Paths are the caller's: a launcher run from another directory reads every relative path (the
trainer's path flags, blends of --data-path, DATA_DIR, DATA_ARGS, DPP_VENV) from that directory, and
its --dry-run command carries them absolute (run_scripts/_launch.sh, launch_resolve_paths). Every
recipe under examples/ is also a script: run directly it launches run_single_<model>.sh with itself
as RECIPE, or says in one line how to run it (exit 2)."""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from _train_util import REPO_ROOT, _env, ensure_sample_data

SCRIPTS = REPO_ROOT / "run_scripts"
LAUNCH = SCRIPTS / "_launch.sh"
# The recipes; examples/*/train_*.sh are Megatron-LM's example scripts (tests/test_example_scripts.py).
RECIPES = sorted(path for path in (REPO_ROOT / "examples").glob("*/*.sh")
                 if not path.name.startswith("train_"))
MODEL_OF_DIR = {"gpt3": "gpt", "bert": "bert", "llama": "llama"}
_LAUNCH_VARIABLES = ("NNODES", "NODE_RANK", "NODE_IPS", "MASTER_ADDR", "MASTER_PORT", "NPROC",
                     "PP", "TP", "VPP", "USE_DPP", "RECIPE", "DATA_ARGS", "DATA_DIR", "DPP_VENV")


def _script_env(**variables: str) -> dict:
    env = _env()
    for name in [*_LAUNCH_VARIABLES, *(name for name in env if name.startswith("SLURM_"))]:
        env.pop(name, None)
    env["DATA_DIR"] = str(ensure_sample_data())
    env.update(variables)
    return env


def _run(command, cwd, timeout=100, **variables: str) -> subprocess.CompletedProcess:
    """Runs command in its own process group; on a timeout the whole group is killed."""
    process = subprocess.Popen(command, cwd=cwd, env=_script_env(**variables), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{' '.join(map(str, command))} ran past {timeout} s:\n{stdout[-3000:]}\n"
                    f"{stderr[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _node_commands(stdout: str) -> dict[int, list[str]]:
    """'node R: <torchrun command>' lines of --dry-run -> {R: argv}."""
    commands = {}
    for line in stdout.splitlines():
        if line.startswith("node "):
            rank, command = line[len("node "):].split(": ", 1)
            commands[int(rank)] = shlex.split(command)
    return commands


def _values(argv: list[str], flag: str) -> list[str]:
    """The words after the last `flag` up to the next flag."""
    start = len(argv) - 1 - argv[::-1].index(flag) + 1
    end = start
    while end < len(argv) and not argv[end].startswith("-"):
        end += 1
    return argv[start:end]


def _same(path: str, expected: Path) -> bool:
    return os.path.isabs(path) and Path(os.path.normpath(path)).resolve() == expected.resolve()


def _user_dir(tmp_path: Path) -> Path:
    """A user's directory outside the repository with its own data (the GPT and BERT sample files)
    and a checkpoint directory to --load."""
    user = tmp_path / "user"
    (user / "d").mkdir(parents=True)
    sample = ensure_sample_data()
    for name in ("sample_text_document.bin", "sample_text_document.idx", "vocab.json", "merges.txt",
                 "sample_bert_text_sentence.bin", "sample_bert_text_sentence.idx", "bert-vocab.txt"):
        shutil.copy(sample / name, user / "d" / name)
    (user / "ckpt").mkdir()  # with a tracker: --load of a folder without a checkpoint is refused
    (user / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2\n")
    return user


# ----------------------------------------------------------------------------------------------
# launch_resolve_paths itself (bash only, no Python)
# ----------------------------------------------------------------------------------------------
def _resolve_in_bash(cwd: Path, flags: list[str], home: str = "/home/someone") -> list[str]:
    script = (f"source {shlex.quote(str(LAUNCH))}; ALL_FLAGS=({' '.join(map(shlex.quote, flags))});"
              ' launch_resolve_paths; printf "%s\\n" "${ALL_FLAGS[@]}"')
    done = subprocess.run(["bash", "-c", script], cwd=cwd, capture_output=True, text=True, timeout=30,
                          env={**_env(), "HOME": home})
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_resolve_paths_makes_every_path_flag_absolute_and_nothing_else(tmp_path):
    flags = ["--num-layers", "4", "--data-path", "d/x", "--split", "98,2,0",
             "--data-path", "0.3", "./a", "0.7", "/b/c",  # a blend: the prefixes only
             "--vocab-file=v.json", "--merge-file", "m.txt", "--save", "s", "--load=./l",
             "--trace-dir", "../t", "--data-cache-path", ".", "--save-interval", "5",
             "--vocab-file", "~/vocab.json", "--data-path", "1", "2", "3",  # odd: for the check
             "--load"]  # no value: for the check
    t = str(tmp_path)
    assert _resolve_in_bash(tmp_path, flags) == [
        "--num-layers", "4", "--data-path", f"{t}/d/x", "--split", "98,2,0",
        "--data-path", "0.3", f"{t}/a", "0.7", "/b/c",
        f"--vocab-file={t}/v.json", "--merge-file", f"{t}/m.txt", "--save", f"{t}/s",
        f"--load={t}/l", "--trace-dir", f"{t}/../t", "--data-cache-path", t, "--save-interval", "5",
        "--vocab-file", "/home/someone/vocab.json", "--data-path", "1", "2", "3", "--load"]


def test_every_path_flag_of_the_trainer_is_resolved():
    """A new path-valued trainer flag (…-path, …-file, …-dir, --save, --load) must join
    LAUNCH_PATH_FLAGS, or a relative value would be read from the repository root."""
    from megatron_dpp.arguments import REFUSED_FLAGS, build_parser
    listed = subprocess.run(["bash", "-c", f'source {shlex.quote(str(LAUNCH))};'
                             ' printf "%s\\n" "${LAUNCH_PATH_FLAGS[@]}"'],
                            capture_output=True, text=True, timeout=30).stdout.split()
    for model in MODEL_OF_DIR.values():
        parser = build_parser(model=model)
        path_flags = {option for action in parser._actions if action.nargs != 0
                      for option in action.option_strings
                      if option.startswith("--") and option not in REFUSED_FLAGS  # never run
                      and (option in ("--save", "--load") or
                           option.endswith(("-path", "-file", "-dir")))}
        assert path_flags <= set(listed), (model, sorted(path_flags - set(listed)))


# ----------------------------------------------------------------------------------------------
# the flag check every launch runs first
# ----------------------------------------------------------------------------------------------
# A sitecustomize.py that makes importing torch or Megatron-Core fail in every Python it starts.
_BLOCK_TORCH_AND_MEGATRON = """import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "megatron"):
            raise ImportError(f"blocked by the test: {name}")
        return None
sys.meta_path.insert(0, _Block())
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", sorted(set(MODEL_OF_DIR.values())))
def test_the_flag_check_before_launch_loads_neither_torch_nor_megatron(tmp_path, model):
    """Every launch checks its flags (`python -m megatron_dpp.arguments`) before it starts a rank:
    without torch (3-4 s to import) a dry run or a refused flag answers in a fraction of a second."""
    (tmp_path / "sitecustomize.py").write_text(_BLOCK_TORCH_AND_MEGATRON)
    script = ["bash", str(SCRIPTS / f"run_single_{model}.sh"), "--dry-run"]
    accepted = _run(script, cwd=tmp_path, PYTHONPATH=str(tmp_path))
    assert accepted.returncode == 0, accepted.stderr[-3000:]
    assert list(_node_commands(accepted.stdout)) == [0], accepted.stdout
    refused = _run([*script, "--micro-batch-size", "0"], cwd=tmp_path, PYTHONPATH=str(tmp_path))
    errors = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(errors) == 1 and "--micro-batch-size" in errors[0], \
        refused.stderr[-3000:]


# ----------------------------------------------------------------------------------------------
# the launchers, from another directory
# ----------------------------------------------------------------------------------------------
DATA_ARGS = "--data-path d/sample_text_document --vocab-file ./d/vocab.json --merge-file d/merges.txt --split 98,2,0"
PATH_ARGS = ["--save", "out/ckpt", "--load", "ckpt", "--trace-dir", "traces", "--trace",
             "--data-cache-path", "cache"]
LAUNCHERS = [  # script, variables, the ranks it prints
    ("run_single_gpt.sh", {}, [0]),
    ("run_master_llama.sh", {"NODE_IPS": "10.0.0.1,10.0.0.2", "NPROC": "1"}, [0]),
    ("run_worker_gpt.sh", {"NODE_IPS": "10.0.0.1,10.0.0.2", "NODE_RANK": "1",
                           "MASTER_ADDR": "10.0.0.1", "NPROC": "1"}, [1]),
    ("run_slurm_gpt.sh", {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[01-02]",
                          "NODE_IPS": "10.0.0.1,10.0.0.2", "NPROC": "1"}, [0, 1]),
]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("script, variables, ranks", LAUNCHERS, ids=[entry[0] for entry in LAUNCHERS])
def test_dry_run_reads_relative_paths_from_the_callers_directory(tmp_path, script, variables, ranks):
    user = _user_dir(tmp_path)
    # PP=2: --trace needs a pipeline (the multi-node ones: 2 nodes x 1 process).
    result = _run(["bash", str(SCRIPTS / script), "--dry-run", *PATH_ARGS], cwd=user,
                  DATA_ARGS=DATA_ARGS, PP="2", **variables)
    assert result.returncode == 0, result.stderr[-3000:]
    commands = _node_commands(result.stdout)
    assert sorted(commands) == ranks, result.stdout
    for argv in commands.values():
        expected = {"--data-path": user / "d" / "sample_text_document",
                    "--vocab-file": user / "d" / "vocab.json", "--merge-file": user / "d" / "merges.txt",
                    "--save": user / "out" / "ckpt", "--load": user / "ckpt",
                    "--trace-dir": user / "traces", "--data-cache-path": user / "cache"}
        for flag, path in expected.items():
            (value,) = _values(argv, flag)
            assert _same(value, path), (flag, value, path)


@pytest.mark.timeout(150)
def test_relative_data_dir_dpp_venv_and_blend(tmp_path):
    user = _user_dir(tmp_path)
    (user / "sub").mkdir()
    os.symlink(sys.prefix, user / "venv")  # this test's environment, under a relative name
    # From user/sub: DATA_DIR, DPP_VENV, a blend and a --flag=VALUE, all relative to user/sub.
    result = _run(["bash", str(SCRIPTS / "run_single_bert.sh"), "--dry-run",
                   "--data-path", "0.5", "../d/sample_bert_text_sentence", "0.5",
                   str(user / "d" / "sample_bert_text_sentence"), "--save=../saved"],
                  cwd=user / "sub", DATA_DIR="../d", DPP_VENV="../venv")
    assert result.returncode == 0, result.stderr[-3000:]
    ((_, argv),) = _node_commands(result.stdout).items()
    assert os.path.normpath(argv[0]) == str(user / "venv" / "bin" / "python"), argv[0]
    # The user's blend replaces the sample data (megatron_dpp/launcher_flags.py); DATA_DIR still
    # gives the tokenizer, which the user's flags leave to the launcher.
    assert argv.count("--data-path") == 1, argv
    weights_and_prefixes = _values(argv, "--data-path")
    assert weights_and_prefixes[0::2] == ["0.5", "0.5"]
    assert all(_same(p, user / "d" / "sample_bert_text_sentence") for p in weights_and_prefixes[1::2])
    assert _same(_values(argv, "--vocab-file")[0], user / "d" / "bert-vocab.txt")
    (save,) = [word for word in argv if word.startswith("--save=")]
    assert _same(save[len("--save="):], user / "saved")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_short_run_saves_and_resumes_from_relative_directories(tmp_path):
    """A real run (1 process, 2 iterations) from another directory: data, --save and
    --data-cache-path relative; then 2 more iterations resumed with --load from the same place."""
    user = _user_dir(tmp_path)
    shutil.rmtree(user / "ckpt")
    short = ["--train-iters", "2", "--lr-warmup-iters", "1", "--eval-iters", "0", "--log-interval", "1",
             "--global-batch-size", "4", "--data-cache-path", "cache"]
    first = _run(["bash", str(REPO_ROOT / "examples" / "gpt3" / "gpt3_tiny.sh"), *short, "--save",
                  "ckpt"], cwd=user, timeout=180, DATA_ARGS=DATA_ARGS, PP="1", NPROC="1")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert (user / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert any((user / "cache").iterdir()) and not (REPO_ROOT / "ckpt").exists()
    # Training longer changes the decay's default length: keep the checkpoint's schedule, as a
    # Megatron-LM user would (without a choice the load stops in one line, as in Megatron-LM).
    second = _run(["bash", str(REPO_ROOT / "examples" / "gpt3" / "gpt3_tiny.sh"), *short,
                   "--train-iters", "4", "--load", "ckpt", "--use-checkpoint-opt_param-scheduler"],
                  cwd=user, timeout=180,
                  DATA_ARGS=DATA_ARGS, PP="1", NPROC="1")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    iterations = [line.split("/")[0].split()[-1] for line in second.stdout.splitlines()
                  if line.lstrip().startswith("iteration ")]
    assert iterations == ["3", "4"], second.stdout[-3000:]


# ----------------------------------------------------------------------------------------------
# recipes run directly
# ----------------------------------------------------------------------------------------------
# Recipes that say how to run them instead of launching (exit 2), and what their line names.
REFUSALS = {"gpt3_175b": ["run_slurm_gpt.sh", "run_master_gpt.sh", "RECIPE=gpt3_175b"],
            "llama2_7b": ["DATA_ARGS=", "llama2_7b.sh"],
            "llama3_8b": ["DATA_ARGS=", "HuggingFaceTokenizer", "llama3_8b.sh"]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("recipe", RECIPES, ids=[path.stem for path in RECIPES])
def test_every_recipe_runs_directly(tmp_path, recipe):
    """`bash examples/<model>/<recipe>.sh --dry-run` from another directory: the launcher's banner
    with this recipe and its command (the GPU recipes' --bf16 validates on CPU ranks too); or one
    line saying how to run it (exit 2)."""
    name, model = recipe.stem, MODEL_OF_DIR[recipe.parent.name]
    result = _run(["bash", os.path.relpath(recipe, tmp_path), "--dry-run"], cwd=tmp_path)
    errors = result.stderr.strip().splitlines()
    if name in REFUSALS:
        assert result.returncode == 2 and len(errors) == 1, result.stderr
        assert all(word in errors[0] for word in REFUSALS[name]), errors[0]
        return
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"run_single_{model}: " in result.stdout and f", recipe {name}" in result.stdout
    assert list(_node_commands(result.stdout)) == [0], result.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("recipe", ["llama2_7b", "llama3_8b"])
def test_llama_recipes_with_data_args_launch(tmp_path, recipe):
    user = _user_dir(tmp_path)
    result = _run(["bash", str(REPO_ROOT / "examples" / "llama" / f"{recipe}.sh"), "--dry-run"],
                  cwd=user, DATA_ARGS=DATA_ARGS)
    assert result.returncode == 0 and f", recipe {recipe}" in result.stdout, result.stderr


def test_a_sourced_recipe_only_sets_flags(tmp_path):
    """The launchers source the recipes: sourcing one launches nothing."""
    for recipe in RECIPES:
        done = subprocess.run(["bash", "-c", f'source {shlex.quote(str(recipe))}; echo "${{#MODEL_ARGS[@]}}'
                               ' ${#TRAINING_ARGS[@]} ${#LOGGING_ARGS[@]}"'],
                              cwd=tmp_path, capture_output=True, text=True, timeout=30, env=_script_env())
        assert done.returncode == 0 and done.stderr == "", (recipe, done.stderr)
        assert all(int(count) > 0 for count in done.stdout.split()), (recipe, done.stdout)
