"""A fork server for the test suite's training runs: it imports what a rank imports once, then forks
one rank per request, so a test's run does not pay torch's and Megatron-Core's imports per rank.

Why: on the 2-core CI machine a rank spends 4-7 s of CPU importing torch, Megatron-Core and ours
before it trains a tiny model for a few seconds, and torchrun another 3-4 s before any rank starts;
the parity and checkpoint tests start a few hundred ranks. `_forked_ranks.py` is the client and says
what a run started this way keeps of torchrun's behaviour.

    python tests/_rank_zygote.py SOCKET     # prints "ready" once imported and listening

Protocol, one Unix-socket connection per rank: the client sends, with the write end of its output
pipe attached (SCM_RIGHTS; or two: stdout's, then stderr's), an 8-byte length and a JSON request
{"module", "args", "env", "cwd"};
the server answers "pid N\\n" once forked and "exit CODE\\n" when the rank has ended (CODE as
Popen.returncode: negative for a signal). A client that closes its connection early has the rank's
session killed. The server ends when its parent (the pytest process) is gone.

The forked rank becomes `python -m MODULE ARGS` in the request's directory and environment, in a
session of its own (as torchrun starts ranks), and ends through the interpreter's own exit (atexit,
threads, the exit code of SystemExit), since the fork returns out of the server to this module's
top level before the module runs.
"""
from __future__ import annotations

import gc
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import sys

_MAX_REQUEST_BYTES = 1 << 20
HEADER = struct.Struct("!Q")  # the request's length, before its JSON (the client uses it too)


def preload() -> None:
    """Import what every rank imports (the same modules `megatron_dpp.pretrain.main` loads, in its
    order), then freeze the heap so that the ranks' garbage collections skip it."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    from megatron_dpp import arguments, kernels  # noqa: F401

    kernels.import_megatron_core()
    import megatron_dpp.models  # noqa: F401
    import megatron_dpp.training.loop  # noqa: F401

    # What a rank then imports inside functions, on its way to the first iteration (1-1.5 s of CPU
    # per rank otherwise): Dynamo (torch.optim loads it when the first optimizer is built), the
    # trainer (not the entry modules: runpy warns when the module it runs is already imported),
    # each model family, the datasets (Megatron-Core's, with numpy.random and boto3, and its
    # index helpers, which a rank loads when it builds a dataset's first index cache) and
    # tokenizers, the runtime and the shared-memory transport.
    import torch._dynamo  # noqa: F401
    import megatron_dpp.pretrain  # noqa: F401
    import megatron_dpp.models.bert  # noqa: F401
    import megatron_dpp.models.gpt  # noqa: F401
    import megatron_dpp.models.llama  # noqa: F401
    import megatron_dpp.data.bert_datasets  # noqa: F401
    import megatron_dpp.data.datasets  # noqa: F401
    import megatron_dpp.mcore.datasets  # noqa: F401
    import megatron.core.datasets.blended_megatron_dataset_builder  # noqa: F401
    import megatron.core.datasets.gpt_dataset  # noqa: F401
    import megatron.core.datasets.helpers  # noqa: F401
    import tokenizers  # noqa: F401
    import megatron_dpp.runtime.executor  # noqa: F401
    import megatron_dpp.shared_gpu_memory  # noqa: F401  (the flag check's, --ranks-per-gpu)
    import shm_tensor.context  # noqa: F401
    gc.collect()
    gc.freeze()


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _receive_request(connection: socket.socket) -> tuple[dict, list[int]]:
    """(the request, the attached output fds: one for both streams, or stdout's and stderr's);
    raises ValueError on a malformed one."""
    connection.settimeout(30)
    data, fds, _, _ = socket.recv_fds(connection, _MAX_REQUEST_BYTES, 2)
    if len(fds) not in (1, 2) or len(data) < HEADER.size:
        _close_all(fds)
        raise ValueError(f"expected one or two output fds and a header, got {len(fds)} fds, "
                         f"{len(data)} B")
    (length,) = HEADER.unpack_from(data)
    body = data[HEADER.size:]
    while len(body) < length:
        chunk = connection.recv(length - len(body))
        if not chunk:
            _close_all(fds)
            raise ValueError("connection closed inside a request")
        body += chunk
    connection.settimeout(None)
    return json.loads(body), fds


def _become_rank(request: dict, output_fds: list[int]) -> None:
    """In the forked child: the process `python -m module` would be, before the module runs."""
    os.setsid()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(output_fds[0], 1)
    os.dup2(output_fds[-1], 2)
    os.close(null)
    _close_all(output_fds)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = request["cwd"]  # `python -m` puts the working directory first
    sys.argv = [request["module"], *request["args"]]


def serve(listener: socket.socket) -> dict:
    """Fork a rank per request until the parent is gone; returns only in a forked child."""
    parent = os.getppid()
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd hears it
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "listener")
    selector.register(wake_read, selectors.EVENT_READ, "child")
    ranks: dict[int, socket.socket] = {}  # pid -> its client's connection

    def close_all_in_child() -> None:
        selector.close()
        listener.close()
        os.close(wake_read)
        os.close(wake_write)
        for connection in ranks.values():
            connection.close()

    while True:
        if os.getppid() != parent:  # pytest is gone: so are its runs
            for pid in ranks:
                kill_session(pid, signal.SIGKILL)
            sys.exit(0)
        for key, _ in selector.select(timeout=1.0):
            if key.data == "listener":
                connection, _ = listener.accept()
                try:
                    request, output_fds = _receive_request(connection)
                except (ValueError, OSError) as error:
                    print(f"rank zygote: bad request: {error}", file=sys.stderr, flush=True)
                    connection.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    connection.close()
                    close_all_in_child()
                    _become_rank(request, output_fds)
                    return request
                _close_all(output_fds)
                connection.sendall(f"pid {pid}\n".encode())
                ranks[pid] = connection
                selector.register(connection, selectors.EVENT_READ, pid)
            elif key.data == "child":
                try:
                    os.read(wake_read, 4096)
                except BlockingIOError:
                    pass
                _reap(ranks, selector)
            else:  # a client closed early (its test timed out or failed): end that rank
                pid = key.data
                selector.unregister(key.fileobj)
                kill_session(pid, signal.SIGKILL)
        _reap(ranks, selector)


def _reap(ranks: dict[int, socket.socket], selector: selectors.BaseSelector) -> None:
    while ranks:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = ranks.pop(pid, None)
        if connection is None:
            continue
        try:
            selector.unregister(connection)
        except KeyError:
            pass
        try:
            connection.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
        except OSError:
            pass  # the client is gone
        connection.close()


def kill_session(pid: int, signal_number: int) -> None:
    try:
        os.killpg(pid, signal_number)
    except (ProcessLookupError, PermissionError):
        pass


def main() -> dict:
    socket_path = sys.argv[1]
    preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    os.chmod(socket_path, 0o600)
    listener.listen(64)
    print("ready", flush=True)
    return serve(listener)


if __name__ == "__main__":
    rank_request = main()
    # The forked rank: run the module as `python -m` would; its SystemExit or exception ends this
    # interpreter as it would have ended that one.
    runpy.run_module(rank_request["module"], run_name="__main__", alter_sys=True)
