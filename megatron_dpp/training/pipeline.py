"""The forward-backward function a training iteration calls.

`build_forward_backward(args)` returns a callable with Megatron-Core's forward_backward_func keyword
signature (forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
decoder_seq_length, forward_only, ...). The choice depends on the flags: Megatron's own schedule
(no pipelining, 1F1B or interleaved 1F1B, picked from parallel_state), a transport-backed variant
(also what --trace records Megatron's schedule through), or the dynamic pipeline runtime.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable, Optional

from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_dpp.mcore.schedules import ForwardBackwardFunc
from megatron_dpp.models.spec import ModelSpec


def close_forward_backward(forward_backward: Callable) -> None:
    """Release what the callable holds (a transport's threads and peers); collective with the
    peers, so call it on every rank at the same point, before destroying process groups."""
    close = getattr(forward_backward, "close", None)
    if close is not None:
        close()


def build_forward_backward(args: argparse.Namespace, spec: ModelSpec,
                           run_directory: Optional[str] = None) -> Callable:
    """Call after parallel_state is initialized (Megatron picks its schedule from it).
    `run_directory`: where --trace writes (training/observe/tracing.py's agree_run_directory).

    A callable that holds resources is a ForwardBackwardFunc (mcore/schedules.py) and carries a
    `close()`; see close_forward_backward. Such a callable carries its `trace`
    (training/observe/tracing.py's RunTrace; None without --trace), which the training step
    records its own parts into."""
    if getattr(args, "use_dpp", False):
        return _build_dpp(args, spec, run_directory)
    # --trace and --nvtx see Megatron's schedule through our P2P adapter and config.timers, so such
    # a run takes that path with every transport, torch.distributed (TorchTransport) included.
    if args.pipeline_model_parallel_size > 1 and (args.p2p_transport != "torch" or args.trace
                                                  or args.nvtx):
        return _build_megatron_over_transport(args, spec, run_directory)
    return get_forward_backward_func()


def _build_megatron_over_transport(args: argparse.Namespace, spec: ModelSpec,
                                   run_directory: Optional[str]) -> "MegatronOverTransport":
    """Megatron's own 1F1B / interleaved schedule, its messages carried by our transports
    (TransportP2PCommunicator); with --trace, its steps, messages and waits recorded; with --nvtx,
    an NVTX range around each step. Builds the transport (and starts the trace) now: collective."""
    from megatron.core import parallel_state

    from megatron_dpp.comm import make_transport_from_args

    transport = make_transport_from_args(args)
    trace, tracer = None, None
    if args.trace or args.nvtx:
        from megatron_dpp.training.observe.megatron_tracing import MegatronScheduleTracer
        from megatron_dpp.training.observe.tracing import policy_label, start_trace

        trace = start_trace(args, run_directory) if args.trace else None
        tracer = MegatronScheduleTracer(
            None if trace is None else trace.recorder,
            parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_world_size(), spec.microbatch_tokens,
            policy_label(args), nvtx=args.nvtx)
    return MegatronOverTransport(get_forward_backward_func(), transport, args.p2p_timeout,
                                 trace=trace, tracer=tracer)


class MegatronOverTransport(ForwardBackwardFunc):
    """Megatron's schedule (`schedule`, what get_forward_backward_func picked) with its messages
    carried by `transport`: called with Megatron's forward_backward_func keywords
    (mcore/schedules.py's ForwardBackwardFunc), it runs the schedule with a
    TransportP2PCommunicator and the job's process groups, where the caller passed none. `tracer`
    (MegatronScheduleTracer, with --trace or --nvtx) records or marks its steps; messages and waits
    go to the trace's recorder only with --trace. `close()` writes the trace, then closes the
    transport (collective: close_forward_backward)."""

    def __init__(self, schedule: Callable, transport: Any, p2p_timeout: float, trace: Any = None,
                 tracer: Any = None):
        from megatron.core.process_groups_config import ProcessGroupCollection

        super().__init__(transport, trace)
        self.schedule = schedule
        self.p2p_timeout = p2p_timeout
        self.tracer = tracer
        self.pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        # One communicator per model config for the run: its message numbering continues across
        # iterations.
        self.communicators: dict[int, Any] = {}

    def run(self, kwargs: dict[str, Any]):
        from megatron.core.utils import get_model_config

        model = kwargs["model"]
        config = get_model_config(model[0] if isinstance(model, list) else model)
        if kwargs["p2p_communicator"] is None:
            kwargs["p2p_communicator"] = self._communicator(config)
        if kwargs["pg_collection"] is None:
            kwargs["pg_collection"] = self.pg_collection
        if self.tracer is None:
            return self.schedule(**kwargs)
        return self.tracer.run(self.schedule, config, kwargs)

    def _communicator(self, config):
        from megatron.core import parallel_state

        from megatron_dpp.comm.megatron_p2p import TransportP2PCommunicator

        if id(config) not in self.communicators:
            observer = self.tracer if self.trace is not None else None  # to the recorder
            self.communicators[id(config)] = TransportP2PCommunicator(
                parallel_state.get_pipeline_model_parallel_group(), config, self.transport,
                timeout_s=self.p2p_timeout, observer=observer)
        return self.communicators[id(config)]


def _build_dpp(args: argparse.Namespace, spec: ModelSpec, run_directory: Optional[str]) -> Callable:
    """--use-dpp: forward_backward_dpp over the --p2p-transport transport; the model's spec says
    how much work each microbatch is (the policy's sizes) and how many activation bytes it keeps
    (the memory budget's). --nvtx: an NVTX range per task."""
    from megatron_dpp.comm import make_transport_from_args
    from megatron_dpp.pipeline.schedule_csv import read_schedule_csv
    from megatron_dpp.runtime.config import DPPConfig
    from megatron_dpp.runtime.executor import dpp_peers, make_forward_backward_dpp

    config = DPPConfig(policy=args.dpp_policy, memory_budget_bytes=args.dpp_memory_budget_bytes,
                       timeout_s=args.dpp_timeout,
                       split_backward=getattr(args, "dpp_split_backward", False),
                       placement=args.dpp_stage_placement,
                       schedule=(read_schedule_csv(args.dpp_schedule)
                                 if args.dpp_schedule is not None else None))
    transport = make_transport_from_args(args, peers=dpp_peers())
    trace = None
    if args.trace:
        from megatron_dpp.training.observe.tracing import start_trace

        trace = start_trace(args, run_directory)
    split = {}
    if config.split_backward:
        from megatron_dpp.models.weight_grad import WeightGradStash, megatron_weight_grad_bytes

        # The chunks' deferred layers store their weight-gradient work into this stash at B.
        split = {"stash": WeightGradStash(), "weight_grad_bytes_fn": megatron_weight_grad_bytes}
    from megatron_dpp.models.flags import activation_config

    # The policy's work per microbatch counts each document's attention at the model's shape;
    # the budget counts the activation bytes of its tokens.
    microbatch_work = spec.microbatch_work(activation_config(args))
    return make_forward_backward_dpp(
        config, transport, microbatch_work, spec.activation_bytes,
        recorder=None if trace is None else trace.recorder, nvtx=args.nvtx, trace=trace,
        microbatch_tokens=spec.microbatch_tokens, **split)
