"""Megatron-Core's model-parallel RNG fork with less host work, for attention dropout.

Megatron-Core draws attention dropout from its tracker's model-parallel stream
(`get_cuda_rng_tracker().fork()`: each tensor-parallel rank a mask of its own for its own heads).
The fork swaps the device generator's state for the stream's and back: per call two state reads and
two writes, wrapped in some forty Python calls, plus a copy and comparison of the CPU generator's
state that only feeds a warning. Core attention forks once per layer and micro-batch, and where
the host bounds the step (GPT-125m on one GPU: 96 forks an iteration) that Python is on the
critical path.

`model_parallel_rng(device)` does the same swap directly on the device's default generator: the
same states read and written in the same order, so the same dropout masks and the same tracker
state afterwards (tests/test_rng_fork.py checks both against Megatron's fork), and a
checkpointed recompute (which restores the tracker's states) replays the same mask. It keeps the
tracker's current-state bookkeeping. It hands over to Megatron's own fork where its states are
not plain state tensors or another fork is open: graph-safe generators (CUDA graphs), Transformer
Engine's tracker, a nested fork.
"""
from __future__ import annotations

import torch
from megatron.core.tensor_parallel import random as megatron_random

# Megatron-Core's names for the stream and for "no fork open".
MODEL_PARALLEL_STREAM = megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME
_DEFAULT_STATE = "default-rng"


def _default_generator(device: torch.device) -> torch.Generator:
    """The generator Megatron's tracker swaps states in: the device's default CUDA generator, or on
    the CPU (mcore/cpu_patches.py points the tracker at it) torch's default generator."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


class _StateSwap:
    """The body of CudaRNGStatesTracker.fork(name) for plain state tensors, as a context manager."""

    __slots__ = ("tracker", "generator", "name", "outer_state")

    def __init__(self, tracker, generator: torch.Generator, name: str):
        self.tracker = tracker
        self.generator = generator
        self.name = name
        self.outer_state = None

    def __enter__(self) -> None:
        self.outer_state = self.generator.get_state()
        self.generator.set_state(self.tracker.states_[self.name])
        self.tracker._current_state_name = self.name

    def __exit__(self, *_exc) -> None:
        self.tracker.states_[self.name] = self.generator.get_state()
        self.generator.set_state(self.outer_state)
        self.tracker._current_state_name = _DEFAULT_STATE


def model_parallel_rng(device: torch.device):
    """A context manager in which the device's generator draws from the tracker's model-parallel
    stream: Megatron-Core's `get_cuda_rng_tracker().fork()`, the same numbers."""
    tracker = megatron_random.get_cuda_rng_tracker()
    plain = (type(tracker) is megatron_random.CudaRNGStatesTracker
             and not tracker.use_cudagraphable_rng
             and tracker._current_state_name == _DEFAULT_STATE
             and MODEL_PARALLEL_STREAM in tracker.states_)
    if not plain:
        return tracker.fork()
    return _StateSwap(tracker, _default_generator(device), MODEL_PARALLEL_STREAM)
