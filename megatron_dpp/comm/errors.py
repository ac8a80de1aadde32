"""Errors of the Transport protocol, in the hierarchy the compiled transports (shm_tensor._C) use
for theirs, so callers catch either with the same clauses: every failure is a RuntimeError, and a
timeout is also a TimeoutError."""


class TransportError(RuntimeError):
    """A send or receive failed; the message names the call, the peer and the tag."""


class TransportTimeout(TransportError, TimeoutError):
    """A wait ran out of time; the message says what it waited for."""


class PeerLostError(TransportError):
    """The peer's link broke or it closed without sending the awaited message."""


class ProtocolError(TransportError):
    """A message that is not a valid header and payload of this project's wire format."""


def is_peer_lost(error: BaseException) -> bool:
    """A PeerLostError of any transport: this package's, or a compiled transport's class of the
    same name (shm_tensor._C, rdma_tensor._C)."""
    return any(cls.__name__ == PeerLostError.__name__ for cls in type(error).__mro__)
