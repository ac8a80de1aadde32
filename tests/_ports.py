"""A TCP port on 127.0.0.1 that nothing listens on, for tests that start their own rendezvous.

The kernel picks it (bind to port 0), so it is free when chosen; a pseudo-random fixed range could
hit a port another test's connection holds, and the store's server would then fail to bind."""
import socket


def free_local_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
