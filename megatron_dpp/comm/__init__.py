"""Point-to-point transports for pipeline messages: the Transport protocol, torch.distributed and
shm_tensor implementations, the per-peer router, message tags, and (in megatron_p2p, imported on
demand because it pulls in Megatron-Core) the adapter that runs Megatron's schedules over them."""
from megatron_dpp.comm.router import TRANSPORT_KINDS, RoutedTransport, make_transport, pipeline_neighbors
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
from megatron_dpp.comm.transport import Transport, TransportHandle

__all__ = [
    "TRANSPORT_KINDS",
    "Direction",
    "RoutedTransport",
    "SequenceTag",
    "TaskTag",
    "TorchTransport",
    "Transport",
    "TransportHandle",
    "decode_tag",
    "encode_sequence_tag",
    "encode_tag",
    "make_transport",
    "make_transport_from_args",
    "pipeline_neighbors",
    "shm_config_from_args",
]
