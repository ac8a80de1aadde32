"""Timed stages: model chunks whose forward and backward hold a set duration inside real autograd.

A TimedStage looks like a Megatron-Core model chunk to the schedules (config, model_type,
set_input_tensor) but computes nothing: its forward sleeps for the duration of (rank, F, microbatch,
chunk) and its backward for (rank, B, microbatch, chunk), both looked up in the simulator's sampled
TaskDurations (1 time unit = 1 ms). Sleeping, not spinning, so 4-8 ranks fit on 2 cores and the
schedule, not the CPU, decides the iteration time.

The activation a microbatch carries is a float tensor [tokens, 1, hidden]; its element [0, 0, 0]
holds the microbatch index, which each stage passes on unchanged, so a stage knows which task it is
running whatever order a schedule chose. Each forward allocates the microbatch's activation bytes and
keeps them until its backward; ActivationMeter records how many bytes a rank held at most.
Each stage also records how much later than asked its sleeps end (`oversleep_ms`, per phase): on
loaded cores a sleeping process wakes late, a per-task cost every executor pays alike.

Split backwards (the DPP runtime's --dpp-split-backward): a forward run under the runtime's
`stash.defer(key)` (a TimedStash) makes its backward a B and a W. B sleeps for the split graph's B
duration and stores the W work under the key; the runtime's W task runs it (`stash.run(key)`),
which sleeps for the W duration and only then frees the activation, as the simulator's split graph
holds a microbatch's bytes from F to W.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import time
from typing import Callable, Dict, Hashable, Iterator, List, Optional

import torch
from megatron.core.enums import ModelType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_dpp.pipeline import Phase, Task
from megatron_dpp.sim import TaskDurations

HIDDEN = 4  # width of the carried activation; its bytes on the wire are not the modeled bytes


PR_SET_TIMERSLACK = 29  # linux/prctl.h


def precise_sleeps(slack_ns: int = 1) -> None:
    """Let this process's sleeps end on time. Linux ends a sleep up to the thread's timer slack
    late (50 us by default) to batch wake-ups; a timed stage stands for a kernel of exact
    duration, and its lateness would add to every task of every schedule (about 0.1 ms a task
    here at the default, 0.05 ms at 1 ns; TimedStage.oversleep_ms records what remains). Set
    before the transport starts its threads, which inherit it. Not Linux: nothing to set."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(slack_ns), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_TIMERSLACK, {slack_ns}): {os.strerror(errno)}")


class ActivationMeter:
    """Activation bytes held by the timed stages of one process, and the most ever held."""

    def __init__(self):
        self.held = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def remove(self, nbytes: int) -> None:
        self.held -= nbytes

    def reset(self) -> None:
        self.held = 0
        self.peak = 0


class TimedStash:
    """The DPP runtime's weight-gradient stash for timed stages (the interface of
    megatron_dpp.models.weight_grad.WeightGradStash that the runtime uses): a forward run under
    `defer(key)` leaves its W work here at B, `run(key)` performs it."""

    def __init__(self):
        self.deferring: Optional[Hashable] = None  # the key of the forward running now
        self._work: Dict[Hashable, List[tuple]] = {}  # key -> [(bytes it keeps, work)]

    @contextlib.contextmanager
    def defer(self, key: Hashable) -> Iterator[None]:
        previous, self.deferring = self.deferring, key
        try:
            yield
        finally:
            self.deferring = previous

    def store(self, key: Hashable, nbytes: int, work: Callable[[], None]) -> None:
        self._work.setdefault(key, []).append((nbytes, work))

    def run(self, key: Hashable) -> None:
        if key not in self._work:
            raise RuntimeError(f"TimedStash.run({key!r}): nothing stored (W before its B?)")
        for _nbytes, work in self._work.pop(key):
            work()

    def bytes_held(self, key: Optional[Hashable] = None) -> int:
        lists = [self._work.get(key, [])] if key is not None else list(self._work.values())
        return sum(nbytes for works in lists for nbytes, _work in works)

    def keys(self) -> List[Hashable]:
        return list(self._work)

    def check_drained(self) -> None:
        if self._work:
            raise RuntimeError(f"TimedStash: W work left behind for {sorted(map(repr, self._work))}")

    def discard(self, key: Optional[Hashable] = None) -> None:
        if key is None:
            self._work.clear()
        else:
            self._work.pop(key, None)


class _Hold(torch.autograd.Function):
    """Identity on the activation that holds the task's duration and activation bytes."""

    @staticmethod
    def forward(ctx, x, weight, stage: "TimedStage", microbatch: int):
        stage.hold(Phase.F, microbatch)
        nbytes = stage.act_bytes[microbatch]
        ctx.held = torch.empty(nbytes, dtype=torch.uint8)  # the activation memory, kept to backward
        ctx.stage, ctx.microbatch = stage, microbatch
        # Under the runtime's defer(key): a split backward, its W stored under the key at B.
        ctx.deferred_key = stage.stash.deferring if stage.stash is not None else None
        stage.meter.add(nbytes)
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        stage, microbatch, held, key = ctx.stage, ctx.microbatch, ctx.held, ctx.deferred_key
        ctx.held = None
        if key is None:
            stage.hold(Phase.B, microbatch)
            stage.meter.remove(held.numel())
        else:
            stage.hold(Phase.B, microbatch, split=True)

            def weight_grad() -> None:
                stage.hold(Phase.W, microbatch, split=True)
                stage.meter.remove(held.numel())

            stage.stash.store(key, held.numel(), weight_grad)
        return grad, torch.zeros(1), None, None


class TimedStage(torch.nn.Module):
    """Model chunk `chunk` of pipeline rank `rank`, for Megatron's schedules and the DPP runtime."""

    def __init__(self, config: TransformerConfig, rank: int, chunk: int, durations: TaskDurations,
                 act_bytes: List[int], meter: ActivationMeter, time_unit_s: float = 1e-3,
                 split_durations: Optional[TaskDurations] = None,
                 stash: Optional[TimedStash] = None):
        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.rank, self.chunk = rank, chunk
        self.vp_stage = chunk if (config.virtual_pipeline_model_parallel_size or 1) > 1 else None
        self.durations = durations
        # Split backwards: the same draws with each backward divided into B and W (the simulator's
        # split graph), and the stash the runtime defers into.
        self.split_durations = split_durations
        self.stash = stash
        self.act_bytes = act_bytes
        self.meter = meter
        self.time_unit_s = time_unit_s
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.input_tensor: Optional[torch.Tensor] = None
        self.pre_process = rank == 0 and chunk == 0
        self.oversleep_ms = {Phase.F: [], Phase.B: [], Phase.W: []}

    def seconds(self, phase: Phase, microbatch: int, split: bool = False) -> float:
        """The task's duration; with `split`, B and W of the split backward (F is the same)."""
        durations = self.split_durations if split else self.durations
        if durations is None:
            raise ValueError("TimedStage: a split backward needs split_durations")
        return durations(self.rank, Task(phase, microbatch, self.chunk)) * self.time_unit_s

    def hold(self, phase: Phase, microbatch: int, split: bool = False) -> None:
        """Sleep for the task's duration; record how late the sleep ended."""
        requested = self.seconds(phase, microbatch, split)
        start = time.perf_counter()
        time.sleep(requested)
        self.oversleep_ms[phase].append((time.perf_counter() - start - requested) * 1e3)

    def set_input_tensor(self, input_tensor) -> None:
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        microbatch = int(x[0, 0, 0].item())
        return _Hold.apply(x, self.weight, self, microbatch)


def microbatch_item(microbatch: int, tokens: int) -> dict:
    """What the data iterator yields for one microbatch: its tokens and index."""
    return {"tokens": torch.zeros(1, tokens, dtype=torch.int64), "microbatch": microbatch}


def microbatch_work(item: dict) -> int:
    """The relative work of a microbatch item: its token count (the runtime's policy sizes)."""
    return int(item["tokens"].numel())


def data_iterator(sizes: List[int]) -> Iterator[dict]:
    return iter([microbatch_item(m, size) for m, size in enumerate(sizes)])


def forward_step(data_iterator, model: TimedStage):
    """Megatron forward_step_func for timed stages: the first stage builds the activation from data."""
    if model.pre_process:
        item = next(data_iterator)
        x = torch.zeros(item["tokens"].shape[1], 1, HIDDEN)
        x[0, 0, 0] = float(item["microbatch"])
    else:
        x = model.input_tensor
    output = model(x)

    def loss_func(output_tensor):
        loss = output_tensor.mean()
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


def timed_stage_config(P: int, V: int) -> TransformerConfig:
    """A TransformerConfig that satisfies Megatron's schedules (the layer fields are unused)."""
    config = TransformerConfig(
        num_layers=P * V,
        hidden_size=HIDDEN,
        num_attention_heads=1,
        pipeline_model_parallel_size=P,
        virtual_pipeline_model_parallel_size=V if V > 1 else None,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        deallocate_pipeline_outputs=False,
    )
    # Set after construction: the constructor ties this flag to MoE dispatcher checks we don't use.
    # Megatron's schedules then exchange shapes per message, as varlen microbatches need.
    config.variable_seq_lengths = True
    return config
