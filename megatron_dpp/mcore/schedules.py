"""Megatron-Core's pipeline schedules (megatron.core.pipeline_parallel.schedules) as the DPP
runtime uses them: the step functions it runs one task at a time (re-exported: the module has no
`__all__`, so these are internals), and the prologue and epilogue that every one of Megatron's
schedules puts around its steps, copied from forward_backward_pipelining_without_interleaving.

Two parts of upstream's epilogue are not copied, and the runtime refuses the configurations that
need them (`unsupported_schedule_feature`): `off_interface.reset()` (fine-grained activation
offloading) and `create_cudagraphs()` (cuda_graph_impl "local"), neither of which this project
builds with the DPP runtime.

`ForwardBackwardFunc` is the base of every forward-backward callable that holds resources (the
DPP runtime's ForwardBackwardDPP, training/pipeline.py's MegatronOverTransport): Megatron's
forward_backward_func keyword signature, spelled once, with `trace` and `close()`.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Union

import torch
from megatron.core.pipeline_parallel.schedules import (  # noqa: F401  (re-exports)
    backward_step,
    check_first_val_step,
    clear_embedding_activation_buffer,
    deallocate_output_tensor,
    finish_embedding_wgrad_compute,
    forward_step,
)
from megatron.core.process_groups_config import ProcessGroupCollection


class ForwardBackwardFunc:
    """Megatron-Core's forward_backward_func as an object that holds a transport and, with
    --trace, the run's trace (training/observe/tracing.py's RunTrace; None without), which the
    training step records its own parts into.

    `__call__` takes exactly the keywords of Megatron's schedules (those of
    forward_backward_pipelining_without_interleaving, declared here once for every such object)
    and passes them, as one dict, to the subclass's `run(kwargs)`, which runs one global batch and
    returns what Megatron's schedules return. `close()` releases what the object holds
    (collective: training.pipeline.close_forward_backward)."""

    def __init__(self, transport: Any, trace: Any = None):
        self.transport = transport
        self.trace = trace

    def __call__(
        self,
        *,
        forward_step_func,
        data_iterator: Union[Iterator, List[Iterator]],
        model: Union[torch.nn.Module, List[torch.nn.Module]],
        num_microbatches: int,
        seq_length: int,
        micro_batch_size: int,
        decoder_seq_length: Optional[int] = None,
        forward_only: bool = False,
        collect_non_loss_data: bool = False,
        first_val_step: Optional[bool] = None,
        adjust_tensor_shapes_fn: Optional[Callable] = None,
        p2p_communicator=None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        force_all_reduce: Optional[bool] = False,
    ):
        kwargs: Dict[str, Any] = dict(
            forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
            num_microbatches=num_microbatches, seq_length=seq_length,
            micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length,
            forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
            first_val_step=first_val_step, adjust_tensor_shapes_fn=adjust_tensor_shapes_fn,
            p2p_communicator=p2p_communicator, pg_collection=pg_collection,
            force_all_reduce=force_all_reduce)
        return self.run(kwargs)

    def close(self) -> None:
        """Write the trace (collective: the end-of-run clock measurement), then close the
        transport (collective with the peers)."""
        if self.trace is not None:
            self.trace.write()
        self.transport.close()


def no_sync_func(config) -> Callable[[], Any]:
    """config.no_sync_func as the interleaved schedule uses it: a list (one per model chunk) entered
    together, as its multi_no_sync; None: a null context."""
    funcs = config.no_sync_func
    if isinstance(funcs, list):
        chunk_funcs = list(funcs)

        def multi_no_sync():
            stack = contextlib.ExitStack()
            for chunk_no_sync in chunk_funcs:
                stack.enter_context(chunk_no_sync())
            return stack

        return multi_no_sync
    return funcs or contextlib.nullcontext


def grad_sync_funcs(config, model_chunks: list, forward_only: bool) -> Optional[list]:
    """config.grad_sync_func as the interleaved schedule uses it: one per model chunk (a single
    function repeated), None when there is none or only forwards run. Unlike the schedule, the
    config is left as it is."""
    funcs = None if forward_only else config.grad_sync_func
    if funcs is not None and not isinstance(funcs, list):
        funcs = [funcs for _ in model_chunks]
    return funcs


def unsupported_schedule_feature(config) -> Optional[str]:
    """Why a schedule without upstream's activation-offloading reset and CUDA-graph creation
    cannot run `config` (one line), or None."""
    if getattr(config, "fine_grained_activation_offloading", False):
        return ("fine-grained activation offloading (fine_grained_activation_offloading) is not "
                "supported: the schedule does not reset the offloading state between iterations")
    if getattr(config, "cuda_graph_impl", "none") == "local":
        return ("cuda_graph_impl 'local' (--cuda-graph-impl local) is not supported: Megatron's "
                "schedules create those graphs after the first iteration, this one does not")
    return None


def schedule_prologue(config, models: List[Any], forward_only: bool, is_last_stage: bool):
    """What a schedule does before its first step: clear the deferred embedding-wgrad
    activations (when gradients are finalized in Megatron-Core) and start the forward-backward
    timer. Returns the embedding module for `schedule_epilogue` (None when there is none)."""
    embedding_module = None
    if config.finalize_model_grads_func is not None and not forward_only:
        embedding_module = clear_embedding_activation_buffer(config, models, is_last_stage)
    if config.timers is not None:
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
    return embedding_module


def schedule_epilogue(config, models: List[Any], forward_only: bool, is_last_stage: bool,
                      embedding_module, total_num_tokens, pg_collection,
                      force_all_reduce: Optional[bool]) -> None:
    """What a schedule does after its last step: the deferred embedding weight gradients,
    finalize_model_grads_func (the data-parallel reduction, layernorm and embedding all-reduces),
    and stop the forward-backward timer."""
    if config.finalize_model_grads_func is not None and not forward_only:
        finish_embedding_wgrad_compute(config, embedding_module, is_last_stage, pg_collection.tp)
        config.finalize_model_grads_func(
            models,
            total_num_tokens if config.calculate_per_token_loss else None,
            pg_collection=pg_collection,
            force_all_reduce=force_all_reduce,
        )
    if config.timers is not None:
        config.timers("forward-backward").stop()
