"""A collective that fails because a peer went away: one report naming the peer's node and the
phase, instead of a traceback from deep inside gloo or NCCL.

gloo says "Read error [10.0.0.2]:42206: Connection reset by peer"; NCCL "remote process exited or
there was a network error". The peer's address maps to its node through --node-ips.
"""
from __future__ import annotations

import re
from typing import Optional, Sequence

# Messages of torch.distributed backends whose peer process or link went away.
_LOST_PEER_PATTERNS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "remote process exited",
    "Socket Timeout",
)
_ADDRESS_IN_BRACKETS = re.compile(r"\[([0-9a-fA-F.:]+)\]:\d+")


def is_lost_peer_error(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, RuntimeError) and any(pattern in text for pattern in _LOST_PEER_PATTERNS)


def lost_peer_report(error: BaseException, phase: Optional[str],
                     node_ips: Optional[Sequence[str]]) -> tuple[str, list[str]]:
    """(reason, state lines) for report_and_exit: which peer (address, and node with --node-ips),
    during what, and the backend's own first line."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    found = _ADDRESS_IN_BRACKETS.search(text)
    peer = "a peer"
    if found:
        address = found.group(1)
        peer = f"the peer at {address}"
        if node_ips and address in node_ips:
            peer += f" (node {list(node_ips).index(address)} of --node-ips)"
    reason = f"lost {peer}" + (f" during {phase}" if phase else "")
    return reason, [f"backend: {text}", "that node's log says why its rank stopped"]
