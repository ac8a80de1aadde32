"""A one-node job's rendezvous store, reachable from this machine only.

torchrun's TCPStore listens on every interface (`*:PORT`), also for a job of one node, and
authenticates no one: any process that reaches the port could read each rank's heartbeat address
and write keys the ranks read. For a job of one node the launcher (megatron_dpp.rank_launcher)
makes the store itself, on a socket bound to 127.0.0.1, before torchrun starts: torchrun's static
rendezvous then finds that server in this process (TCPStore's multi-tenant servers are shared by
port within a process) instead of opening its own, and the ranks connect to 127.0.0.1.
`--standalone` becomes that static rendezvous on a port the kernel picks; `--master-addr
127.0.0.1 --master-port P` keeps P. The heartbeats bind to 127.0.0.1 on one node
(comm/heartbeat.py), and `sockets_on_loopback` points gloo's and NCCL's sockets at the loopback
interface (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, unless the user set them): by default gloo
binds to the address the host name resolves to, and NCCL's bootstrap to the first interface that
is not loopback. shm_tensor opens no socket.
"""
from __future__ import annotations

import socket
from datetime import timedelta
from typing import MutableMapping, Optional

from megatron_dpp.comm.nodes import SOCKET_IFNAME_VARIABLES, interface_of_address

LOOPBACK = "127.0.0.1"
_LOOPBACK_NAMES = ("127.0.0.1", "localhost")


def sockets_on_loopback(environ: MutableMapping[str, str]) -> None:
    """Point gloo and NCCL at the loopback interface in `environ` (the ranks inherit it), unless
    the user chose an interface."""
    interface = interface_of_address(LOOPBACK) or "lo"
    for name in SOCKET_IFNAME_VARIABLES:
        if not environ.get(name):
            environ[name] = interface


class StoreBindError(OSError):
    """The loopback port cannot be listened on; the message is one line."""


def is_one_node(nnodes: str) -> bool:
    """torchrun's --nnodes ("1", "1:1") names exactly one node."""
    bounds = [part.strip() for part in str(nnodes).split(":")]
    return all(part == "1" for part in bounds) and 1 <= len(bounds) <= 2


def loopback_port_wanted(args) -> Optional[int]:
    """The port a one-node job's store should listen on at 127.0.0.1 (0: any), or None where the
    job is not one node or its rendezvous is not one this module can take over (a c10d or etcd
    backend the user named, a master address that is not this machine's loopback)."""
    if not is_one_node(args.nnodes):
        return None
    if args.standalone:
        return 0
    if args.rdzv_backend == "static" and not args.rdzv_endpoint \
            and args.master_addr in _LOOPBACK_NAMES:
        return int(args.master_port)
    return None


class LoopbackStore:
    """The TCPStore server of a one-node job, listening on 127.0.0.1 only, for as long as it is
    open; `use_in(args)` points torchrun's arguments at it."""

    def __init__(self, port: int):
        import torch.distributed as dist

        listening = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listening.bind((LOOPBACK, port))
            listening.listen(socket.SOMAXCONN)
        except OSError as error:
            listening.close()
            raise StoreBindError(f"cannot listen on {LOOPBACK}:{port} for the rendezvous store "
                                 f"(MASTER_PORT): {error.strerror or error}") from None
        self.port = listening.getsockname()[1]
        try:
            # multi_tenant: torchrun's own TCPStore on this port, in this process, reuses this
            # server. The server owns the descriptor from here on, and closes it.
            self._store = dist.TCPStore(LOOPBACK, self.port, None, True, timedelta(seconds=60),
                                        wait_for_workers=False, multi_tenant=True,
                                        master_listen_fd=listening.fileno())
        except BaseException:
            listening.close()
            raise
        listening.detach()

    def use_in(self, args) -> None:
        """torchrun's arguments, changed in place: a static rendezvous at 127.0.0.1:port."""
        args.standalone = False
        args.rdzv_backend = "static"
        args.rdzv_endpoint = ""
        args.master_addr = LOOPBACK
        args.master_port = self.port

    def close(self) -> None:
        self._store = None  # the last reference here; the server stops with torchrun's

    def __enter__(self) -> "LoopbackStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
