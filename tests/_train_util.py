"""Helpers for tests that train the tiny GPT in real processes, reused by other suites.

    rc, losses, grad_norms, stdout = run_training(["--pipeline-model-parallel-size", "2"], nproc=2)

The sample data is prepared once under <repo>/data/sample (idempotent, locked, git-ignored).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from _forked_ranks import run_forked

REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLE_DIR = REPO_ROOT / "data" / "sample"
PYTHON = sys.executable

LOSS_RE = re.compile(r"\| lm loss: ([-+0-9.eE]+)")
GRAD_NORM_RE = re.compile(r"\| grad norm: ([-+0-9.eE]+)")
ITERATION_RE = re.compile(r" iteration\s+(\d+)/")


def ensure_sample_data(timeout: float = 300) -> Path:
    """Make the sample corpus, tokenizers and indexed datasets (GPT's and BERT's) if missing;
    returns the directory."""
    if not ((SAMPLE_DIR / "sample_text_document.idx").is_file()
            and (SAMPLE_DIR / "sample_bert_text_sentence.idx").is_file()):
        subprocess.run([PYTHON, "-m", "megatron_dpp.data.prepare_sample", "--output-dir",
                        str(SAMPLE_DIR), "--no-progress"], check=True, timeout=timeout,
                       env=_env(), cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
    return SAMPLE_DIR


def data_args() -> list[str]:
    sample = ensure_sample_data()
    return ["--data-path", str(sample / "sample_text_document"),
            "--vocab-file", str(sample / "vocab.json"), "--merge-file", str(sample / "merges.txt"),
            "--split", "98,2,0"]


# A 4-layer GPT (hidden 64, seq 64), fp32, no dropout: deterministic and a few seconds per run.
# Its batches are built in the ranks themselves (--num-workers 0): the CPU ranks share a few cores;
# Megatron-LM's default of 2 workers per loader runs in test_megatron_lm_defaults.py.
TINY_GPT_ARGS = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "1", "--global-batch-size", "8",
    "--train-iters", "5", "--lr", "1e-3", "--lr-warmup-iters", "1", "--min-lr", "1e-4",
    "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.01",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234",
    "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
]


def without_flags(argv: Sequence[str], *flags: str) -> list[str]:
    """argv (e.g. TINY_GPT_ARGS) without each of `flags` and the value after it."""
    kept, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item in flags:
            skip = True
        else:
            kept.append(item)
    return kept


def _env(base: dict | None = None) -> dict:
    """`base` (default: this process's environment; GPU tests: _gpu.gpu_env()) with one thread."""
    env = dict(os.environ if base is None else base)
    env["OMP_NUM_THREADS"] = "1"
    env["MKL_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def main_in_process(main, argv: Sequence[str]) -> subprocess.CompletedProcess:
    """A command's `main(argv)` called in this process, its exit code (SystemExit's included) and
    what it printed, as subprocess.run gives them: a process of its own spends seconds importing
    torch. What only a new interpreter prints (its imports' warnings) is not in it: a test that
    checks for that runs the command itself."""
    import contextlib
    import io

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main([str(arg) for arg in argv])
        except SystemExit as exit_:  # argparse's usage errors, a command's _fail
            code = exit_.code
    return subprocess.CompletedProcess(list(argv), code, stdout.getvalue(), stderr.getvalue())


def torchrun_command(args: Sequence[str], nproc: int,
                     entry: str = "megatron_dpp.pretrain_gpt") -> list[str]:
    return [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", entry, *args]


def assert_losses_close(got: Sequence[float], want: Sequence[float], rel: float) -> None:
    """As many losses as expected, each within `rel` of its counterpart (relative)."""
    assert len(got) == len(want), (got, want)
    for a, b in zip(got, want):
        assert abs(a - b) <= rel * abs(b), (got, want)


def parse_log(stdout: str) -> tuple[list[float], list[float]]:
    losses = [float(m.group(1)) for m in LOSS_RE.finditer(stdout)]
    grad_norms = [float(m.group(1)) for m in GRAD_NORM_RE.finditer(stdout)]
    return losses, grad_norms


def run_training(extra_args: Sequence[str] = (), nproc: int = 2, timeout: float = 300,
                 base_args: Sequence[str] | None = None, with_data: bool = True,
                 entry: str = "megatron_dpp.pretrain_gpt", env: dict | None = None,
                 torchrun: bool = False) -> tuple[int, list[float], list[float], str]:
    """Train as torchrun would; (returncode, lm losses, grad norms, stdout+stderr).

    CPU runs fork their ranks from preloaded servers (_forked_ranks.py); GPU runs (`env` from
    _gpu.gpu_env()), and any run with `torchrun`, start under torchrun.

    extra_args come last, so they override base_args (default TINY_GPT_ARGS). `env`: the ranks'
    environment (default: this process's, pinned to the CPU by conftest.py). On timeout the whole
    process group is killed and AssertionError is raised with the output so far.
    """
    base = TINY_GPT_ARGS if base_args is None else list(base_args)
    args = [*(data_args() if with_data else []), *base, *extra_args]
    forked = None if torchrun else run_forked(entry, args, nproc, _env(env), REPO_ROOT, timeout)
    if forked is not None:
        returncode, stdout = forked
        losses, grad_norms = parse_log(stdout)
        return returncode, losses, grad_norms, stdout
    process = subprocess.Popen(torchrun_command(args, nproc, entry), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=_env(env), cwd=REPO_ROOT,
                               start_new_session=True)
    try:
        stdout, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, _ = process.communicate()
        raise AssertionError(f"training did not finish within {timeout}s:\n{stdout[-4000:]}")
    losses, grad_norms = parse_log(stdout)
    return process.returncode, losses, grad_norms, stdout


def flag_error(capsys, argv: Sequence[str], model: str = "gpt") -> str:
    """The line megatron_dpp.pretrain_<model>'s flag check prints for `argv` (in this process; the
    caller sets WORLD_SIZE and RANK), asserting it stops with exit code 2 and one line."""
    import pytest

    from megatron_dpp.arguments import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(list(argv), prog=f"megatron_dpp.pretrain_{model}", model=model)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_.value.code == 2 and len(lines) == 1, lines
    return lines[0]


def train_llama_through_the_launcher(data_args: str) -> str:
    """8 iterations of the CPU Llama recipe at pp=1 on DATA_ARGS; asserts the loss falls and
    returns the log (the Llama tokenizer tests)."""
    result = subprocess.run(
        ["bash", "run_scripts/run_single_llama.sh", "--train-iters", "8", "--global-batch-size",
         "8", "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "0"],
        capture_output=True, text=True, timeout=280, cwd=REPO_ROOT,
        env=_env({**os.environ, "PP": "1", "DATA_ARGS": data_args}))
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    losses = [float(v) for v in re.findall(r"\| lm loss: ([-+0-9.eE]+)", result.stdout)]
    assert len(losses) == 8, result.stdout[-3000:]
    assert losses[-1] < losses[0] - 0.5, losses
    return result.stdout
