"""--wandb-project: Megatron-LM's Weights & Biases logging (training/observe/wandb_log.py).

The wandb package is not a dependency and W&B's service cannot be reached here, so the runs use a
stand-in `wandb` module (on PYTHONPATH) that records each call: `init`'s arguments, each `log`
and `finish`. Checked: one run, from the rank that prints the log line, at pp=2; the TensorBoard
scalars' tags and values at each iteration (no `vs samples`), validation included; W&B without
--tensorboard-dir; the files under <--save>/wandb by default; the flag errors, before launch.
"""
from __future__ import annotations

import json
import os
import textwrap

import pytest

from _train_util import run_training

# Records every call as one JSON line in $FAKE_WANDB_RECORD (ranks append; lines are short).
FAKE_WANDB = textwrap.dedent('''
    import json, os

    def _record(call, **fields):
        with open(os.environ["FAKE_WANDB_RECORD"], "a") as out:
            out.write(json.dumps({"call": call, "rank": os.environ.get("RANK"), **fields}) + "\\n")

    def init(**kwargs):
        if os.environ.get("FAKE_WANDB_FAIL"):  # as wandb.init without an API key, no TTY
            raise RuntimeError("api_key not configured (no-tty).\\n  call wandb.login(key=...)")
        _record("init", kwargs={k: v for k, v in kwargs.items() if k != "config"},
                config_keys=sorted(kwargs.get("config", {})),
                seq_length=kwargs.get("config", {}).get("seq_length"))
        return object()

    def log(data, step=None):
        _record("log", data=data, step=step)

    def finish():
        _record("finish")
''')


@pytest.fixture
def fake_wandb(tmp_path):
    """(environment for the ranks, the record's path)."""
    package = tmp_path / "fake_wandb"
    package.mkdir()
    (package / "wandb.py").write_text(FAKE_WANDB)
    record = tmp_path / "wandb_calls.jsonl"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(package), env.get("PYTHONPATH")]))
    env["FAKE_WANDB_RECORD"] = str(record)
    return env, record


def _calls(record) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()]


def _logged(calls) -> dict:
    """{tag: [(step, value), ...]} of the log calls."""
    logged: dict = {}
    for call in calls:
        if call["call"] == "log":
            for tag, value in call["data"].items():
                logged.setdefault(tag, []).append((call["step"], value))
    return logged


@pytest.mark.timeout(300)
def test_wandb_gets_tensorboards_scalars_from_the_logging_rank(tmp_path, fake_wandb):
    pytest.importorskip("tensorboard")
    from test_tensorboard_log import _scalars

    env, record = fake_wandb
    board, runs = str(tmp_path / "tb"), str(tmp_path / "wandb_files")
    rc, losses, norms, out = run_training(
        ["--train-iters", "3", "--pipeline-model-parallel-size", "2", "--tensorboard-dir", board,
         "--eval-interval", "2", "--eval-iters", "1", "--log-batch-size-to-tensorboard",
         "--wandb-project", "dpp-tests", "--wandb-exp-name", "tiny", "--wandb-save-dir", runs,
         "--wandb-entity", "team"], nproc=2, env=env, torchrun=True)
    assert rc == 0 and len(losses) == 3, out[-3000:]
    calls = _calls(record)
    inits = [call for call in calls if call["call"] == "init"]
    assert len(inits) == 1 and inits[0]["rank"] == "1", inits  # the last stage logs
    assert inits[0]["kwargs"] == {"dir": runs, "name": "tiny", "project": "dpp-tests",
                                  "entity": "team"}
    from _train_util import TINY_GPT_ARGS

    seq_length = int(TINY_GPT_ARGS[TINY_GPT_ARGS.index("--seq-length") + 1])
    assert inits[0]["seq_length"] == seq_length  # the flags are the run's config
    assert "wandb_project" in inits[0]["config_keys"]
    assert os.path.isdir(runs)
    assert [call["call"] for call in calls][-1] == "finish"
    assert sum(call["call"] == "finish" for call in calls) == 1
    logged = _logged(calls)
    scalars = _scalars(board)
    assert not any(tag.endswith(" vs samples") for tag in logged)
    assert set(logged) == {tag for tag in scalars if not tag.endswith(" vs samples")}
    for tag, values in logged.items():
        assert [step for step, _ in values] == [step for step, _ in scalars[tag]], tag
        assert [value for _, value in values] == pytest.approx(
            [value for _, value in scalars[tag]], rel=1e-6), tag
    assert [value for _, value in logged["lm loss"]] == pytest.approx(losses, rel=1e-6)
    assert [value for _, value in logged["grad-norm"]] == pytest.approx(norms, rel=1e-6)
    # The interval evaluation's, then the one after the last iteration (as Megatron-LM).
    assert [step for step, _ in logged["lm loss validation"]] == [2, 3]


@pytest.mark.timeout(300)
def test_wandb_alone_with_its_files_under_save(tmp_path, fake_wandb):
    env, record = fake_wandb
    save = tmp_path / "ckpt"
    rc, losses, _norms, out = run_training(
        ["--train-iters", "4", "--tensorboard-log-interval", "2", "--save", str(save),
         "--save-interval", "100", "--no-log-loss-scale-to-tensorboard",
         "--wandb-project", "dpp-tests", "--wandb-exp-name", "alone"],
        nproc=1, env=env, torchrun=True)
    assert rc == 0 and len(losses) == 4, out[-3000:]
    calls = _calls(record)
    assert calls[0]["call"] == "init" and calls[0]["kwargs"]["dir"] == str(save / "wandb")
    assert "entity" not in calls[0]["kwargs"]
    logged = _logged(calls)
    assert [step for step, _ in logged["lm loss"]] == [2, 4]
    assert [value for _, value in logged["lm loss"]] == pytest.approx(losses[1::2], rel=1e-6)
    assert "loss-scale" not in logged and "learning-rate" in logged


@pytest.mark.timeout(300)
def test_a_failed_wandb_init_is_one_line(tmp_path, fake_wandb):
    env, record = fake_wandb
    env["FAKE_WANDB_FAIL"] = "1"
    rc, losses, _norms, out = run_training(
        ["--train-iters", "2", "--wandb-project", "p", "--wandb-exp-name", "n",
         "--wandb-save-dir", str(tmp_path / "runs")], nproc=1, env=env, torchrun=True)
    assert rc == 1 and losses == [], out[-3000:]
    assert ("megatron_dpp: error: --wandb-project: wandb.init failed: api_key not configured "
            "(no-tty). call wandb.login(key=...) (WANDB_MODE=offline keeps the run on disk") in out
    rank_output = out.split("failed (exitcode")[0]  # plain torchrun then prints its own traceback
    assert "Traceback" not in rank_output
    assert not record.exists()


def test_wandb_flags_are_checked_before_launch(monkeypatch, capsys, tmp_path):
    import importlib.util

    from _train_util import TINY_GPT_ARGS, data_args, flag_error
    from megatron_dpp.arguments import parse_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")

    def error(*flags):
        return flag_error(capsys, [*data_args(), *TINY_GPT_ARGS, *flags])

    real = importlib.util.find_spec
    installed = {"wandb": True}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: (
        (object() if installed["wandb"] else None) if name == "wandb" else real(name, *rest)))
    runs = str(tmp_path / "runs")
    assert "--wandb-exp-name needs --wandb-project NAME" in error("--wandb-exp-name", "x")
    assert "--wandb-entity needs --wandb-project NAME" in error("--wandb-entity", "x")
    assert "--wandb-project needs --wandb-exp-name NAME (the run's name)" in \
        error("--wandb-project", "p", "--wandb-save-dir", runs)
    assert "--wandb-project needs --wandb-save-dir DIR or --save DIR" in \
        error("--wandb-project", "p", "--wandb-exp-name", "n")
    (tmp_path / "a_file").write_text("")
    assert "--wandb-save-dir" in error("--wandb-project", "p", "--wandb-exp-name", "n",
                                       "--wandb-save-dir", str(tmp_path / "a_file"))
    # The scalar-choosing flags go with W&B alone; TensorBoard's queue does not.
    assert "--tensorboard-queue-size needs --tensorboard-dir DIR" in error(
        "--wandb-project", "p", "--wandb-exp-name", "n", "--wandb-save-dir", runs,
        "--tensorboard-queue-size", "5")
    assert "--log-batch-size-to-tensorboard needs --tensorboard-dir DIR (or --wandb-project " \
           "NAME)" in error("--log-batch-size-to-tensorboard")
    args = parse_args([*data_args(), *TINY_GPT_ARGS, "--wandb-project", "p", "--wandb-exp-name",
                       "n", "--wandb-save-dir", runs, "--log-batch-size-to-tensorboard"],
                      prog="megatron_dpp.pretrain_gpt")
    assert args.wandb_project == "p"
    installed["wandb"] = False
    assert "--wandb-project needs the wandb package, which this Python lacks: pip install " \
           "wandb" in error("--wandb-project", "p", "--wandb-exp-name", "n",
                            "--wandb-save-dir", runs)
