"""SLURM's node lists, for run_scripts/run_slurm_gpt.sh. Standard library only; no `scontrol` needed.

    python -m megatron_dpp.comm.slurm addresses 'gpu[01-02],login5'   # -> 10.0.0.1,10.0.0.2,10.0.0.9

prints the address of each host of the list, in the list's order (which is SLURM's node-id
order), or one line on stderr and exit code 2 when the list is malformed or a host does not resolve.
"""
from __future__ import annotations

import argparse
import re
import socket
import sys
from typing import Optional, Sequence

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def _split_outside_brackets(text: str) -> list[str]:
    """'a[1,2],b' -> ['a[1,2]', 'b']: commas inside brackets separate numbers, not hosts."""
    items, depth, start = [], 0, 0
    for position, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"node list {text!r}: nested '['")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"node list {text!r}: ']' without '['")
        elif char == "," and depth == 0:
            items.append(text[start:position])
            start = position + 1
    if depth != 0:
        raise ValueError(f"node list {text!r}: '[' without ']'")
    items.append(text[start:])
    return items


def _expand_ranges(ranges: str, text: str) -> list[str]:
    """'01-03,7' -> ['01', '02', '03', '7']: a range keeps the zero padding of its first number."""
    numbers = []
    for part in ranges.split(","):
        match = _RANGE.fullmatch(part)
        if match is None:
            raise ValueError(f"node list {text!r}: [{ranges}] is not a list of numbers and ranges")
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise ValueError(f"node list {text!r}: range {part} runs backwards")
        numbers += [str(number).zfill(len(first)) for number in range(int(first), int(last) + 1)]
    return numbers


def _expand_host(pattern: str, text: str) -> list[str]:
    """'rack[1-2]-gpu[01-02]' -> every combination, the rightmost bracket varying fastest."""
    opening = pattern.find("[")
    if opening < 0:
        return [pattern]
    closing = pattern.index("]", opening)
    head, ranges, tail = pattern[:opening], pattern[opening + 1:closing], pattern[closing + 1:]
    return [head + number + rest for number in _expand_ranges(ranges, text)
            for rest in _expand_host(tail, text)]


def expand_slurm_nodelist(text: str) -> list[str]:
    """SLURM's compressed host list -> host names, e.g. 'gpu[01-03,07],login5' ->
    ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'login5'] (what `scontrol show hostnames` prints).

    Raises ValueError for an empty list, an empty entry or a malformed bracket."""
    if not text.strip():
        raise ValueError("the node list is empty")
    hosts = []
    for item in _split_outside_brackets(text.strip()):
        if not item:
            raise ValueError(f"node list {text!r} has an empty entry")
        hosts += _expand_host(item, text)
    return hosts


def resolve_host(host: str) -> str:
    """The address a host name resolves to (the resolver's first answer); an IP literal is itself.

    Raises ValueError naming the host when it does not resolve."""
    try:
        answers = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise ValueError(f"host {host} does not resolve ({reason}); set NODE_IPS to the nodes' "
                         f"addresses") from None
    return answers[0][4][0]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_dpp.comm.slurm",
                                     description="Expand and resolve SLURM node lists.")
    commands = parser.add_subparsers(dest="command", required=True)
    addresses = commands.add_parser("addresses", help="Print the address of each host of a node "
                                                      "list, comma-separated, in the list's order.")
    addresses.add_argument("nodelist", help="e.g. $SLURM_JOB_NODELIST: 'gpu[01-03,07],login5'")
    args = parser.parse_args(argv)
    try:
        print(",".join(resolve_host(host) for host in expand_slurm_nodelist(args.nodelist)))
    except ValueError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
