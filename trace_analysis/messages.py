"""Pairing every receive with its send.

A message is named by (sender, receiver, tag); tags repeat once their iteration counter wraps (and
Megatron's sequence tags restart per run), so the k-th send of a name pairs with the k-th receive
of that name, both in time order.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Tuple

from trace_analysis.timeline import Message, RunTimeline


@dataclass(frozen=True)
class MessagePair:
    send: Message
    recv: Message


@dataclass
class MessageMatch:
    pairs: List[MessagePair]
    unmatched_sends: List[Message]
    unmatched_recvs: List[Message]


def match_messages(run: RunTimeline) -> MessageMatch:
    sends: Dict[Tuple[int, int, int], List[Message]] = defaultdict(list)
    recvs: Dict[Tuple[int, int, int], List[Message]] = defaultdict(list)
    for rank in run.ranks:
        for message in rank.messages:
            if message.kind == "send":
                sends[(message.rank, message.peer, message.tag)].append(message)
            elif message.kind == "recv":
                recvs[(message.peer, message.rank, message.tag)].append(message)
    match = MessageMatch([], [], [])
    for key in sorted(set(sends) | set(recvs)):
        sent = sorted(sends.get(key, []), key=lambda m: m.time)
        received = sorted(recvs.get(key, []), key=lambda m: m.time)
        match.pairs += [MessagePair(s, r) for s, r in zip(sent, received)]
        match.unmatched_sends += sent[len(received):]
        match.unmatched_recvs += received[len(sent):]
    match.pairs.sort(key=lambda pair: pair.send.time)
    return match
