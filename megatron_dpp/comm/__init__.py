"""Point-to-point transports for pipeline messages: the Transport protocol and its errors, the wire
codec, the torch.distributed transport, the router (a table of routes: same node -> shm_tensor,
fallback -> torch.distributed), message tags, and (in megatron_p2p, imported on demand because it
pulls in Megatron-Core) the adapter that runs Megatron's own schedules over a Transport.

shm_tensor is imported only when a route uses it (--p2p-transport shm).

The names below load their module on first use (PEP 562): importing a submodule that needs
neither torch nor the transports (heartbeat, heartbeat_helper, nodes) stays light, and the
heartbeat helper process starts in milliseconds.
"""

import importlib

_HOMES = {
    "PeerLostError": "errors", "ProtocolError": "errors", "TransportError": "errors",
    "TransportTimeout": "errors",
    "ROUTE_TABLES": "router", "TRANSPORT_KINDS": "defaults", "Route": "router",
    "RoutedTransport": "router", "make_transport": "router", "pipeline_neighbors": "router",
    "make_transport_from_args": "settings", "shm_config_from_args": "settings",
    "Direction": "tags", "SequenceTag": "tags", "TaskTag": "tags", "decode_tag": "tags",
    "encode_sequence_tag": "tags", "encode_tag": "tags",
    "TorchTransport": "torch_transport",
    "DEFAULT_TIMEOUT_S": "defaults", "Transport": "transport", "TransportHandle": "transport",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value
