"""Start a training run's ranks as torchrun does, but forked from preloaded servers
(`_rank_zygote.py`): the test suite's runs skip torchrun's start (3-4 s) and each rank's imports
(4-7 s of CPU on the 2-core CI machine).

    returncode, output = run_forked("megatron_dpp.pretrain_gpt", args, nproc=2, env=env,
                                    cwd=REPO_ROOT, timeout=300)
    # None where `env` shows a GPU (not CUDA_VISIBLE_DEVICES=""): run under torchrun then.
    codes, stdouts, stderrs = run_forked_apart(...)  # as ranks started directly: each its own

Kept from `torchrun --standalone --nproc-per-node=N -m MODULE ARGS`: every rank a process of its
own, in a session of its own, running MODULE as `python -m` does, with torchrun's variables (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_*, MASTER_ADDR,
MASTER_PORT, TORCHELASTIC_RUN_ID, ...; rank 0 hosts the rendezvous store instead of the agent);
the ranks' stdout and stderr on one pipe; when a rank fails, SIGTERM to the others' sessions, SIGKILL
30 s later, exit code 1, and the report torchrun prints below its ChildFailedError (each failed
rank's `rank` and `exitcode` lines). Not kept: the agent's restarts (the tests run none) and its error file.
The launcher itself is tested through its own entry points (run_single_gpt.sh, rank_launcher, the
multi-node, timeout, heartbeat and signal tests, which start torchrun).

run_forked_apart starts the same ranks as processes started directly (not under torchrun) would
be: each with a stdout and a stderr of its own, ending on its own, with its own exit code.

One server per local rank index, each with its own hash seed (as separate interpreters have), so
that an order that depends on string hashing still differs between ranks.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Optional, Sequence

from _ports import free_local_port
from _rank_zygote import HEADER, kill_session

REPO_ROOT = Path(__file__).resolve().parents[1]
_SERVER_SCRIPT = Path(__file__).resolve().parent / "_rank_zygote.py"
_SERVER_START_TIMEOUT_S = 300
_STOP_GRACE_S = 30  # torchrun's: SIGTERM, then SIGKILL this much later
# Differs from test to test and changes nothing a rank imports.
_IGNORED_VARIABLES = frozenset({"PYTEST_CURRENT_TEST"})


class _Server:
    def __init__(self, directory: str, index: int, env: dict):
        self.socket_path = os.path.join(directory, f"rank{index}.sock")
        self.log_path = os.path.join(directory, f"rank{index}.log")
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(_SERVER_SCRIPT), self.socket_path], stdout=subprocess.PIPE,
                stderr=log, stdin=subprocess.DEVNULL, env=env, cwd=REPO_ROOT,
                start_new_session=True)
        self._ready = False

    def wait_ready(self) -> None:
        if self._ready:
            return
        selector = selectors.DefaultSelector()
        selector.register(self.process.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + _SERVER_START_TIMEOUT_S
        line = b""
        while time.monotonic() < deadline and not line.endswith(b"\n"):
            if selector.select(timeout=max(0.0, deadline - time.monotonic())):
                chunk = os.read(self.process.stdout.fileno(), 64)
                if not chunk:
                    break
                line += chunk
        selector.close()
        if line.strip() != b"ready":
            log = Path(self.log_path).read_text(errors="replace")[-3000:]
            raise AssertionError(f"the rank server did not start within {_SERVER_START_TIMEOUT_S} s "
                                 f"(said {line!r}):\n{log}")
        self._ready = True

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process.stdout.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)


class _Servers:
    """The running servers, started on first use with that run's environment."""

    def __init__(self):
        self.directory: Optional[str] = None
        self.env: Optional[dict] = None
        self.servers: list[_Server] = []

    def matching(self, env: dict, nproc: int) -> Optional[list[_Server]]:
        """Servers for local ranks 0..nproc-1 started with `env` (those running are replaced
        where theirs differs); None where `env` shows a GPU: a process that has touched CUDA
        cannot fork working children, and the servers' imports ask whether CUDA is there."""
        if env.get("CUDA_VISIBLE_DEVICES") != "":
            return None
        comparable = {k: v for k, v in env.items() if k not in _IGNORED_VARIABLES}
        if self.directory is None:
            self.directory = tempfile.mkdtemp(prefix="dpp-rank-servers-")
            atexit.register(self.stop)
        if comparable != self.env:
            for server in self.servers:
                server.stop()
            self.servers, self.env = [], comparable
        while len(self.servers) < nproc:  # start them all before waiting for the first
            self.servers.append(_Server(self.directory, len(self.servers), env))
        for server in self.servers[:nproc]:
            server.wait_ready()
        return self.servers[:nproc]

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
        self.servers = []
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


_SERVERS = _Servers()


def _rank_env(env: dict, rank: int, nproc: int, port: int, run_id: str) -> dict:
    """torchrun's variables for one rank of a one-node job (torch/distributed/elastic/agent)."""
    return {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
            "ROLE_RANK": str(rank), "ROLE_NAME": "default", "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "ROLE_WORLD_SIZE": str(nproc),
            "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": run_id, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def _send_request(server: _Server, request: dict,
                  output_fds: list[int]) -> tuple[socket.socket, int]:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.settimeout(30)
    connection.connect(server.socket_path)
    body = json.dumps(request).encode()
    socket.send_fds(connection, [HEADER.pack(len(body)) + body], output_fds)
    reply = b""
    while not reply.endswith(b"\n"):
        chunk = connection.recv(64)
        if not chunk:
            raise AssertionError(f"the rank server closed without forking; its log: "
                                 f"{Path(server.log_path).read_text(errors='replace')[-2000:]}")
        reply += chunk
    kind, value = reply.split()
    assert kind == b"pid", reply
    connection.settimeout(None)
    return connection, int(value)


def run_forked(module: str, args: Sequence[str], nproc: int, env: dict, cwd: Path,
               timeout: float) -> Optional[tuple[int, str]]:
    """(exit code as torchrun's, the ranks' output); None where `env` shows a GPU.
    Raises AssertionError with the output so far when the run outlives `timeout`."""
    servers = _SERVERS.matching(env, nproc)
    if servers is None:
        return None
    read_fd, write_fd = os.pipe()
    pids, (output,) = _run(servers, module, args, env, cwd, [(write_fd,)] * nproc, [read_fd],
                           timeout, stop_on_failure=True)
    text = output.decode(errors="replace")
    failed = [(rank, pid, code) for rank, (pid, code) in enumerate(pids) if code != 0]
    if not failed:
        return 0, text
    return 1, text + _failure_report(failed)


def run_forked_apart(module: str, args: Sequence[str], nproc: int, env: dict, cwd: Path,
                     timeout: float) -> Optional[tuple[list[int], list[str], list[str]]]:
    """The ranks as run_forked starts them, but as separate processes started directly would
    be (no torchrun): each ends on its own (a failed rank stops no other), with a stdout and a
    stderr of its own. (each rank's exit code, as Popen.returncode; each rank's stdout; each
    rank's stderr), in rank order; None where `env` shows a GPU. Raises AssertionError with
    the output so far when the run outlives `timeout`."""
    servers = _SERVERS.matching(env, nproc)
    if servers is None:
        return None
    pipes = [os.pipe() for _ in range(2 * nproc)]  # rank r: stdout 2r, stderr 2r + 1
    written = [(pipes[2 * rank][1], pipes[2 * rank + 1][1]) for rank in range(nproc)]
    pids, outputs = _run(servers, module, args, env, cwd, written,
                         [read_fd for read_fd, _ in pipes], timeout, stop_on_failure=False)
    texts = [output.decode(errors="replace") for output in outputs]
    return [code for _, code in pids], texts[0::2], texts[1::2]


def _run(servers: list[_Server], module: str, args: Sequence[str], env: dict, cwd: Path,
         written: list[tuple[int, ...]], read_fds: list[int], timeout: float,
         stop_on_failure: bool) -> tuple[list[tuple[int, int]], list[bytes]]:
    """Fork rank r on servers[r] with written[r] as its output fds (closed here once sent), then
    _watch: ([(pid, exit code)] in rank order, what each of read_fds gave)."""
    nproc = len(written)
    port, run_id = free_local_port(), str(uuid.uuid4())
    connections: dict[socket.socket, int] = {}  # connection -> rank pid
    try:
        for rank, server in enumerate(servers):
            request = {"module": module, "args": list(args), "cwd": str(cwd),
                       "env": _rank_env(env, rank, nproc, port, run_id)}
            connection, pid = _send_request(server, request, list(written[rank]))
            connections[connection] = pid
    except BaseException:
        for fd in {*(fd for fds in written for fd in fds), *read_fds}:
            os.close(fd)
        for connection, pid in connections.items():
            kill_session(pid, signal.SIGKILL)
            connection.close()
        raise
    for fd in {fd for fds in written for fd in fds}:
        os.close(fd)
    return _watch(read_fds, connections, timeout, stop_on_failure)


def _watch(read_fds: list[int], connections: dict[socket.socket, int], timeout: float,
           stop_on_failure: bool) -> tuple[list[tuple[int, int]], list[bytes]]:
    """Collect the outputs and exit codes; with stop_on_failure, stop the rest when one rank
    fails, as torchrun does."""
    selector = selectors.DefaultSelector()
    for index, read_fd in enumerate(read_fds):
        selector.register(read_fd, selectors.EVENT_READ, index)
    for connection in connections:
        selector.register(connection, selectors.EVENT_READ, connection)
    outputs, codes = [bytearray() for _ in read_fds], {}
    pids = list(connections.values())  # in rank order
    deadline = time.monotonic() + timeout
    kill_at: Optional[float] = None
    open_fds = len(read_fds)
    try:
        while open_fds or len(codes) < len(pids):
            now = time.monotonic()
            if now > deadline:
                for pid in pids:
                    kill_session(pid, signal.SIGKILL)
                so_far = b"".join(outputs).decode(errors="replace")
                raise AssertionError(f"training did not finish within {timeout}s:\n"
                                     f"{so_far[-4000:]}")
            if kill_at is not None and now > kill_at:
                for pid in pids:
                    kill_session(pid, signal.SIGKILL)
                kill_at = None
            for key, _ in selector.select(timeout=0.5):
                if isinstance(key.data, int):
                    chunk = os.read(key.fd, 65536)
                    if chunk:
                        outputs[key.data] += chunk
                    else:
                        selector.unregister(key.fd)
                        open_fds -= 1
                    continue
                connection = key.data
                reply = connection.recv(64)
                selector.unregister(connection)
                pid = connections[connection]
                code = int(reply.split()[1]) if reply.startswith(b"exit ") else -signal.SIGKILL
                codes[pid] = code
                if (stop_on_failure and code != 0 and kill_at is None
                        and len(codes) < len(pids)):
                    for other in pids:
                        if other not in codes:
                            kill_session(other, signal.SIGTERM)
                    kill_at = time.monotonic() + _STOP_GRACE_S
    finally:
        selector.close()
        for read_fd in read_fds:
            os.close(read_fd)
        for connection in connections:
            connection.close()
    return [(pid, codes[pid]) for pid in pids], [bytes(output) for output in outputs]


def _failure_report(failed: list[tuple[int, int, int]]) -> str:
    """What torchrun prints below its ChildFailedError, one entry per failed rank."""
    lines = ["=" * 60, "forked ranks FAILED", "Failures:"]
    for rank, pid, code in failed:
        lines += [f"[{rank}]:", f"  rank      : {rank} (local_rank: {rank})",
                  f"  exitcode  : {code} (pid: {pid})"]
    return "\n".join([*lines, "=" * 60, ""])
