"""Two nodes for real: the master in one network namespace, the worker in another, joined by a veth
pair (tests/_netns.py), started by run_master_gpt.sh and run_worker_gpt.sh. Pipeline messages
between the nodes go through rdma_tensor (UCX over TCP here), same-node ones through shm_tensor.

Losses and grad norms must equal a single-node run (the command run_single_gpt.sh gives for the
same flags) to 1e-5 relative, every iteration; a worker rank killed with SIGKILL must end every rank
on both nodes within the timeout, with an error naming the dead peer, and leave nothing in /dev/shm.
The two-node runs are traced (--trace): each rank's trace must be on rank 0's clock, no receive
before its send.

UCX_TLS=tcp: both namespaces share one kernel and /dev/shm, so UCX could otherwise carry the
cross-"node" messages through shared memory; on real nodes nothing needs setting.
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from _netns import netns_skip_reason, two_node_network
from _trace_checks import check_clock_alignment, check_messages, load_traces
from _train_util import REPO_ROOT, TINY_GPT_ARGS, ensure_sample_data, parse_log, run_training
from megatron_dpp.exit_codes import BAD_INPUT, LOST_PEER

SCRIPTS = REPO_ROOT / "run_scripts"
BASE_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "UCX_TLS": "tcp"}
TRAIN_ARGS = [*TINY_GPT_ARGS, "--train-iters", "3", "--p2p-timeout", "60", "--dpp-timeout", "60"]
MICROBATCHES = 8  # TINY_GPT_ARGS: global batch 8 of micro-batches of 1, no data parallelism


def _skip_unless_two_nodes() -> None:
    reason = netns_skip_reason()
    if reason:
        pytest.skip(f"two network namespaces cannot be made here: {reason}")
    if not __import__("rdma_tensor").unavailable_reason() == "":
        pytest.skip("rdma_tensor is not built (libucx-dev missing)")


def _env(**layout: str) -> dict:
    env = dict(os.environ)
    env.update(BASE_ENV)
    env.update(layout)
    return env


_single_node_cache: dict = {}


def _single_node(layout: dict, extra: list[str], timeout: float) -> tuple[list[float], list[float]]:
    """run_single_gpt.sh on this machine (one node, shm_tensor between its ranks); run once per
    layout and flags (pp2_dpp and pp2_1f1b compare with the same single-node run)."""
    key = (tuple(sorted(layout.items())), tuple(extra))
    if key not in _single_node_cache:
        _single_node_cache[key] = _run_single_node(layout, extra, timeout)
    return _single_node_cache[key]


def _run_single_node(layout: dict, extra: list[str], timeout: float) -> tuple[list[float], list[float]]:
    """The command run_single_gpt.sh would start (its --dry-run), its ranks forked as the suite's
    other training runs are (_train_util.run_training): the launcher itself is tested elsewhere."""
    dry = subprocess.run(["bash", str(SCRIPTS / "run_single_gpt.sh"), "--dry-run", *TRAIN_ARGS, *extra],
                         env=_env(**layout), cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr[-4000:]
    (command,) = [shlex.split(line.split(": ", 1)[1]) for line in dry.stdout.splitlines()
                  if line.startswith("node 0: ")]
    nproc = int(command[command.index("--nproc-per-node") + 1])
    flags = command[command.index("megatron_dpp.pretrain_gpt") + 1:]
    returncode, losses, grad_norms, output = run_training(
        flags, nproc=nproc, timeout=timeout, base_args=[], with_data=False, env=_env(**layout))
    assert returncode == 0, output[-4000:]
    assert losses and grad_norms, output[-2000:]
    return losses, grad_norms


def _start_nodes(net, layout: dict, extra: list[str], logs: Path, port: int,
                 node_extra: tuple[list[str], list[str]] = ([], [])):
    """run_master_gpt.sh in namespace 0 and run_worker_gpt.sh in namespace 1 (`node_extra`: flags
    for one node only); their output goes to files (a pipe nobody reads could fill and stall a
    rank)."""
    common = dict(layout, NNODES="2", NODE_IPS=",".join(net.ips), MASTER_ADDR=net.ips[0],
                  MASTER_PORT=str(port))
    processes = []
    for node, script in enumerate(("run_master_gpt.sh", "run_worker_gpt.sh")):
        out = open(logs / f"node{node}.log", "w")
        env = _env(**common, NODE_RANK=str(node))
        command = ["bash", str(SCRIPTS / script), *TRAIN_ARGS, *extra, *node_extra[node]]
        processes.append(net.popen(node, command, env=env, cwd=REPO_ROOT, stdout=out,
                                   stderr=subprocess.STDOUT))
        out.close()
    return processes


def _wait_all(processes, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for process in processes:
        try:
            codes.append(process.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    return codes


def _assert_close(name: str, got: list[float], want: list[float]) -> None:
    assert len(got) == len(want), f"{name}: {got} vs single node {want}"
    for index, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 1e-5 * abs(b), f"{name} at iteration {index + 1}: {a} vs single node {b}"


def _run_two_nodes(tmp_path: Path, layout: dict, extra: list[str], timeout: float):
    port = 29400 + os.getpid() % 400
    with two_node_network() as net:
        processes = _start_nodes(net, layout, extra, tmp_path, port)
        codes = _wait_all(processes, timeout)
    logs = [(tmp_path / f"node{node}.log").read_text() for node in range(2)]
    assert codes == [0, 0], f"exit codes {codes}\n--- master\n{logs[0][-3000:]}\n--- worker\n{logs[1][-3000:]}"
    return logs


# (name, per-node layout env, extra flags, single-node layout env)
CASES = [
    ("pp2_dpp", dict(PP="2", NPROC="1", USE_DPP="1"), [], dict(PP="2", NPROC="2", USE_DPP="0")),
    ("pp2_1f1b", dict(PP="2", NPROC="1", USE_DPP="0"), [], dict(PP="2", NPROC="2", USE_DPP="0")),
    # RECIPE named: the tiny recipe with 8 layers (a shape flag alone means no recipe).
    ("pp4_vpp2_varlen_dpp", dict(PP="4", VPP="2", NPROC="2", USE_DPP="1", RECIPE="gpt3_tiny"),
     ["--num-layers", "8", "--variable-seq-lengths"],
     dict(PP="4", VPP="2", NPROC="4", USE_DPP="1", RECIPE="gpt3_tiny")),
    # The v placement across the nodes: stages 0, 3 on the master, 1, 2 (the turn) on the worker;
    # against the v on one node, which tests/test_dpp_parity.py holds to Megatron's 1F1B.
    ("pp2_v_dpp", dict(PP="2", VPP="2", NPROC="1", USE_DPP="1"), ["--dpp-stage-placement", "v"],
     dict(PP="2", VPP="2", NPROC="2", USE_DPP="1")),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name,layout,extra,single_layout", CASES, ids=[case[0] for case in CASES])
def test_two_nodes_match_single_node(tmp_path, name, layout, extra, single_layout):
    _skip_unless_two_nodes()
    ensure_sample_data()
    want_losses, want_norms = _single_node(single_layout, extra, timeout=280)
    # The two-node run is also traced: the same losses, and every rank's trace on rank 0's clock,
    # aligned across the nodes by ping-pong (no receive before its send).
    traces_dir = tmp_path / "traces"
    logs = _run_two_nodes(tmp_path, layout, [*extra, "--trace", "--trace-dir", str(traces_dir)],
                          timeout=280)
    # The last pipeline stage logs the loss: on the worker node (node 1), on the master for the v.
    losses, norms = parse_log(logs[1] + logs[0])
    _assert_close(f"{name} lm loss", losses[:len(want_losses)], want_losses)
    _assert_close(f"{name} grad norm", norms[:len(want_norms)], want_norms)
    routes = "\n".join(logs)
    assert "rdma_tensor (other node)" in routes, routes[-3000:]
    if layout["NPROC"] == "2":
        assert "shm_tensor (same node)" in routes, routes[-3000:]
    _, traces = load_traces(traces_dir, world_size=2 * int(layout["NPROC"]))
    assert {trace["otherData"]["node"] for trace in traces.values()} == {0, 1}
    check_clock_alignment(traces)
    check_messages(traces, chunks=int(layout.get("VPP", "1")), microbatches=MICROBATCHES)


def _rank_pid(net, node: int) -> int | None:
    """The pid of the training process (not torchrun) inside namespace `node`."""
    listed = subprocess.run(["ip", "netns", "pids", net.names[node]], capture_output=True, text=True,
                            timeout=10).stdout.split()
    for pid in listed:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"megatron_dpp.pretrain_gpt" in cmdline and b"megatron_dpp.rank_launcher" not in cmdline:
            return int(pid)
    return None


def _wait_for_iteration_3(processes, worker_log: Path) -> None:
    """Until the worker logged iteration 3 (both nodes train); fails if a node ended or after 200 s."""
    deadline = time.monotonic() + 200
    while not re.search(r"iteration\s+3/", worker_log.read_text()):
        assert time.monotonic() < deadline, worker_log.read_text()[-3000:]
        assert all(p.poll() is None for p in processes), worker_log.read_text()[-3000:]
        time.sleep(0.5)


@pytest.mark.timeout(300)
def test_killed_worker_ends_every_rank(tmp_path):
    _skip_unless_two_nodes()
    ensure_sample_data()
    shm_before = set(os.listdir("/dev/shm"))
    timeout_s = 20
    extra = ["--train-iters", "500", "--p2p-timeout", str(timeout_s), "--dpp-timeout", str(timeout_s)]
    layout = dict(PP="2", NPROC="1", USE_DPP="1")
    with two_node_network() as net:
        processes = _start_nodes(net, layout, extra, tmp_path, 29800 + os.getpid() % 100)
        _wait_for_iteration_3(processes, tmp_path / "node1.log")
        victim = _rank_pid(net, 1)
        assert victim is not None, "no training process found in the worker's namespace"
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        codes = _wait_all(processes, timeout=3 * timeout_s + 30)
        elapsed = time.monotonic() - killed_at
    master_log = (tmp_path / "node0.log").read_text()
    print(f"both nodes exited {elapsed:.1f} s after the kill, codes {codes}; master's error:\n"
          + "\n".join(line for line in master_log.splitlines() if "[dpp rank" in line)[:1500])
    assert None not in codes, f"a node did not exit {elapsed:.0f} s after the kill:\n{master_log[-3000:]}"
    assert codes[0] != 0 and codes[1] != 0, codes
    # The master's rank names the dead peer: rank 1 and its node's address when it waited for a
    # pipeline message, its node when it waited in a collective (gradient all-reduce).
    named = (re.search(r"rank 1 at 10\.\d+\.\d+\.2.*peer lost", master_log)
             or re.search(r"lost the peer at 10\.\d+\.\d+\.2 \(node 1 of --node-ips\)", master_log))
    assert named, master_log[-3000:]
    leftover = set(os.listdir("/dev/shm")) - shm_before
    assert not [name for name in leftover if name.startswith("dpp-")], leftover


@pytest.mark.timeout(240)
@pytest.mark.parametrize("use_dpp", ["1", "0"], ids=["dpp", "megatron_1f1b"])
def test_a_link_down_between_the_nodes_ends_every_rank_naming_the_peer(tmp_path, use_dpp):
    """A network partition with nothing killed: the link between the nodes goes down while they
    train. No connection resets, so the transports see nothing; the heartbeats end the rank on
    each node within the heartbeat timeout (short here; the default's 30 s bound is checked with
    a frozen rank in test_heartbeat.py), with exit code LOST_PEER, naming the rank on the other
    node, its address and the direction that went silent."""
    _skip_unless_two_nodes()
    ensure_sample_data()
    heartbeat_timeout_s = 4
    extra = ["--train-iters", "500", "--heartbeat-interval", "0.5",
             "--heartbeat-timeout", str(heartbeat_timeout_s)]
    layout = dict(PP="2", NPROC="1", USE_DPP=use_dpp)
    with two_node_network() as net:
        processes = _start_nodes(net, layout, extra, tmp_path,
                                 29700 + int(use_dpp) * 50 + os.getpid() % 50)
        _wait_for_iteration_3(processes, tmp_path / "node1.log")
        subprocess.run(["ip", "-n", net.names[0], "link", "set", net.interfaces[0], "down"],
                       check=True, timeout=30)
        down_at = time.monotonic()
        codes = _wait_all(processes, timeout=60)
        elapsed = time.monotonic() - down_at
    logs = [(tmp_path / f"node{node}.log").read_text() for node in range(2)]
    reports = ["\n".join(line for line in log.splitlines() if line.startswith("[dpp rank"))
               for log in logs]
    print(f"both nodes exited {elapsed:.1f} s after the link went down, codes {codes}:\n"
          + "\n".join(reports))
    assert None not in codes, f"a node still runs {elapsed:.0f} s after the link went down:\n" \
                              + "\n".join(log[-2000:] for log in logs)
    assert elapsed < 30, elapsed
    assert codes == [LOST_PEER, LOST_PEER], "\n".join(log[-2000:] for log in logs)
    for node, peer in ((0, 1), (1, 0)):
        address = re.escape(net.ips[peer])
        named = rf"^\[dpp rank {node}\] lost rank {peer} \(node {peer}, {address}\): " \
                rf"(no heartbeat from it for [\d.]+ s \(inbound\)|it hears us no longer \(outbound)"
        assert re.search(named, reports[node], re.MULTILINE), reports[node] or logs[node][-3000:]


@pytest.mark.timeout(240)
def test_nodes_that_would_reach_each_other_differently_stop_at_start_in_one_line(tmp_path):
    """The master routes its cross-node peer by rdma_tensor (`auto`), the worker by torch.distributed
    (`--p2p-transport shm`: shm_tensor on the node, torch.distributed beyond): the same mismatch as
    UCX installed on one node only. Before any transport is built both ranks say so in one line and
    exit 2, instead of waiting out the rendezvous timeout."""
    _skip_unless_two_nodes()
    ensure_sample_data()
    layout = dict(PP="2", NPROC="1", USE_DPP="1")
    with two_node_network() as net:
        processes = _start_nodes(net, layout, [], tmp_path, 29650 + os.getpid() % 50,
                                 node_extra=([], ["--p2p-transport", "shm"]))
        codes = _wait_all(processes, timeout=150)
        ips = net.ips
    logs = [(tmp_path / f"node{node}.log").read_text() for node in range(2)]
    assert codes == [BAD_INPUT, BAD_INPUT], f"exit codes {codes}\n" + "\n".join(
        log[-3000:] for log in logs)
    said = {0: f"megatron_dpp: error: transport: rank 0 on {ips[0]} reaches rank 1 by rdma_tensor "
               f"(other node), but rank 1 on {ips[1]} reaches rank 0 by torch.distributed (fallback)",
            1: f"megatron_dpp: error: transport: rank 1 on {ips[1]} reaches rank 0 by "
               f"torch.distributed (fallback), but rank 0 on {ips[0]} reaches rank 1 by rdma_tensor "
               "(other node)"}
    for node in range(2):
        assert said[node] in logs[node], logs[node][-3000:]
        assert "Traceback" not in logs[node], logs[node][-3000:]
