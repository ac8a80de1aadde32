"""Multi-node launching: the --node-ips list, local interfaces, UCX devices, SLURM node lists, the
startup check, and run_master_gpt.sh / run_worker_gpt.sh / run_slurm_gpt.sh (bad environment: one
line, exit 2, torchrun not started; --dry-run: the torchrun command of each node), and two "nodes"
on this machine (127.0.0.1 and another local address) training through the master and worker
scripts."""
from __future__ import annotations

import ipaddress
import os
import re
import shlex
import subprocess
import time

import pytest

from _train_util import PYTHON, REPO_ROOT, TINY_GPT_ARGS, _env, data_args, ensure_sample_data
from megatron_dpp.comm.nodes import (
    NodeNetworkError,
    check_node_count,
    interface_of_address,
    local_addresses,
    num_nodes,
    parse_node_ips,
    this_node_rank,
    ucx_net_devices,
    use_node_network,
)
from megatron_dpp.comm.slurm import expand_slurm_nodelist, resolve_host

SCRIPTS = REPO_ROOT / "run_scripts"
# TEST-NET-3 (RFC 5737): documentation only, never an address of this machine.
FOREIGN = "203.0.113.7"
UNRESOLVABLE = "no-such-node.invalid"  # .invalid never resolves (RFC 6761)


# ----------------------------------------------------------------------------------------------
# the --node-ips list and torchrun's environment
# ----------------------------------------------------------------------------------------------
def test_parse_node_ips_accepts_ipv4_and_ipv6_in_order():
    assert parse_node_ips("10.0.0.2,10.0.0.1") == ["10.0.0.2", "10.0.0.1"]
    assert parse_node_ips(" fd00::1 , 10.0.0.1") == ["fd00::1", "10.0.0.1"]
    assert parse_node_ips("FD00:0::0001") == ["fd00::1"]


@pytest.mark.parametrize("text, named", [
    ("10.0.0.1,,10.0.0.2", "entry 2 of '10.0.0.1,,10.0.0.2' is empty"),
    ("10.0.0.1,", "entry 2"),
    ("", "entry 1"),
    ("10.0.0.1,10.0.0", "'10.0.0' is not an IPv4 or IPv6 address"),
    ("node1,node2", "'node1' is not an IPv4 or IPv6 address"),
    ("10.0.0.1,10.0.0.256", "'10.0.0.256'"),
    ("10.0.0.1,10.0.0.1", "10.0.0.1 is listed twice"),
    ("fd00::1,FD00:0::1", "FD00:0::1 is listed twice"),
])
def test_parse_node_ips_refuses_with_one_line_naming_the_entry(text, named):
    with pytest.raises(ValueError) as error:
        parse_node_ips(text)
    assert named in str(error.value) and "\n" not in str(error.value)


def test_check_node_count():
    check_node_count(["10.0.0.1", "10.0.0.2"], 2)
    with pytest.raises(ValueError, match="the job has 2 nodes but 1 address is given"):
        check_node_count(["10.0.0.1"], 2)
    with pytest.raises(ValueError, match="the job has 1 node but 2 addresses are given"):
        check_node_count(["10.0.0.1", "10.0.0.2"], 1)


def test_node_rank_and_count_come_from_torchrun_variables():
    environ = {"GROUP_RANK": "1", "GROUP_WORLD_SIZE": "3"}
    assert this_node_rank(environ) == 1 and num_nodes(environ) == 3
    with pytest.raises(ValueError, match="GROUP_WORLD_SIZE .* is not set"):
        num_nodes({})
    with pytest.raises(ValueError, match="GROUP_RANK='x'"):
        this_node_rank({"GROUP_RANK": "x"})


# ----------------------------------------------------------------------------------------------
# local interfaces and the startup check
# ----------------------------------------------------------------------------------------------
def test_interface_of_address_finds_loopback_and_nothing_for_a_foreign_address():
    assert ("lo", "127.0.0.1") in local_addresses()
    assert interface_of_address("127.0.0.1") == "lo"
    assert interface_of_address(FOREIGN) is None
    if ("lo", "::1") in local_addresses():
        assert interface_of_address("::1") == "lo"


def test_use_node_network_sets_the_socket_interfaces_it_finds_unset():
    environ = {"NCCL_SOCKET_IFNAME": "ib3"}
    network = use_node_network([FOREIGN, "127.0.0.1"], 1, environ)
    assert network.interface == "lo"
    assert environ == {"NCCL_SOCKET_IFNAME": "ib3", "GLOO_SOCKET_IFNAME": "lo"}
    line = network.describe()
    assert "node rank 1 is 127.0.0.1 on lo" in line
    assert "set GLOO_SOCKET_IFNAME=lo" in line and "kept NCCL_SOCKET_IFNAME=ib3" in line


def test_use_node_network_refuses_an_address_of_another_machine():
    environ: dict[str, str] = {}
    with pytest.raises(NodeNetworkError) as error:
        use_node_network([FOREIGN, "127.0.0.1"], 0, environ)
    message = str(error.value)
    assert f"node rank 0 the address {FOREIGN}" in message
    assert "lo 127.0.0.1" in message and "\n" not in message
    assert environ == {}


def _make_interface(root, name, ib_device=None, dev_port=None):
    net = root / "class" / "net" / name
    (net / "device").mkdir(parents=True)
    if ib_device is not None:
        (net / "device" / "infiniband" / ib_device).mkdir(parents=True)
    if dev_port is not None:
        (net / "dev_port").write_text(f"{dev_port}\n")


def test_ucx_net_devices_from_a_fake_sysfs(tmp_path):
    _make_interface(tmp_path, "eth0", dev_port=0)
    _make_interface(tmp_path, "ib0", ib_device="mlx5_0", dev_port=0)
    _make_interface(tmp_path, "ens1f1", ib_device="mlx5_1", dev_port=1)  # RoCE, second port
    _make_interface(tmp_path, "ib1", ib_device="mlx5_2")  # no dev_port: the first port
    assert ucx_net_devices("eth0", sysfs_root=str(tmp_path)) == "eth0"
    assert ucx_net_devices("ib0", sysfs_root=str(tmp_path)) == "ib0,mlx5_0:1"
    assert ucx_net_devices("ens1f1", sysfs_root=str(tmp_path)) == "ens1f1,mlx5_1:2"
    assert ucx_net_devices("ib1", sysfs_root=str(tmp_path)) == "ib1,mlx5_2:1"
    assert ucx_net_devices("missing0", sysfs_root=str(tmp_path)) == "missing0"


# ----------------------------------------------------------------------------------------------
# SLURM node lists
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, hosts", [
    ("gpu[01-03,07],login5", ["gpu01", "gpu02", "gpu03", "gpu07", "login5"]),
    ("node7", ["node7"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("a[1-2]-ib,b3", ["a1-ib", "a2-ib", "b3"]),
    ("rack[1-2]-gpu[1,3]", ["rack1-gpu1", "rack1-gpu3", "rack2-gpu1", "rack2-gpu3"]),
    ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
])
def test_expand_slurm_nodelist(text, hosts):
    assert expand_slurm_nodelist(text) == hosts


@pytest.mark.parametrize("text, named", [
    ("", "empty"), ("a,,b", "empty entry"), ("gpu[01-", "'[' without ']'"),
    ("gpu]", "']' without '['"), ("gpu[3-1]", "runs backwards"), ("gpu[x]", "[x]"),
    ("gpu[]", "[]"), ("gpu[[1]]", "nested"),
])
def test_expand_slurm_nodelist_refuses_malformed_lists(text, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        expand_slurm_nodelist(text)


@pytest.mark.timeout(60)
def test_resolve_host():
    assert resolve_host("127.0.0.2") == "127.0.0.2"
    with pytest.raises(ValueError, match=f"host {UNRESOLVABLE} does not resolve"):
        resolve_host(UNRESOLVABLE)


# ----------------------------------------------------------------------------------------------
# flags and the startup check, in real processes
# ----------------------------------------------------------------------------------------------
def _torchrun_env(**variables) -> dict:
    env = _env()
    for name in ("MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(name, None)
    env.update(RANK="0", LOCAL_RANK="0", **variables)
    return env


def _one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.timeout(90)
def test_node_count_is_checked_against_torchrun_group_world_size():
    env = _torchrun_env(WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", GROUP_WORLD_SIZE="2")
    base = [PYTHON, "-m", "megatron_dpp.arguments", *data_args(), *TINY_GPT_ARGS,
            "--multi-node", "--node-ips"]
    bad = subprocess.run([*base, "10.0.0.1,10.0.0.2,10.0.0.3"], env=env, cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=80)
    assert "the job has 2 nodes but 3 addresses are given" in _one_error_line(bad)
    good = subprocess.run([*base, "10.0.0.1,10.0.0.2"], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=80)
    assert good.returncode == 0, good.stderr[-2000:]


@pytest.mark.timeout(120)
def test_startup_refuses_a_node_address_that_is_not_local_before_any_process_group():
    """No MASTER_ADDR: had the check come after init_process_group, the run would fail otherwise."""
    env = _torchrun_env(WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", GROUP_WORLD_SIZE="2", GROUP_RANK="1")
    result = subprocess.run(
        [PYTHON, "-m", "megatron_dpp.pretrain_gpt", *data_args(), *TINY_GPT_ARGS,
         "--multi-node", "--node-ips", f"127.0.0.1,{FOREIGN}"],
        env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=110)
    line = [line for line in result.stderr.splitlines()
            if line.strip() and "warn" not in line.lower()]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(line) == 1, result.stderr
    assert f"node rank 1 the address {FOREIGN}" in line[0] and "lo 127.0.0.1" in line[0]


# ----------------------------------------------------------------------------------------------
# the launch scripts
# ----------------------------------------------------------------------------------------------
_LAUNCH_VARIABLES = ("NNODES", "NODE_RANK", "NODE_IPS", "MASTER_ADDR", "MASTER_PORT", "NPROC",
                     "PP", "TP", "VPP", "USE_DPP", "RECIPE", "DATA_ARGS")


def _script_env(**variables) -> dict:
    env = _env()
    for name in [*_LAUNCH_VARIABLES, *(name for name in env if name.startswith("SLURM_"))]:
        env.pop(name, None)
    env["DATA_DIR"] = str(ensure_sample_data())
    env.update(variables)
    return env


def _run_script(script, variables, args=(), cwd=None, timeout=100):
    start = time.monotonic()
    result = subprocess.run(["bash", str(SCRIPTS / script), *args], env=_script_env(**variables),
                            cwd=cwd, capture_output=True, text=True, timeout=timeout,
                            start_new_session=True)
    return result, time.monotonic() - start


def _node_commands(stdout: str) -> dict[int, list[str]]:
    """'node R: <torchrun command>' lines of --dry-run -> {R: argv}."""
    commands = {}
    for line in stdout.splitlines():
        if line.startswith("node "):
            rank, command = line[len("node "):].split(": ", 1)
            commands[int(rank)] = shlex.split(command)
    return commands


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("node_ips, expected", [
    ("127.0.0.1,127.0.0", "'127.0.0' is not an IPv4 or IPv6 address"),
    ("127.0.0.1,127.0.0.1", "127.0.0.1 is listed twice"),
    ("127.0.0.1,127.0.0.2,127.0.0.3", "the job has 2 nodes but 3 addresses are given"),
])
def test_master_refuses_bad_node_ips_before_torchrun(tmp_path, node_ips, expected):
    result, seconds = _run_script("run_master_gpt.sh", {"NODE_IPS": node_ips}, cwd=tmp_path)
    assert expected in _one_error_line(result)
    assert "run_master_gpt: node 0" not in result.stdout  # printed just before torchrun starts
    assert seconds < 90


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script, variables, address", [
    ("run_master_gpt.sh", {"NODE_IPS": "10.9.9.1,10.9.9.2"}, "node rank 0 the address 10.9.9.1"),
    ("run_worker_gpt.sh", {"NODE_IPS": "127.0.0.1,10.9.9.2", "NODE_RANK": "1",
                           "MASTER_ADDR": "127.0.0.1"}, "node rank 1 the address 10.9.9.2"),
])
def test_node_whose_address_is_elsewhere_stops_before_torchrun(tmp_path, script, variables, address):
    """Each node's own --node-ips address is checked before launch (not under --dry-run, which
    prints commands for other machines: see the dry-run test below)."""
    result, _ = _run_script(script, {**variables, "NPROC": "1", "PP": "2"}, cwd=tmp_path)
    line = _one_error_line(result)
    assert address in line and "no interface of this machine has it" in line, line
    assert ": node " not in result.stdout  # the banner printed just before torchrun starts


@pytest.mark.timeout(60)
@pytest.mark.parametrize("script, variables, expected", [
    ("run_master_gpt.sh", {}, "NODE_IPS is not set"),
    ("run_master_gpt.sh", {"NODE_IPS": "10.0.0.1,10.0.0.2", "NODE_RANK": "1"},
     "NODE_RANK=1; the master is node 0"),
    ("run_master_gpt.sh", {"NODE_IPS": "10.0.0.1,10.0.0.2", "NNODES": "two"}, "NNODES=two"),
    ("run_master_gpt.sh", {"NODE_IPS": "10.0.0.1,10.0.0.2", "MASTER_PORT": "70000"},
     "MASTER_PORT=70000 is not a TCP port"),
    ("run_master_gpt.sh", {"NODE_IPS": "10.0.0.1,10.0.0.2", "USE_DPP": "yes"}, "USE_DPP=yes"),
    ("run_worker_gpt.sh", {"NODE_IPS": "10.0.0.1,10.0.0.2", "NODE_RANK": "1"},
     "MASTER_ADDR is not set"),
    ("run_worker_gpt.sh", {"NODE_IPS": "10.0.0.1,10.0.0.2", "MASTER_ADDR": "10.0.0.1"},
     "NODE_RANK is not set"),
    ("run_worker_gpt.sh", {"NODE_IPS": "10.0.0.1,10.0.0.2", "MASTER_ADDR": "10.0.0.1",
                           "NODE_RANK": "0"}, "NODE_RANK=0 is not a worker's node rank"),
    ("run_worker_gpt.sh", {"NODE_IPS": "10.0.0.1,10.0.0.2", "MASTER_ADDR": "10.0.0.1",
                           "NODE_RANK": "2"}, "NODE_RANK=2 is not a worker's node rank (1..1"),
    ("run_slurm_gpt.sh", {}, "not in a SLURM job"),
    ("run_slurm_gpt.sh", {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n[1-2]",
                          "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4"},
     "the job step runs 4 tasks on 2 nodes"),
])
def test_scripts_refuse_bad_environment(tmp_path, script, variables, expected):
    result, _ = _run_script(script, variables, cwd=tmp_path, timeout=50)
    assert expected in _one_error_line(result)
    assert result.stdout == ""


@pytest.mark.timeout(180)
def test_master_and_worker_dry_run_print_their_torchrun_commands(tmp_path):
    variables = {"NODE_IPS": "10.0.0.1,10.0.0.2", "NPROC": "1", "PP": "2"}
    master, _ = _run_script("run_master_gpt.sh", variables, ["--dry-run", "--train-iters", "7"],
                            cwd=tmp_path)
    worker, _ = _run_script("run_worker_gpt.sh",
                            {**variables, "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1",
                             "MASTER_PORT": "29999"}, ["--dry-run"], cwd=tmp_path)
    for result in (master, worker):
        assert result.returncode == 0, result.stderr[-2000:]
    (rank, argv), = _node_commands(master.stdout).items()
    assert rank == 0
    assert argv[1:4] == ["-m", "megatron_dpp.rank_launcher", "--nnodes"]
    assert (_value(argv, "--nnodes"), _value(argv, "--node-rank"), _value(argv, "--master-addr"),
            _value(argv, "--master-port"), _value(argv, "--nproc-per-node")) == \
        ("2", "0", "10.0.0.1", "29500", "1")
    assert "--multi-node" in argv and _value(argv, "--node-ips") == "10.0.0.1,10.0.0.2"
    assert argv[-2:] == ["--train-iters", "7"] and "--dry-run" not in argv
    (rank, argv), = _node_commands(worker.stdout).items()
    assert (rank, _value(argv, "--node-rank"), _value(argv, "--master-port")) == (1, "1", "29999")


@pytest.mark.timeout(180)
def test_bert_master_and_worker_start_pretrain_bert_on_the_bert_recipe_and_data(tmp_path):
    variables = {"NODE_IPS": "10.0.0.1,10.0.0.2", "NPROC": "1", "PP": "2"}
    master, _ = _run_script("run_master_bert.sh", variables, ["--dry-run"], cwd=tmp_path)
    worker, _ = _run_script("run_worker_bert.sh",
                            {**variables, "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1"},
                            ["--dry-run", "--mask-prob", "0.2"], cwd=tmp_path)
    for result in (master, worker):
        assert result.returncode == 0, result.stderr[-2000:]
        assert "recipe bert_tiny" in result.stdout
    for rank, argv in [*_node_commands(master.stdout).items(), *_node_commands(worker.stdout).items()]:
        assert argv[argv.index("-m", 3) + 1] == "megatron_dpp.pretrain_bert"
        assert _value(argv, "--data-path").endswith("sample_bert_text_sentence")
        assert _value(argv, "--vocab-file").endswith("bert-vocab.txt")
        assert _value(argv, "--node-rank") == str(rank) and "--use-dpp" in argv
    assert _value(_node_commands(worker.stdout)[1], "--mask-prob") == "0.2"
    # A bad BERT flag is refused by BERT's own checks, before torchrun (--dry-run: this machine
    # has neither node's address, which a real start checks too).
    bad, _ = _run_script("run_master_bert.sh", variables, ["--dry-run", "--mask-prob", "1.5"],
                         cwd=tmp_path)
    assert "--mask-prob" in _one_error_line(bad) and "node 0" not in bad.stdout


def _tiny_strategy(path, num_nodes: int) -> str:
    """A strategy JSON from the search for the tiny GPT on num_nodes x 2 processes (a preset)."""
    result = subprocess.run(
        ["bash", str(SCRIPTS / "start-search.sh"), "--cpu", "--num-layers", "4", "--hidden-size",
         "128", "--num-attention-heads", "4", "--seq-length", "128", "--global-batch-size", "16",
         "--num-nodes", str(num_nodes), "--num-gpus-per-node", "2", "--memory-budget-gb", "4",
         "--hardware", "8xH100-nvlink-ib400", "--output-strategy", str(path)],
        capture_output=True, text=True, timeout=100, env=_env())
    assert result.returncode == 0, result.stderr[-2000:]
    return str(path)


@pytest.mark.timeout(180)
def test_strategy_file_sets_the_layout_and_processes(tmp_path):
    strategy = _tiny_strategy(tmp_path / "tiny.json", num_nodes=1)
    flags = subprocess.run([PYTHON, "-m", "megatron_dpp.search.strategy", strategy, "--print",
                            "flags"], capture_output=True, text=True, timeout=60).stdout.splitlines()
    result, _ = _run_script("run_single_gpt.sh", {}, ["--strategy", strategy, "--dry-run",
                                                      "--log-interval", "3"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    (_, argv), = _node_commands(result.stdout).items()
    tp = _value(flags, "--tensor-model-parallel-size")
    assert f"TP={tp} PP=1" in result.stdout and f"strategy {strategy}" in result.stdout
    assert _value(argv, "--nproc-per-node") == "2"
    # The strategy's flags replace the recipe's of the same choice (megatron_dpp/launcher_flags.py)
    # and reach the command in their order; the extra arguments come last.
    start = argv.index(flags[0])
    assert argv[start:start + len(flags)] == flags and argv[-2:] == ["--log-interval", "3"]
    assert argv.count(flags[0]) == 1
    refusals = [
        ("run_single_gpt.sh", {"PP": "2"}, "PP=2 and --strategy both choose the layout"),
        ("run_single_gpt.sh", {"NPROC": "4"}, "NPROC=4, but --strategy"),
        ("run_single_bert.sh", {}, "is a gpt strategy; start it with run_*_gpt.sh"),
        ("run_master_gpt.sh", {"NODE_IPS": "10.0.0.1,10.0.0.2"}, "was searched for 1 node(s)"),
    ]
    for script, variables, expected in refusals:
        refused, _ = _run_script(script, variables, ["--strategy", strategy], cwd=tmp_path)
        assert expected in _one_error_line(refused), (script, refused.stderr)
    missing, _ = _run_script("run_single_gpt.sh", {}, ["--strategy", str(tmp_path / "no.json")],
                             cwd=tmp_path)
    assert "no such file" in _one_error_line(missing)


# Each model's SLURM launcher and the trainer it starts.
SLURM_ENTRIES = {"gpt": ["megatron_dpp.pretrain_gpt"], "bert": ["megatron_dpp.pretrain_bert"],
                 "llama": ["megatron_dpp.pretrain", "--model", "llama"]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", sorted(SLURM_ENTRIES))
def test_slurm_dry_run_prints_one_command_per_node(tmp_path, model):
    result, _ = _run_script(f"run_slurm_{model}.sh",
                            {"SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "0",
                             "SLURM_JOB_NODELIST": "127.0.0.[1-2]", "NPROC": "1"},
                            ["--dry-run"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    commands = _node_commands(result.stdout)
    assert sorted(commands) == [0, 1]
    entry = SLURM_ENTRIES[model]
    for rank, argv in commands.items():
        start = len(argv) - argv[::-1].index("-m")  # the trainer: torchrun's last -m
        assert argv[start:start + len(entry)] == entry, argv
        assert _value(argv, "--nnodes") == "2" and _value(argv, "--node-rank") == str(rank)
        assert _value(argv, "--master-addr") == "127.0.0.1"
        assert "--multi-node" in argv and _value(argv, "--node-ips") == "127.0.0.1,127.0.0.2"


@pytest.mark.timeout(120)
def test_slurm_node_ips_given_replace_the_resolved_node_list(tmp_path):
    # gpu[01-02] does not resolve here: NODE_IPS given, nothing is resolved.
    result, _ = _run_script("run_slurm_gpt.sh",
                            {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[01-02]",
                             "NODE_IPS": "10.0.0.1,10.0.0.2", "NPROC": "1"},
                            ["--dry-run"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    commands = _node_commands(result.stdout)
    assert sorted(commands) == [0, 1]
    assert all(_value(argv, "--master-addr") == "10.0.0.1"
               and _value(argv, "--node-ips") == "10.0.0.1,10.0.0.2" for argv in commands.values())


@pytest.mark.timeout(60)
def test_slurm_refuses_a_host_that_does_not_resolve(tmp_path):
    result, _ = _run_script("run_slurm_gpt.sh",
                            {"SLURM_JOB_NUM_NODES": "2",
                             "SLURM_JOB_NODELIST": f"127.0.0.1,{UNRESOLVABLE}"},
                            ["--dry-run"], cwd=tmp_path, timeout=50)
    assert f"host {UNRESOLVABLE} does not resolve" in _one_error_line(result)
    assert "node 0:" not in result.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", ["gpt", "bert"])
def test_slurm_batch_script_starts_itself_once_per_node_with_srun(tmp_path, model):
    """Outside a job step the script checks the flags, then hands over to srun (here a fake that
    records its arguments and the environment it was given)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "srun.txt"
    fake_srun = bin_dir / "srun"
    fake_srun.write_text(f'#!/bin/sh\n{{ echo "$@"; echo "NODE_IPS=$NODE_IPS"; '
                         f'echo "MASTER_ADDR=$MASTER_ADDR"; echo "DPP_JOB_KEY=$DPP_JOB_KEY"; }} '
                         f'> {shlex.quote(str(record))}\n')
    fake_srun.chmod(0o755)
    result, _ = _run_script(f"run_slurm_{model}.sh",
                            {"SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "0",
                             "SLURM_JOB_NODELIST": "127.0.0.[1-2]", "NPROC": "1",
                             "PATH": f"{bin_dir}:{os.environ['PATH']}"},
                            ["--log-interval", "3"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    arguments, node_ips, master, key = record.read_text().splitlines()
    assert arguments.startswith("--nodes=2 --ntasks=2 --ntasks-per-node=1 ")
    assert arguments.endswith(f"run_scripts/run_slurm_{model}.sh --log-interval 3")
    assert (node_ips, master) == ("NODE_IPS=127.0.0.1,127.0.0.2", "MASTER_ADDR=127.0.0.1")
    # One job key for every node, drawn here (srun hands it over): 64 hexadecimal digits.
    assert re.fullmatch(r"DPP_JOB_KEY=[0-9a-f]{64}", key), key


# ----------------------------------------------------------------------------------------------
# two nodes on this machine
# ----------------------------------------------------------------------------------------------
def _second_local_ipv4() -> str | None:
    for _interface, address in local_addresses():
        parsed = ipaddress.ip_address(address)
        if parsed.version == 4 and not parsed.is_loopback:
            return address
    return None


