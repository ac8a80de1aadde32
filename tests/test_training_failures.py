"""A collective failing because its peer died becomes one report naming the peer's node."""
from megatron_dpp.training.failures import is_lost_peer_error, lost_peer_report

GLOO = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                    "[10.0.0.2]:42206: Connection reset by peer. This is typically caused by ...")


def test_gloo_connection_reset_names_the_node_of_node_ips():
    assert is_lost_peer_error(GLOO)
    reason, lines = lost_peer_report(GLOO, "the optimizer step", ["10.0.0.1", "10.0.0.2"])
    assert reason == "lost the peer at 10.0.0.2 (node 1 of --node-ips) during the optimizer step"
    assert lines[0].startswith("backend: [/pytorch") and "Connection reset by peer" in lines[0]


def test_address_outside_node_ips_and_no_phase():
    reason, _ = lost_peer_report(GLOO, None, None)
    assert reason == "lost the peer at 10.0.0.2"


def test_other_errors_are_not_lost_peers():
    assert not is_lost_peer_error(RuntimeError("CUDA out of memory"))
    assert not is_lost_peer_error(ValueError("Connection reset by peer"))


def test_every_transports_peer_lost_error_counts_as_a_lost_peer():
    import shm_tensor
    from megatron_dpp.comm.errors import PeerLostError, TransportTimeout, is_peer_lost

    assert is_peer_lost(PeerLostError("gone")) and is_peer_lost(shm_tensor.PeerLostError("gone"))
    assert not is_peer_lost(TransportTimeout("slow"))
    assert not is_peer_lost(shm_tensor.TransportTimeout("slow"))
