"""tests/_netns.py: the two namespaces reach each other over the veth (TCP, since ping may be
missing), and they, and every process started in them, are gone afterwards, also when the body
raises or is interrupted."""
import subprocess
import sys
import time

import pytest

from _netns import netns_skip_reason, two_node_network

PORT = 29400

SERVER = f"""
import socket, sys
server = socket.create_server((sys.argv[1], {PORT}))
server.settimeout(30)
connection, _ = server.accept()
connection.sendall(connection.recv(64).upper())
"""

CLIENT = f"""
import socket, sys, time
deadline = time.monotonic() + 20
while True:  # until the server in the other namespace listens
    try:
        connection = socket.create_connection((sys.argv[1], {PORT}), timeout=5)
        break
    except ConnectionRefusedError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
connection.sendall(b"ping from " + sys.argv[2].encode())
print(connection.recv(64).decode())
"""

SLEEPER_WITH_CHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(600)
"""


@pytest.fixture(autouse=True)
def _needs_netns():
    reason = netns_skip_reason()
    if reason:
        pytest.skip(reason)


def namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return {line.split()[0] for line in listing.stdout.splitlines() if line.strip()}


def alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's zombie may wait for a reaper that never comes)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(60)
def test_both_veth_ends_have_their_carrier_when_the_body_starts():
    # UCX refuses an interface without carrier ("network device ... is not available").
    with two_node_network() as net:
        for index in range(2):
            operstate = subprocess.run(
                net.command(index, ["cat", f"/sys/class/net/{net.interfaces[index]}/operstate"]),
                capture_output=True, text=True, timeout=30).stdout.strip()
            assert operstate == "up", (index, operstate)


@pytest.mark.timeout(90)
def test_the_namespaces_talk_over_tcp_and_see_only_lo_and_the_veth():
    with two_node_network() as net:
        assert set(net.names) <= namespaces()
        assert net.ips[0].rsplit(".", 1)[0] == net.ips[1].rsplit(".", 1)[0]
        assert net.ips[0].startswith("10.")
        server = net.popen(0, [sys.executable, "-c", SERVER, net.ips[0]])
        client = [sys.executable, "-c", CLIENT, net.ips[0], net.ips[1]]
        reply = subprocess.run(net.command(1, client), capture_output=True, text=True, timeout=60)
        assert reply.returncode == 0, reply.stderr
        assert reply.stdout.strip() == f"PING FROM {net.ips[1]}"
        assert server.wait(timeout=30) == 0
        for index in range(2):
            links = subprocess.run(net.command(index, ["ip", "-o", "link"]), capture_output=True,
                                   text=True, timeout=30).stdout
            names = sorted(line.split(":")[1].strip().split("@")[0] for line in links.splitlines())
            assert names == sorted(["lo", net.interfaces[index]])
            addresses = subprocess.run(net.command(index, ["ip", "-o", "-4", "addr", "show", "dev",
                                                           net.interfaces[index]]),
                                       capture_output=True, text=True, timeout=30).stdout
            assert f"{net.ips[index]}/24" in addresses
    assert not set(net.names) & namespaces()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_the_namespaces_are_removed_when_the_body_raises(error):
    with pytest.raises(error):
        with two_node_network() as net:
            assert set(net.names) <= namespaces()
            raise error("body failed")
    assert not set(net.names) & namespaces()


@pytest.mark.timeout(60)
def test_processes_started_inside_are_killed_with_their_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    with two_node_network() as net:
        sleeper = net.popen(1, [sys.executable, "-c", SLEEPER_WITH_CHILD, str(pid_file)])
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline and sleeper.poll() is None, "no sleeper started"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert alive(child)
    assert sleeper.returncode is not None
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)
    assert not set(net.names) & namespaces()
