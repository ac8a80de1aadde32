"""Setting up a training run: the node network, the process groups, the seeds, the model chunks
wrapped for mixed precision and DDP, the optimizer, and the hooks the schedules call (the
gradient sync functions, NVTX ranges, the step tracer, the stall watchdog)."""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import get_megatron_optimizer, get_standard_config_overrides

from megatron_dpp import kernels
from megatron_dpp.comm.nodes import this_node_rank, use_node_network
from megatron_dpp.exit_codes import BAD_INPUT
from megatron_dpp.mcore.ddp import DistributedDataParallel
from megatron_dpp.mcore.optimizer import (
    install_foreach_multi_tensor_ops,
    set_torch_adam_implementation,
)
from megatron_dpp.mcore.sgd_state import install_sgd_state_init
from megatron_dpp.models import ModelSpec
from megatron_dpp.parallel.split import PipelineSplit
from megatron_dpp.platform import Platform
from megatron_dpp.rank_failure import say_failure
from megatron_dpp.runtime.config import DPPConfig
from megatron_dpp.runtime.watchdog import StallWatchdog
from megatron_dpp.trace.recorder import GRADIENT_SYNC
from megatron_dpp.training.config import (
    ddp_config_from_args,
    optimizer_config_from_args,
    transformer_config_from_args,
)
from megatron_dpp.training.observe.step_tracing import StepTracer
from megatron_dpp.training.observe.timers import attach_timers, timers_from_args
from megatron_dpp.training.rank_log import log, log_rank0
from megatron_dpp.stage_placement import embedding_ranks_for, job_placement, use_stage_placement
from megatron_dpp.training.tied_embeddings import finalize_with_local_tie


def setup_node_network(args: argparse.Namespace) -> bool:
    """--multi-node: make gloo and NCCL use this node's --node-ips interface, before any process
    group exists. False (after one line on stderr) when that address is not on this node."""
    try:
        network = use_node_network(args.node_ips, this_node_rank())
    except ValueError as error:  # NodeNetworkError, or torchrun's GROUP_RANK missing
        say_failure(f"megatron_dpp: error: {error}", exit_code=BAD_INPUT)
        return False
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one line per node
        log(network.describe())
    return True


def initialize_distributed(args: argparse.Namespace, platform: Platform) -> None:
    dist.init_process_group(backend=args.parallel.distributed_backend,
                            timeout=timedelta(minutes=args.distributed_timeout_minutes))
    use_stage_placement(args.dpp_stage_placement)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.parallel.virtual_pipeline_model_parallel_size,
        get_embedding_ranks=embedding_ranks_for(
            args.dpp_stage_placement, args.parallel.chunks_per_rank,
            tied=not getattr(args, "untie_embeddings_and_output_weights", False)),
    )


def set_seeds(seed: int, cuda_graphs: bool = False) -> None:
    """Megatron-LM's scheme: the pipeline rank offsets the seed (dropout differs per stage). With
    CUDA graphs the tracker's states are graph-safe generators, which the graphs can replay (as
    Megatron-LM seeds for --cuda-graph-impl)."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=cuda_graphs)


def wrap_for_mixed_precision(config, chunks: list) -> list:
    """With --bf16 or --fp16, each chunk inside Megatron-Core's Float16Module, as Megatron-LM's
    get_model does: it casts every parameter to 16 bits (torch's own layers, such as the learned
    position embedding and the local spec's layer norms, are built in fp32, and a forward would
    mix dtypes), the first stage's input too, and returns the last stage's outputs in fp32."""
    if not (config.bf16 or config.fp16):
        return chunks
    from megatron.core.transformer.module import Float16Module

    return [Float16Module(config, chunk) for chunk in chunks]


def build_model_and_optimizer(args, platform: Platform, seed: int, spec: ModelSpec):
    config = transformer_config_from_args(args)
    # --timing-log-level: Megatron-Core's schedules, gradient sync and optimizer time themselves.
    timers = timers_from_args(args, platform.device)
    attach_timers(config, timers, args.barrier_with_L1_time)
    chunks = spec.build_chunks(args, config, seed)  # args.padded_vocab_size: set by build_tokenizer
    num_parameters = log_model_size(config, chunks)
    chunks = wrap_for_mixed_precision(config, [chunk.to(platform.device) for chunk in chunks])
    ddp_config = ddp_config_from_args(args, num_parameters)
    # Without Apex / Transformer Engine: torch foreach ops for the gradient norm, clipping and the
    # main-to-model parameter copy instead of Megatron-Core's per-tensor loops, which synchronize
    # with the GPU once per parameter tensor (mcore/optimizer.py).
    install_foreach_multi_tensor_ops()
    model = [
        # Only the first chunk buckets its gradients (Megatron-LM does the same).
        DistributedDataParallel(config, ddp_config, module=chunk, disable_bucketing=index > 0)
        for index, chunk in enumerate(chunks)
    ]
    optimizer_config = optimizer_config_from_args(args)
    attach_timers(optimizer_config, timers, args.barrier_with_L1_time)
    overrides = optimizer_config_overrides(optimizer_config)
    optimizer = get_megatron_optimizer(optimizer_config, model, config_overrides=overrides)
    set_torch_adam_implementation(optimizer, fused=kernels.torch_fused_adam(args.optimizer))
    install_sgd_state_init(optimizer)  # --optimizer sgd: what a torch_dist load calls
    set_sync_funcs(config, model, args)
    config.finalize_model_grads_func = finalize_with_local_tie(
        finalize_model_grads, job_placement(), parallel_state.get_pipeline_model_parallel_rank())
    config.grad_scale_func = optimizer.scale_loss
    return config, model, optimizer


def optimizer_config_overrides(optimizer_config) -> dict:
    """Megatron-Core's default param-group overrides, --decoupled-lr's group marked
    is_decoupled_lr: 0.16.1's optimizer load tells the saved groups apart by (wd_mult, lr_mult,
    is_expert_parallel, is_decoupled_lr) only, and would take the decoupled group's state for the
    default group's (a resume fails on their sizes)."""
    overrides = get_standard_config_overrides(optimizer_config)
    for override in overrides.values():
        if "max_lr" in override:  # the decoupled one (is_embedding_or_output_parameter)
            override["is_decoupled_lr"] = True
    return overrides


def log_model_size(config, chunks: list) -> int:
    """Megatron-LM's parameter count line, from each (tensor, pipeline) rank of the first
    data-parallel replica, and, on rank 0, the pipeline split when a flag made it other than even
    (parallel/split.py). Returns this rank's parameter count."""
    split = PipelineSplit.from_config(config)
    if not split.is_default:
        log_rank0(f" pipeline split: transformer layers per pipeline rank {split.describe()}")
    count = sum(param.nelement() for chunk in chunks for param in chunk.parameters())
    if parallel_state.get_data_parallel_rank() == 0:
        # One write, so that the ranks' lines do not interleave.
        sys.stdout.write(f" > number of parameters on (tensor, pipeline) model parallel rank "
                         f"({parallel_state.get_tensor_model_parallel_rank()}, "
                         f"{parallel_state.get_pipeline_model_parallel_rank()}): {count}\n")
        sys.stdout.flush()
    return count


def set_sync_funcs(config, model: list, args: argparse.Namespace) -> None:
    """The data-parallel hooks the schedules call on `config` (one per model chunk, or the one
    function itself for one chunk), as Megatron-LM sets them: no_sync_func always; grad_sync_func
    with --overlap-grad-reduce unless --no-delay-grad-reduce (the schedule then launches the
    reductions of all but the first pipeline stage after their last backward); param_sync_func
    with --overlap-param-gather and --delay-param-gather."""
    def per_chunk(funcs: list):
        return funcs[0] if len(funcs) == 1 else funcs

    config.no_sync_func = per_chunk([chunk.no_sync for chunk in model])
    if args.overlap_grad_reduce and args.delay_grad_reduce:
        config.grad_sync_func = per_chunk([chunk.start_grad_sync for chunk in model])
    if args.overlap_param_gather and args.delay_param_gather:
        config.param_sync_func = per_chunk([chunk.start_param_sync for chunk in model])


@contextlib.contextmanager
def params_gathered(model: list):
    """With --overlap-param-gather the last optimizer step's parameters are gathered only by the
    next forward's pre-hooks (DDP's use_forward_hook): for what reads the model outside training
    (evaluation, checkpoints), gather them now (disable_forward_pre_hook all-gathers
    synchronously) and turn the hooks back on afterwards, as Megatron-LM does."""
    hooked = [chunk for chunk in model if getattr(chunk, "use_forward_hook", False)]
    for chunk in hooked:
        chunk.disable_forward_pre_hook()
    try:
        yield
    finally:
        for chunk in hooked:
            chunk.enable_forward_pre_hook()


@contextlib.contextmanager
def nvtx_range(name: str):
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


def nvtx_around_gradient_sync(config) -> None:
    """--nvtx: an NVTX range GRADIENT_SYNC around config.finalize_model_grads_func, the hook both
    the DPP runtime and Megatron's schedules call once an iteration's last backward ran."""
    finalize = config.finalize_model_grads_func
    if finalize is None:
        return

    def finalize_model_grads(*args, **kwargs):
        with nvtx_range(GRADIENT_SYNC):
            return finalize(*args, **kwargs)

    config.finalize_model_grads_func = finalize_model_grads


def step_tracer(forward_backward, config) -> StepTracer | None:
    """With --trace (the schedule's RunTrace on forward_backward): the recorder of the parts of the
    step around the schedule, its gradient sync hooked through config.finalize_model_grads_func."""
    trace = getattr(forward_backward, "trace", None)
    if trace is None:
        return None
    tracer = StepTracer(trace.recorder)
    if config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func = tracer.traced_finalize(config, config.finalize_model_grads_func)
    return tracer


def stall_watchdog(args: argparse.Namespace) -> StallWatchdog | None:
    """With --use-dpp, --dpp-timeout also bounds the blocking collectives of a training step: a
    peer that stops while this rank waits in one ends the job with a report instead of a hang. It
    fires a little after the runtime's own deadline, whose report (awaited tags, ready tasks) is
    more precise when the stall is inside the schedule."""
    if not getattr(args, "use_dpp", False):
        return None
    margin_s = max(2.0, 0.25 * args.dpp_timeout)
    return StallWatchdog(args.dpp_timeout + margin_s, DPPConfig.timeout_exit_code)
