"""A one-node job listens on 127.0.0.1 only (megatron_dpp/loopback_store.py): the rank launcher
makes the rendezvous store there before torchrun starts, where torchrun's own would listen on every
interface, and hands the ranks a fresh job key. Real processes: the launcher and two gloo ranks,
whose every listening socket (read from /proc) is on loopback.
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest

from _train_util import REPO_ROOT
from megatron_dpp.loopback_store import LOOPBACK, LoopbackStore, is_one_node, loopback_port_wanted

# Run in each rank: after a gloo barrier (every connection made), print the addresses of every
# listening TCP socket held by this rank or by its parent (the launcher, which holds the store).
_RANK_SCRIPT = textwrap.dedent("""
    import os, torch.distributed as dist

    def socket_inodes(pid):
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        return inodes

    def listening(inodes):
        found = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as rows:
                next(rows)
                for row in rows:
                    fields = row.split()
                    if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                        found.append(fields[1])
        return found

    dist.init_process_group("gloo")
    dist.barrier()
    inodes = socket_inodes(os.getpid()) | socket_inodes(os.getppid())
    for address in listening(inodes):
        print(f"rank {dist.get_rank()} listening {address}", flush=True)
    key = os.environ.get("DPP_JOB_KEY", "")
    print(f"rank {dist.get_rank()} master {os.environ['MASTER_ADDR']} key {len(key)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
""")

# /proc/net/tcp writes an address as hex of its bytes in host order, then the port.
_LOOPBACK_HEX = {"0100007F", "00000000000000000000000001000000"}


def _torchrun_args(argv):
    from torch.distributed import run as torchrun

    return torchrun.parse_args(argv + ["script.py"])


def test_only_a_one_node_job_of_the_launchers_forms_is_taken_over():
    assert is_one_node("1") and is_one_node("1:1")
    assert not is_one_node("2") and not is_one_node("1:2")
    assert loopback_port_wanted(_torchrun_args(["--nnodes", "1", "--standalone"])) == 0
    assert loopback_port_wanted(_torchrun_args(
        ["--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", "29611"])) == 29611
    for argv in (["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "29611"],
                 ["--nnodes", "1", "--master-addr", "10.0.0.1", "--master-port", "29611"],
                 ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "host:29611"]):
        assert loopback_port_wanted(_torchrun_args(argv)) is None, argv


def test_the_store_listens_on_loopback_and_points_torchrun_at_it():
    with LoopbackStore(0) as store:
        args = argparse.Namespace(standalone=True, rdzv_backend="c10d", rdzv_endpoint="x:0",
                                  master_addr="host", master_port=1)
        store.use_in(args)
        assert (args.standalone, args.rdzv_backend, args.rdzv_endpoint, args.master_addr,
                args.master_port) == (False, "static", "", LOOPBACK, store.port)
        with socket.create_connection((LOOPBACK, store.port), timeout=5):
            pass
        outside = _an_address_of_this_machine_beyond_loopback()
        if outside is not None:
            with pytest.raises(OSError):
                socket.create_connection((outside, store.port), timeout=5).close()


def test_gloo_and_nccl_are_pointed_at_loopback_unless_the_user_chose():
    from megatron_dpp.loopback_store import sockets_on_loopback

    environ = {"NCCL_SOCKET_IFNAME": "ib0"}
    sockets_on_loopback(environ)
    assert environ == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "ib0"}


def _an_address_of_this_machine_beyond_loopback():
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 9))  # picks a route, sends nothing
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address


def _launch(tmp_path, *rendezvous, env_extra=None):
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    env = {name: value for name, value in os.environ.items() if name != "DPP_JOB_KEY"}
    env.update(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "megatron_dpp.rank_launcher", "--nnodes", "1",
                           *rendezvous, "--nproc-per-node", "2", str(script)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("rendezvous", [["--standalone"], ["--master-addr", "127.0.0.1",
                                                           "--master-port", "0"]],
                         ids=["standalone", "master_port"])
def test_a_one_node_job_listens_on_loopback_only_and_gets_a_key(tmp_path, rendezvous):
    result = _launch(tmp_path, *rendezvous)
    assert result.returncode == 0, result.stderr[-3000:]
    listening = re.findall(r"rank \d listening ([0-9A-F]+):([0-9A-F]+)", result.stdout)
    assert listening, result.stdout  # the store (the launcher's) and gloo's, at least
    assert {address for address, _port in listening} <= _LOOPBACK_HEX, listening
    masters = re.findall(r"rank (\d) master (\S+) key (\d+)", result.stdout)
    assert sorted(masters) == [("0", LOOPBACK, "64"), ("1", LOOPBACK, "64")], result.stdout


@pytest.mark.timeout(150)
def test_the_users_key_is_kept(tmp_path):
    result = _launch(tmp_path, "--standalone", env_extra={"DPP_JOB_KEY": "ab" * 20})
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.findall(r"rank \d master \S+ key (\d+)", result.stdout) == ["40", "40"]


@pytest.mark.timeout(60)
def test_a_port_in_use_is_one_line_exit_2(tmp_path):
    taken = socket.socket()
    taken.bind((LOOPBACK, 0))
    taken.listen(1)
    with taken:
        port = taken.getsockname()[1]
        result = _launch(tmp_path, "--master-addr", "127.0.0.1", "--master-port", str(port))
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == (f"megatron_dpp.rank_launcher: error: cannot listen on 127.0.0.1:{port} "
                         f"for the rendezvous store (MASTER_PORT): Address already in use"), lines
    assert "Traceback" not in result.stderr
