"""Megatron-LM's example scripts, with their names, positional arguments and variables
(examples/gpt3/train_gpt3_175b_distributed.sh and its _master/_worker forms,
examples/bert/train_bert_340m_distributed.sh; run_scripts/_launch.sh, launch_example):

(a) as written they ask for their own layout and model (the flag check accepts them at their
    process count), and missing arguments are one line;
(b) Megatron-LM's variables (GPUS_PER_NODE, NUM_NODES, NODE_RANK, MASTER_ADDR, MASTER_PORT) and
    MegatronDPP's --num-gpus, --multi-node --node-ips set the job's layout;
(c) appended flags shrink them to a CPU run, which trains, evaluates at the end, saves to
    CHECKPOINT_PATH and writes TensorBoard events to TENSORBOARD_LOGS_PATH.
"""
from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from _train_util import LOSS_RE, REPO_ROOT, _env, ensure_sample_data

EXAMPLES = REPO_ROOT / "examples"
_LAUNCH_VARIABLES = ("NNODES", "NODE_RANK", "NODE_IPS", "MASTER_ADDR", "MASTER_PORT", "NPROC",
                     "PP", "TP", "VPP", "USE_DPP", "RECIPE", "DATA_ARGS", "DATA_DIR", "DPP_VENV",
                     "GPUS_PER_NODE", "NUM_NODES")


def _script(name: str, args: list[str], cwd: Path, timeout: float = 60, **variables: str):
    env = _env()
    for variable in _LAUNCH_VARIABLES:
        env.pop(variable, None)
    env.update(variables)
    model_dir = "bert" if "bert" in name else "gpt3"
    return subprocess.run(["bash", str(EXAMPLES / model_dir / f"{name}.sh"), *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)


def _gpt_positionals() -> list[str]:
    sample = ensure_sample_data()
    return ["ckpt", "tb", str(sample / "vocab.json"), str(sample / "merges.txt"),
            str(sample / "sample_text_document")]


def _bert_positionals() -> list[str]:
    sample = ensure_sample_data()
    return ["ckpt", "tb", str(sample / "bert-vocab.txt"), str(sample / "sample_bert_text_sentence")]


def _commands(stdout: str) -> dict[int, list[str]]:
    commands = {}
    for line in stdout.splitlines():
        if line.startswith("node "):
            rank, command = line[len("node "):].split(": ", 1)
            commands[int(rank)] = shlex.split(command)
    return commands


def _last(argv: list[str], flag: str) -> str:
    return argv[len(argv) - 1 - argv[::-1].index(flag) + 1]


SMALL_GPT = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "64", "--max-position-embeddings", "64",
             "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
             "--global-batch-size", "8", "--rampup-batch-size", "4", "4", "16",
             "--train-samples", "48", "--bf16", "--log-interval", "1", "--eval-interval", "4",
             "--eval-iters", "1", "--save-interval", "4"]


# ----------------------------------------------------------------------------------------------
# (a) as written
# ----------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, positionals, processes, layout", [
    ("train_gpt3_175b_distributed", _gpt_positionals, "128", "TP=8 PP=16"),
    ("train_bert_340m_distributed", _bert_positionals, "8", "TP=2 PP=4"),
])
def test_as_written_the_script_asks_for_its_own_model_and_layout(tmp_path, name, positionals,
                                                                 processes, layout):
    result = _script(name, [*positionals(), "--dry-run"], tmp_path, GPUS_PER_NODE=processes)
    assert result.returncode == 0, result.stderr
    assert f"{processes} processes, {layout}" in result.stdout, result.stdout
    (argv,) = _commands(result.stdout).values()
    assert _last(argv, "--save") == _last(argv, "--load") == str(tmp_path / "ckpt")
    assert _last(argv, "--tensorboard-dir") == str(tmp_path / "tb")
    assert f"from recipe {name}: " in result.stdout
    # On this CPU's two processes the same command is one honest line.
    short = _script(name, [*positionals(), "--dry-run"], tmp_path)
    assert short.returncode == 2 and len(short.stderr.strip().splitlines()) == 1, short.stderr
    assert "world size 2 is not a multiple" in short.stderr


@pytest.mark.timeout(60)
def test_missing_positional_arguments_are_one_line(tmp_path):
    result = _script("train_gpt3_175b_distributed", ["ckpt", "tb", "--lr", "1"], tmp_path)
    errors = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(errors) == 1, result.stderr
    assert "CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE MERGE_FILE DATA_PATH" in errors[0]
    assert "argument 3 of 5 is missing" in errors[0]


# ----------------------------------------------------------------------------------------------
# (b) variables and MegatronDPP's flags
# ----------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_num_gpus_and_gpus_per_node_set_the_processes(tmp_path):
    args = [*_gpt_positionals(), *SMALL_GPT, "--dry-run"]
    for variables, flags in (({"GPUS_PER_NODE": "4"}, []), ({}, ["--num-gpus", "4"])):
        result = _script("train_gpt3_175b_distributed", [*args, *flags], tmp_path, **variables)
        assert result.returncode == 0, result.stderr
        (argv,) = _commands(result.stdout).values()
        assert _last(argv, "--nproc-per-node") == "4" and "--num-gpus" not in argv
    clash = _script("train_gpt3_175b_distributed", [*args, "--num-gpus", "4"], tmp_path, NPROC="2")
    assert clash.returncode == 2 and "NPROC=2 and --num-gpus 4 disagree" in clash.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, variables, node", [
    ("train_gpt3_175b_distributed_master", {}, 0),
    ("train_gpt3_175b_distributed_worker", {"NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1"}, 1),
    ("train_gpt3_175b_distributed", {"NUM_NODES": "2", "NODE_RANK": "1",
                                     "MASTER_ADDR": "10.0.0.1"}, 1),
])
def test_multi_node_forms_take_megatron_dpps_node_ips(tmp_path, name, variables, node):
    result = _script(name, [*_gpt_positionals(), *SMALL_GPT, "--num-gpus", "1", "--multi-node",
                            "--node-ips", "10.0.0.1,10.0.0.2", "--dry-run"], tmp_path, **variables)
    assert result.returncode == 0, result.stderr
    assert f"node {node} of 2, 1 processes per node" in result.stdout, result.stdout
    ((rank, argv),) = _commands(result.stdout).items()
    assert rank == node and _last(argv, "--nnodes") == "2"
    assert _last(argv, "--master-port") == "6000"  # Megatron-LM's scripts' port
    assert _last(argv, "--node-ips") == "10.0.0.1,10.0.0.2" and "--multi-node" in argv


# ----------------------------------------------------------------------------------------------
# (c) a CPU run
# ----------------------------------------------------------------------------------------------
@pytest.mark.timeout(400)
def test_shrunk_to_a_cpu_run_it_trains_evaluates_saves_and_logs(tmp_path):
    result = _script("train_gpt3_175b_distributed", [*_gpt_positionals(), *SMALL_GPT], tmp_path,
                     timeout=360)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    losses = [float(value) for value in LOSS_RE.findall(result.stdout)]
    assert len(losses) == 8, result.stdout[-3000:]  # 48 samples: 4, 4, 4, 4 ramping, then 8s
    assert "validation loss at iteration 8 on validation set" in result.stdout
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tb"))


# ----------------------------------------------------------------------------------------------
# examples/llama/train_llama3_8b_h100_fp8.sh
# ----------------------------------------------------------------------------------------------
def _llama(args: list[str], cwd: Path, timeout: float = 60, **variables: str):
    env = _env()
    for variable in _LAUNCH_VARIABLES:
        env.pop(variable, None)
    env.update(variables)
    return subprocess.run(["bash", str(EXAMPLES / "llama" / "train_llama3_8b_h100_fp8.sh"), *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(60)
def test_llama3_fp8_says_in_one_line_that_it_needs_transformer_engine(tmp_path):
    for variables in ({}, {"DTYPE": "fp8"}):
        result = _llama(["--dry-run"], tmp_path, **variables)
        errors = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(errors) == 1, result.stderr
        assert "Transformer Engine" in errors[0] and "DTYPE=bf16" in errors[0]
    wrong = _llama(["--dry-run"], tmp_path, DTYPE="fp16")
    assert wrong.returncode == 2 and "DTYPE=fp16; set DTYPE=bf16" in wrong.stderr


@pytest.mark.timeout(120)
def test_llama3_in_bf16_is_gpt_with_llamas_options_at_the_scripts_layout(tmp_path):
    result = _llama(["--dry-run"], tmp_path, DTYPE="bf16", GPUS_PER_NODE="8")
    assert result.returncode == 0, result.stderr
    assert "8 processes, TP=1 PP=1" in result.stdout, result.stdout
    (argv,) = _commands(result.stdout).values()
    assert argv[argv.index("-m", argv.index("megatron_dpp.rank_launcher")) + 1] == \
        "megatron_dpp.pretrain_gpt"
    for flag, value in {"--kv-channels": "128", "--num-query-groups": "8",
                        "--normalization": "RMSNorm", "--position-embedding-type": "rope",
                        "--tokenizer-type": "NullTokenizer", "--vocab-size": "128256",
                        "--save": str(tmp_path / "checkpoints" / "llama3_8b_fp8")}.items():
        assert _last(argv, flag) == value, (flag, _last(argv, flag))
    assert "--swiglu" in argv and "--mock-data" in argv and "--bf16" in argv


@pytest.mark.timeout(400)
def test_llama3_shrunk_to_a_cpu_run_trains(tmp_path):
    result = _llama(["ckpt", "tb", "MOCK", "MOCK", "--num-layers", "2", "--hidden-size", "64",
                     "--ffn-hidden-size", "176", "--num-attention-heads", "8",
                     "--num-query-groups", "4", "--kv-channels", "16", "--seq-length", "64",
                     "--max-position-embeddings", "64", "--global-batch-size", "8",
                     "--vocab-size", "1024", "--train-samples", "32",
                     "--pipeline-model-parallel-size", "2", "--eval-interval", "2",
                     "--eval-iters", "1", "--save-interval", "4"],
                    tmp_path, timeout=360, DTYPE="bf16")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert len(LOSS_RE.findall(result.stdout)) == 4, result.stdout[-3000:]
    assert "validation loss at iteration 4 on test set" in result.stdout
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
