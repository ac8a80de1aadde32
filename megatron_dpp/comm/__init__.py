"""Point-to-point transports for pipeline messages: the Transport protocol and its errors, the wire
codec, the torch.distributed transport, the router (a table of routes: same node -> shm_tensor,
fallback -> torch.distributed), message tags, and (in megatron_p2p, imported on demand because it
pulls in Megatron-Core) the adapter that runs Megatron's own schedules over a Transport.

shm_tensor is imported only when a route uses it (--p2p-transport shm).
"""
from megatron_dpp.comm.errors import PeerLostError, ProtocolError, TransportError, TransportTimeout
from megatron_dpp.comm.router import (
    ROUTE_TABLES,
    TRANSPORT_KINDS,
    Route,
    RoutedTransport,
    make_transport,
    pipeline_neighbors,
)
from megatron_dpp.comm.settings import make_transport_from_args, shm_config_from_args
from megatron_dpp.comm.tags import (
    Direction,
    SequenceTag,
    TaskTag,
    decode_tag,
    encode_sequence_tag,
    encode_tag,
)
from megatron_dpp.comm.torch_transport import TorchTransport
from megatron_dpp.comm.transport import DEFAULT_TIMEOUT_S, Transport, TransportHandle

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ROUTE_TABLES",
    "TRANSPORT_KINDS",
    "Direction",
    "PeerLostError",
    "ProtocolError",
    "Route",
    "RoutedTransport",
    "SequenceTag",
    "TaskTag",
    "TorchTransport",
    "Transport",
    "TransportError",
    "TransportHandle",
    "TransportTimeout",
    "decode_tag",
    "encode_sequence_tag",
    "encode_tag",
    "make_transport",
    "make_transport_from_args",
    "pipeline_neighbors",
    "shm_config_from_args",
]
