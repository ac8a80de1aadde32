"""ForwardBackwardDPP, what make_forward_backward_dpp returns: Megatron's forward_backward_func
keyword signature exactly, its session, last record and trace as attributes, and close() (the
trace first, then the transport); the schedule features it refuses."""
import inspect
from types import SimpleNamespace

import pytest
from megatron.core.pipeline_parallel.schedules import (
    forward_backward_pipelining_without_interleaving,
)

from megatron_dpp.mcore.schedules import unsupported_schedule_feature
from megatron_dpp.runtime.config import DPPConfig
from megatron_dpp.runtime.executor import (ForwardBackwardDPP, _check_supported,
                                           make_forward_backward_dpp)


def test_the_call_takes_megatrons_keywords_exactly():
    ours = inspect.signature(ForwardBackwardDPP.__call__).parameters
    upstream = inspect.signature(forward_backward_pipelining_without_interleaving).parameters
    assert [name for name in ours if name != "self"] == list(upstream)
    for name, parameter in upstream.items():
        assert ours[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert ours[name].default == parameter.default, name


def test_close_writes_the_trace_then_closes_the_transport():
    calls = []

    class Transport:
        def close(self):
            calls.append("transport")

    class Trace:
        recorder = None

        def write(self):
            calls.append("trace")

    fb = make_forward_backward_dpp(DPPConfig(), Transport(), len, None, trace=Trace())
    assert isinstance(fb, ForwardBackwardDPP)
    assert fb.session.config == DPPConfig() and fb.last_record is None
    fb.close()
    assert calls == ["trace", "transport"]
    untraced = make_forward_backward_dpp(DPPConfig(), Transport(), len, None)
    assert untraced.trace is None
    untraced.close()
    assert calls == ["trace", "transport", "transport"]


def test_the_schedule_features_it_does_not_perform_are_refused_in_one_line():
    """Upstream's epilogue resets fine-grained activation offloading and creates local CUDA
    graphs; forward_backward_dpp does neither, so it refuses both (mcore/schedules.py)."""
    plain = SimpleNamespace(num_microbatches_with_partial_activation_checkpoints=None,
                            fine_grained_activation_offloading=False, cuda_graph_impl="none")
    assert unsupported_schedule_feature(plain) is None
    _check_supported(plain, 1, None, 1, [None])
    for change, words in (({"fine_grained_activation_offloading": True}, "activation offloading"),
                          ({"cuda_graph_impl": "local"}, "--cuda-graph-impl local")):
        config = SimpleNamespace(**{**vars(plain), **change})
        with pytest.raises(ValueError, match=f"forward_backward_dpp: .*{words}") as refused:
            _check_supported(config, 1, None, 1, [None])
        assert "\n" not in str(refused.value)
