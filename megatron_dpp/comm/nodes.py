"""The nodes of a multi-node job and the network they talk over (`--multi-node --node-ips`).

Standard library only: the flag pre-check of the launch scripts uses it before torchrun starts.
- `parse_node_ips`, `check_node_count`: the --node-ips list, one address per node in node-rank order.
- `this_node_rank`, `num_nodes`: torchrun's GROUP_RANK and GROUP_WORLD_SIZE (torchrun runs one agent
  per node, so its "group" is the node); a pre-check outside torchrun sets them itself.
- `local_addresses`, `interface_of_address`: this machine's interfaces and their addresses.
- `use_node_network`: at startup, before any process group, check that this node's --node-ips
  address is local and point gloo and NCCL at its interface.
- `ucx_net_devices`: the UCX_NET_DEVICES value an interface implies.
"""
from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import MutableMapping, Optional

# torchrun's names: the node rank and the number of nodes of the job.
NODE_RANK_VARIABLE = "GROUP_RANK"
NUM_NODES_VARIABLE = "GROUP_WORLD_SIZE"

# The variables that choose the interface of gloo's and NCCL's sockets.
SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class NodeNetworkError(ValueError):
    """This node cannot use the --node-ips network; the message is one line that says why."""


# ----------------------------------------------------------------------------------------------
# the --node-ips list
# ----------------------------------------------------------------------------------------------
def parse_node_ips(text: str) -> list[str]:
    """'10.0.0.1,10.0.0.2' -> ['10.0.0.1', '10.0.0.2'] (IPv4 or IPv6, written canonically).

    Raises ValueError naming the first empty, malformed or repeated entry."""
    addresses: list[str] = []
    for position, entry in enumerate(text.split(","), start=1):
        entry = entry.strip()
        if not entry:
            raise ValueError(f"entry {position} of {text!r} is empty; give one address per node, "
                             f"separated by commas")
        try:
            address = str(ipaddress.ip_address(entry))
        except ValueError:
            raise ValueError(f"{entry!r} is not an IPv4 or IPv6 address") from None
        if address in addresses:
            raise ValueError(f"{entry} is listed twice; each node needs its own address")
        addresses.append(address)
    return addresses


def _count(number: int, singular: str, plural: str) -> str:
    return f"{number} {singular if number == 1 else plural}"


def check_node_count(node_ips: list[str], num_nodes: int) -> None:
    """Raises ValueError unless there is exactly one address per node."""
    if len(node_ips) != num_nodes:
        raise ValueError(f"the job has {_count(num_nodes, 'node', 'nodes')} but "
                         f"{_count(len(node_ips), 'address is', 'addresses are')} given; give one "
                         f"per node, in node-rank order")


# ----------------------------------------------------------------------------------------------
# torchrun's environment
# ----------------------------------------------------------------------------------------------
def _environment_int(name: str, meaning: str, environ: MutableMapping[str, str]) -> int:
    value = environ.get(name)
    if value is None:
        raise ValueError(f"{name} ({meaning}) is not set; torchrun sets it, a check run outside "
                         f"torchrun must set it itself")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} ({meaning}) is not an integer") from None


def this_node_rank(environ: MutableMapping[str, str] = os.environ) -> int:
    """The rank of this node in the job (torchrun's GROUP_RANK, its --node-rank)."""
    return _environment_int(NODE_RANK_VARIABLE, "the rank of this node", environ)


def num_nodes(environ: MutableMapping[str, str] = os.environ) -> int:
    """Nodes in the job (torchrun's GROUP_WORLD_SIZE, its --nnodes).

    Counted by torchrun rather than as WORLD_SIZE / LOCAL_WORLD_SIZE, which assumes every node runs
    the same number of processes."""
    return _environment_int(NUM_NODES_VARIABLE, "the number of nodes", environ)


# ----------------------------------------------------------------------------------------------
# local interfaces
# ----------------------------------------------------------------------------------------------
# getifaddrs(3) lists every address of every interface, secondary ones included (the SIOCGIFADDR
# ioctl sees only the first IPv4 address of an interface). Linux layouts of its structures.
class _SockAddr(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 14)]


class _SockAddrIn(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("port", ctypes.c_uint16),
                ("address", ctypes.c_ubyte * 4)]


class _SockAddrIn6(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("port", ctypes.c_uint16),
                ("flowinfo", ctypes.c_uint32), ("address", ctypes.c_ubyte * 16),
                ("scope_id", ctypes.c_uint32)]


class _IfAddrs(ctypes.Structure):
    pass


_IfAddrs._fields_ = [("next", ctypes.POINTER(_IfAddrs)), ("name", ctypes.c_char_p),
                     ("flags", ctypes.c_uint), ("address", ctypes.POINTER(_SockAddr)),
                     ("netmask", ctypes.POINTER(_SockAddr)),
                     ("broadcast", ctypes.POINTER(_SockAddr)), ("data", ctypes.c_void_p)]


def local_addresses() -> list[tuple[str, str]]:
    """(interface, address) for every IPv4 and IPv6 address of this machine, e.g. ('lo', '127.0.0.1')."""
    libc = ctypes.CDLL(None, use_errno=True)
    head = ctypes.POINTER(_IfAddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"getifaddrs: {os.strerror(error)}")
    found = []
    try:
        entry = head
        while entry:
            item = entry.contents
            if item.address:
                family = item.address.contents.family
                if family == socket.AF_INET:
                    raw = ctypes.cast(item.address, ctypes.POINTER(_SockAddrIn)).contents.address
                    found.append((item.name.decode(), str(ipaddress.IPv4Address(bytes(raw)))))
                elif family == socket.AF_INET6:
                    raw = ctypes.cast(item.address, ctypes.POINTER(_SockAddrIn6)).contents.address
                    found.append((item.name.decode(), str(ipaddress.IPv6Address(bytes(raw)))))
            entry = item.next
    finally:
        libc.freeifaddrs(head)
    return found


def _without_scope(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    # 'fe80::1%eth0' names the same address as 'fe80::1'; getifaddrs reports it without the scope.
    return ipaddress.ip_address(address.split("%", 1)[0])


def interface_of_address(address: str) -> Optional[str]:
    """The local interface that carries `address`, or None when no interface has it."""
    wanted = _without_scope(address)
    for interface, local in local_addresses():
        if ipaddress.ip_address(local) == wanted:
            return interface
    return None


# ----------------------------------------------------------------------------------------------
# startup
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeNetwork:
    node_rank: int
    address: str
    interface: str
    variables_set: tuple[str, ...]               # SOCKET_IFNAME_VARIABLES set to the interface
    variables_kept: tuple[tuple[str, str], ...]  # (name, value) of those already set, left alone

    def describe(self) -> str:
        line = f" multi-node: node rank {self.node_rank} is {self.address} on {self.interface}"
        if self.variables_set:
            line += "; set " + " ".join(f"{name}={self.interface}" for name in self.variables_set)
        if self.variables_kept:
            line += "; kept " + " ".join(f"{name}={value}" for name, value in self.variables_kept)
        return line


def use_node_network(node_ips: list[str], node_rank: int,
                     environ: MutableMapping[str, str] = os.environ) -> NodeNetwork:
    """Check that node_ips[node_rank] is an address of this machine and make gloo and NCCL use
    its interface (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME), unless those are already set.

    Needed before the process group exists: by default gloo binds to the address the host name
    resolves to, which need not be on the --node-ips network (in a network namespace it is often
    not an address of the namespace at all). Raises NodeNetworkError."""
    if not 0 <= node_rank < len(node_ips):
        raise NodeNetworkError(f"node rank {node_rank} has no address in --node-ips "
                               f"{','.join(node_ips)} ({len(node_ips)} nodes)")
    address = node_ips[node_rank]
    interface = interface_of_address(address)
    if interface is None:
        found = ", ".join(f"{name} {local}" for name, local in local_addresses()) or "none"
        raise NodeNetworkError(f"--node-ips gives node rank {node_rank} the address {address}, "
                               f"but no interface of this machine has it (found: {found}); list "
                               f"the nodes' addresses in node-rank order")
    variables_set = tuple(name for name in SOCKET_IFNAME_VARIABLES if not environ.get(name))
    variables_kept = tuple((name, environ[name]) for name in SOCKET_IFNAME_VARIABLES
                           if name not in variables_set)
    for name in variables_set:
        environ[name] = interface
    return NodeNetwork(node_rank, address, interface, variables_set, variables_kept)


# ----------------------------------------------------------------------------------------------
# UCX
# ----------------------------------------------------------------------------------------------
def ucx_net_devices(interface: str, sysfs_root: str = "/sys") -> str:
    """UCX_NET_DEVICES for `interface`: the interface itself (UCX's TCP device), then
    '<ib device>:<port>' for each InfiniBand / RoCE device behind it, e.g. 'ib0,mlx5_0:1'.

    The port is the interface's dev_port + 1 (sysfs counts ports from 0, verbs from 1)."""
    net = os.path.join(sysfs_root, "class", "net", interface)
    infiniband = os.path.join(net, "device", "infiniband")
    ib_devices = sorted(os.listdir(infiniband)) if os.path.isdir(infiniband) else []
    try:
        with open(os.path.join(net, "dev_port")) as dev_port:
            port = int(dev_port.read().strip()) + 1
    except (OSError, ValueError):
        port = 1  # no dev_port (older kernels, virtual interfaces): the first port
    return ",".join([interface, *(f"{device}:{port}" for device in ib_devices)])
