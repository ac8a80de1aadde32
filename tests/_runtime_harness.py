"""The DPP executor for P pipeline ranks in one process: one thread per rank, the in-memory
transport (megatron_dpp.comm.memory_transport) and a toy model, so a runtime test takes well under
a second. The executor is the real one (IterationRunner with Megatron-Core's forward_step and
backward_step); only the process groups are replaced by a RankLayout per rank.

    result = run_pipeline(P=2, V=2, sizes=[3, 1, 4, 1], policy="dpp:adaptive")
    result.records[rank].tasks, result.grads, result.losses

`reference_grads(...)` computes the same batch without a pipeline, for parity.
`device="cuda"` puts the models and the data of every rank on the current GPU (built before the
threads start); `sync_debug_mode="error"` then runs the ranks under
torch.cuda.set_sync_debug_mode, so a host-device synchronization in the runtime fails the rank.
`split_backward=True` runs B and W tasks: the toy linear defers its weight gradient to W
(models.weight_grad's DeferredLinearFunction) inside the runtime's `stash.defer(key)`.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
from megatron.core.enums import ModelType
from megatron.core.model_parallel_config import ModelParallelConfig

from megatron_dpp.comm.memory_transport import MemoryHub
from megatron_dpp.models.weight_grad import WeightGradStash, active_deferral
from megatron_dpp.models.weight_grad.functions import DeferredLinearFunction, open_site, proxy
from megatron_dpp.pipeline.placement import INTERLEAVED, named_placement
from megatron_dpp.runtime.config import DPPConfig
from megatron_dpp.runtime.executor import DPPSession, IterationRecord, IterationRunner
from megatron_dpp.runtime.layout import RankLayout

HIDDEN = 4
BYTES_PER_TOKEN = 100


class ToyChunk(torch.nn.Module):
    """One model chunk: a linear layer (tanh between chunks). Stage s has weights seeded by s, so the
    whole model is the same whatever the layout."""

    def __init__(self, stage: int, config: ModelParallelConfig):
        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN)
        generator = torch.Generator().manual_seed(1000 + stage)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(HIDDEN, HIDDEN, generator=generator) * 0.5)
            self.linear.bias.copy_(torch.randn(HIDDEN, generator=generator) * 0.1)
        self.input_tensor: Optional[torch.Tensor] = None

    def set_input_tensor(self, tensors) -> None:
        self.input_tensor = tensors[0] if isinstance(tensors, list) else tensors

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        deferral = active_deferral()
        if deferral is None:
            return torch.tanh(self.linear(x))
        site = open_site(deferral[0], deferral[1], self.linear.weight, self.linear.bias)
        return torch.tanh(DeferredLinearFunction.apply(
            x, proxy(self.linear.weight), proxy(self.linear.bias), site, False, None))


def weight_grad_bytes(_models, sizes, dtype) -> List[int]:
    """What the toy's stash holds per microbatch and chunk: the linear's input and output
    gradient, HIDDEN values each per token."""
    element = torch.empty((), dtype=dtype).element_size()
    return [tokens * 2 * HIDDEN * element for tokens in sizes]


def toy_config(P: int) -> ModelParallelConfig:
    config = ModelParallelConfig(pipeline_dtype=torch.float32, pipeline_model_parallel_size=P,
                                 microbatch_group_size_per_vp_stage=P)
    config.calculate_per_token_loss = False  # a TransformerConfig field Megatron's step reads
    return config


def microbatch(m: int, tokens: int) -> dict:
    generator = torch.Generator().manual_seed(m)
    return {"x": torch.randn(tokens, HIDDEN, generator=generator), "m": m}


def microbatch_work(item: dict) -> int:
    return int(item["x"].shape[0])


def _loss(output: torch.Tensor):
    loss = output.square().sum()
    tokens = torch.tensor(output.shape[0], dtype=torch.int)
    return loss, tokens, {"loss": loss.detach().clone()}


def forward_step(data_iterator, model: ToyChunk):
    """Megatron's forward_step_func: reads exactly one item (every stage does, as GPT's does)."""
    item = next(data_iterator) if data_iterator is not None else None
    x = model.input_tensor if model.input_tensor is not None else item["x"]
    return model(x), _loss


@dataclass
class PipelineResult:
    records: Dict[int, IterationRecord] = field(default_factory=dict)
    grads: Dict[int, torch.Tensor] = field(default_factory=dict)  # virtual stage -> weight grad
    losses: List[float] = field(default_factory=list)  # per microbatch, from the last stage
    errors: Dict[int, BaseException] = field(default_factory=dict)
    stashes: Dict[int, object] = field(default_factory=dict)  # split backwards: each rank's stash
    hub: Optional[MemoryHub] = None


def run_pipeline(P: int, V: int, sizes: List[int], policy: str, *, tp: int = 1,
                 budget_bytes: Optional[int] = None, split_backward: bool = False,
                 timeout_s: float = 10.0, forward_only: bool = False, join_s: float = 30.0,
                 rank_fn: Optional[Callable[[int, IterationRunner], None]] = None,
                 hub: Optional[MemoryHub] = None, device: str = "cpu",
                 sync_debug_mode: Optional[str] = None,
                 placement: str = INTERLEAVED) -> PipelineResult:
    """One global batch of len(sizes) microbatches (sizes = tokens) on P ranks x V chunks, each
    stage held by `tp` ranks (global rank = stage * tp + i) that follow their group's first rank's
    decisions (the toy chunks compute the whole layer on every one of them).

    `placement` (--dpp-stage-placement's names): which stage each rank's chunk c is.
    `rank_fn(rank, runner)` runs instead of `runner.run()` when given (to stop a rank, say).
    Errors of each rank's thread are collected in `errors`, not raised."""
    M = len(sizes)
    hub = hub if hub is not None else MemoryHub(timeout_s=timeout_s)
    config = toy_config(P)
    items = [{**item, "x": item["x"].to(device)}
             for item in (microbatch(m, tokens) for m, tokens in enumerate(sizes))]
    # Every rank's chunks, built here: moving weights to a GPU synchronizes, the ranks must not.
    stages = named_placement(placement, P, V)
    models_of = {rank: [ToyChunk(stages.stage(divmod(rank, tp)[0], c), config).to(device)
                        for c in range(V)]
                 for rank in range(P * tp)}
    result = PipelineResult(hub=hub)
    lock = threading.Lock()

    def rank_main(rank: int) -> None:
        try:
            stage, tp_index = divmod(rank, tp)
            models = models_of[rank]
            session = DPPSession(
                config=DPPConfig(policy=policy, memory_budget_bytes=budget_bytes, timeout_s=timeout_s,
                                 split_backward=split_backward, placement=placement),
                transport=hub.transport(rank), microbatch_work=microbatch_work,
                activation_bytes_fn=lambda _cfg, s, _mbs, _V, _P: [t * BYTES_PER_TOKEN for t in s],
                weight_grad_bytes_fn=weight_grad_bytes,
                stash=WeightGradStash() if split_backward else None)
            layout = RankLayout(pp_rank=stage, pp_ranks=[s * tp + tp_index for s in range(P)],
                                tp_ranks=[stage * tp + i for i in range(tp)], global_rank=rank,
                                agree_sizes=lambda _local, _count: list(sizes) * 2)  # work, tokens
            runner = IterationRunner(
                session=session, layout=layout, config=config, models=models,
                iterators=[iter(items) for _ in range(V)], forward_step_func=forward_step,
                num_microbatches=M, seq_length=max(sizes), micro_batch_size=1,
                forward_only=forward_only)
            if rank_fn is not None:
                rank_fn(rank, runner)
                return
            store = runner.run()
            with lock:
                result.records[rank] = session.last_record
                result.stashes[rank] = session.stash
                for c, model in enumerate(models):
                    if model.linear.weight.grad is not None and tp_index == 0:
                        result.grads[stages.stage(stage, c)] = model.linear.weight.grad.clone()
                if rank == stages.location(stages.last_stage)[0] * tp:
                    result.losses = [entry["loss"] for entry in store]  # floats after the join
        except BaseException as error:  # reported to the test
            with lock:
                result.errors[rank] = error

    threads = [threading.Thread(target=rank_main, args=(rank,), name=f"harness-rank-{rank}")
               for rank in range(P * tp)]
    if sync_debug_mode is not None:
        torch.cuda.set_sync_debug_mode(sync_debug_mode)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(join_s)
    finally:
        if sync_debug_mode is not None:
            torch.cuda.set_sync_debug_mode("default")
    stuck = [thread.name for thread in threads if thread.is_alive()]
    if stuck:
        hub.lost(-1)
        raise AssertionError(f"harness ranks did not finish within {join_s} s: {stuck}")
    result.losses = [float(loss) for loss in result.losses]
    return result


def reference_grads(P: int, V: int, sizes: List[int]) -> tuple[Dict[int, torch.Tensor], List[float]]:
    """The same model and batch without a pipeline: every stage in sequence, loss scaled as
    Megatron's forward_step scales it (by tokens and by the number of microbatches)."""
    config = toy_config(P)
    stages = [ToyChunk(s, config) for s in range(P * V)]
    losses = []
    for m, tokens in enumerate(sizes):
        x = microbatch(m, tokens)["x"]
        for stage in stages:
            x = stage(x)
        loss, count, report = _loss(x)
        (loss / count / len(sizes)).backward()
        losses.append(float(report["loss"]))
    return {s: stage.linear.weight.grad.clone() for s, stage in enumerate(stages)}, losses
