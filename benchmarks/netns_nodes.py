"""Two "nodes" on one machine: two network namespaces joined by a veth pair.

    with two_node_network() as net:
        server = net.popen(0, ["python", "-m", "http.server", "--bind", net.ips[0]])
        subprocess.run(net.command(1, ["curl", f"http://{net.ips[0]}:8000"]), timeout=10)

Each namespace has `lo` and one end of the veth up (carrier on: waited for), with 10.<200-250>.<random>.1/24 and .2 on the
veth. Only the network is separate: `ip netns exec` keeps the hostname, the file system and its
/dev/shm, so shared-memory transports still see each other. On exit (also on an exception or
Ctrl-C) every process started with `popen` is killed with its process group, anything else left in
the namespaces is killed, and both namespaces are deleted, which deletes the veth pair.
Needs root and iproute2; `netns_skip_reason()` says why not where they are missing.
"""
from __future__ import annotations

import contextlib
import functools
import os
import random
import shutil
import signal
import subprocess
import time
from typing import Iterator, Optional, Sequence

_IP_TIMEOUT_S = 30.0
# The kernel reports a new veth's carrier (operstate UP) up to about a second after both ends are
# set up (link events are batched); transports such as UCX refuse an interface before that.
_LINK_UP_TIMEOUT_S = 10.0
_NETNS_DIR = "/run/netns"  # where `ip netns add` mounts a namespace (iproute2's fixed path)


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S)


def _ip_checked(*args: str) -> None:
    result = _ip(*args)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")


def _unique_suffix() -> str:
    # pid keeps parallel test processes apart, the random part repeated uses within one process.
    return f"{os.getpid()}x{random.randrange(16 ** 4):04x}"


@functools.lru_cache(maxsize=1)
def netns_skip_reason() -> Optional[str]:
    """Why two_node_network() cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    probe = f"dpp{_unique_suffix()}probe"
    try:
        result = _ip("netns", "add", probe)
    finally:
        _ip("netns", "delete", probe)
    if result.returncode != 0:
        return f"`ip netns add` fails here: {result.stderr.strip()}"
    return None


class TwoNodeNetwork:
    """The two namespaces: names, veth addresses and interface names, index 0 and 1."""

    def __init__(self, names: tuple[str, str], ips: tuple[str, str],
                 interfaces: tuple[str, str]) -> None:
        self.names, self.ips, self.interfaces = names, ips, interfaces
        self._processes: list[subprocess.Popen] = []

    def command(self, index: int, argv: Sequence[str]) -> list[str]:
        """argv prefixed so that it runs inside namespace `index`."""
        return ["ip", "netns", "exec", self.names[index], *argv]

    def popen(self, index: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Starts argv inside namespace `index` in its own process group (killed on exit)."""
        process = subprocess.Popen(self.command(index, argv), start_new_session=True, **kwargs)
        self._processes.append(process)
        return process

    def _kill_processes(self) -> None:
        for process in self._processes:
            # Only while unreaped: then its pid, which is its group id, cannot have been reused.
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
        for process in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        # Whatever else runs in our namespaces (a daemon that left its group) was started by us too.
        for name in self.names:
            pids = _ip("netns", "pids", name).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)


def _create(names: tuple[str, str], ips: tuple[str, str], interfaces: tuple[str, str]) -> None:
    for name in names:
        _ip_checked("netns", "add", name)
    # Created inside the namespaces directly, so the veth never appears in the host namespace.
    _ip_checked("link", "add", interfaces[0], "netns", names[0], "type", "veth",
                "peer", "name", interfaces[1], "netns", names[1])
    for name, ip, interface in zip(names, ips, interfaces):
        _ip_checked("-n", name, "addr", "add", f"{ip}/24", "dev", interface)
        _ip_checked("-n", name, "link", "set", "lo", "up")
        _ip_checked("-n", name, "link", "set", interface, "up")
    for name, interface in zip(names, interfaces):
        _wait_until_running(name, interface)


def _wait_until_running(name: str, interface: str) -> None:
    """Polls until `interface` in namespace `name` has its carrier (LOWER_UP, state UP)."""
    deadline = time.monotonic() + _LINK_UP_TIMEOUT_S
    while True:
        state = _ip("-n", name, "-o", "link", "show", "dev", interface).stdout
        if "LOWER_UP" in state and "state UP" in state:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{interface} in network namespace {name} is not up after "
                               f"{_LINK_UP_TIMEOUT_S:.0f} s: {state.strip()}")
        time.sleep(0.05)


def _delete(names: Sequence[str]) -> None:
    for name in names:
        if os.path.exists(os.path.join(_NETNS_DIR, name)):
            _ip("netns", "delete", name)
    left = [name for name in names if os.path.exists(os.path.join(_NETNS_DIR, name))]
    if left:
        raise RuntimeError(f"network namespaces {left} are left over; remove with "
                           f"`ip netns delete NAME`")


@contextlib.contextmanager
def two_node_network() -> Iterator[TwoNodeNetwork]:
    suffix = _unique_suffix()
    names = (f"dpp{suffix}a", f"dpp{suffix}b")
    subnet = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}"
    net = TwoNodeNetwork(names, (f"{subnet}.1", f"{subnet}.2"), ("dppveth0", "dppveth1"))
    try:
        _create(net.names, net.ips, net.interfaces)
        yield net
    finally:
        try:
            net._kill_processes()
        finally:
            _delete(net.names)
