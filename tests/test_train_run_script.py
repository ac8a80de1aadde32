"""run_scripts/run_single_gpt.sh from another directory: env sizes, passthrough flags, falling loss,
and a bad flag stopped (one line, exit 2) before torchrun starts."""
import subprocess

import pytest

from _train_util import REPO_ROOT, _env, ensure_sample_data, parse_log

SCRIPT = str(REPO_ROOT / "run_scripts" / "run_single_gpt.sh")
BERT_SCRIPT = str(REPO_ROOT / "run_scripts" / "run_single_bert.sh")


def _run(extra, env_overrides, cwd, timeout, script=SCRIPT):
    env = _env()
    env.update(env_overrides)
    env["DATA_DIR"] = str(ensure_sample_data())
    return subprocess.run(["bash", script, *extra], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, start_new_session=True)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_script_trains_with_falling_loss(tmp_path):
    # 8 iterations: the loss falls by about 1 over them (a fixed seed: the same on every run).
    result = _run(["--train-iters", "8", "--log-interval", "2", "--eval-interval", "8"],
                  {"PP": "2", "VPP": "2"}, cwd=tmp_path, timeout=360)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "TP=1 PP=2 VPP=2" in result.stdout
    losses, _ = parse_log(result.stdout)
    assert len(losses) == 4, result.stdout[-3000:]
    assert losses[-1] < losses[0]
    assert "validation loss at iteration 8" in result.stdout


@pytest.mark.timeout(120)
def test_script_rejects_bad_sizes_before_launch(tmp_path):
    result = _run([], {"PP": "3", "NPROC": "2"}, cwd=tmp_path, timeout=100)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and "world size 2 is not a multiple" in lines[0], result.stderr
    assert "run_single_gpt: 2 processes" not in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bert_script_trains_with_falling_lm_loss(tmp_path):
    # 6 iterations: the lm loss falls by about 0.3 over them (a fixed seed).
    result = _run(["--train-iters", "6", "--log-interval", "2", "--eval-interval", "6"], {},
                  cwd=tmp_path, timeout=360, script=BERT_SCRIPT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "run_single_bert: 2 processes, TP=1 PP=2 VPP=1, USE_DPP=1, recipe bert_tiny" in result.stdout
    losses, _ = parse_log(result.stdout)
    assert len(losses) == 3 and losses[-1] < losses[0], result.stdout[-3000:]
    assert "| sop loss: " in result.stdout and "validation loss at iteration 6" in result.stdout


@pytest.mark.timeout(120)
def test_bert_script_names_its_recipes_for_an_unknown_one(tmp_path):
    result = _run([], {"RECIPE": "gpt3_tiny"}, cwd=tmp_path, timeout=100, script=BERT_SCRIPT)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "bert_base bert_large bert_tiny" in lines[0]
