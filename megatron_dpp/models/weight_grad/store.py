"""WeightGradStash: the weight-gradient work of a split backward, kept per microbatch until its W.

Zero Bubble's WeightGradStore keeps one FIFO queue per chunk and writes straight into
`param.main_grad` (it needs gradient-accumulation fusion and a patched DDP). A dynamic schedule
runs the W tasks of different microbatches in any order, so here the work is kept under a key (the
microbatch, or (microbatch, chunk)) and `run(key)` performs exactly that key's work. The finished
gradients are handed to each parameter's own gradient accumulator, from inside a backward
(`_HandOver`): autograd then does what it does at the end of a fused backward, so `param.grad`
accumulates, and Megatron's DDP backward hook (main_grad.add_(grad); grad = None; and under
overlap_grad_reduce, register_grad_ready) fires, now at W instead of at B.

The key is bound when the forward runs (`with stash.defer(key): forward`): the deferred layers
remember (stash, key) in their autograd context, so B needs no key and works on any thread (CUDA
runs the backward on autograd's device thread).
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable, Hashable, Iterator, Optional, Sequence

import torch

__all__ = ["WeightGradStash", "WeightGradError", "active_deferral"]


class WeightGradError(RuntimeError):
    """Misuse of a WeightGradStash (unknown key, second run, work left behind, W before B), or a
    configuration the deferred layers do not cover."""


@dataclass
class WeightGradWork:
    """One layer's deferred work for one microbatch.

    `compute(*tensors)` returns one gradient (or None) per entry of `params` (an entry may be
    None: a layer without bias); it runs under no_grad at W. `tensors` is all the work keeps
    alive (what `bytes_held` counts)."""

    params: tuple[Optional[torch.nn.Parameter], ...]
    tensors: tuple[torch.Tensor, ...]
    compute: Callable[..., Sequence[Optional[torch.Tensor]]]


class _Active(threading.local):
    """The (stash, key) a forward on this thread defers into; per thread because the one-process
    runtime harness runs one pipeline rank per thread."""

    frame: Optional[tuple["WeightGradStash", Hashable]] = None


_ACTIVE = _Active()


class _HandOver(torch.autograd.Function):
    """Passes finished gradients to parameters' AccumulateGrad nodes from a backward, so that the
    autograd engine holds the only reference to each gradient and the accumulator can take the
    tensor as `param.grad` as it is. Given by `torch.autograd.backward(params, grads)` instead,
    the caller's references stay alive and the accumulator copies every gradient it finds no
    `param.grad` for, which under Megatron's DDP (its hook sets grad = None) is every one: a copy
    of each weight gradient at every W."""

    @staticmethod
    def forward(ctx, box: list, *params):
        ctx.box = box  # [grads]: emptied by backward, so no reference stays behind
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx, _grad):
        return (None, *ctx.box.pop())


def _hand_over(params: tuple, box: list) -> None:
    """Accumulate box[0] (one gradient per parameter) into `params` through their AccumulateGrad
    nodes and the hooks on them. The caller keeps no other reference to the gradients."""
    with torch.enable_grad():
        carrier = _HandOver.apply(box, *params)
    torch.autograd.backward(carrier)


def active_deferral() -> Optional[tuple["WeightGradStash", Hashable]]:
    """(stash, key) when this thread runs a forward whose weight gradients are to be deferred.

    None outside `stash.defer(key)` and when autograd records nothing (no_grad, inference)."""
    if _ACTIVE.frame is None or not torch.is_grad_enabled():
        return None
    return _ACTIVE.frame


class WeightGradStash:
    """Deferred weight-gradient work of one pipeline rank, by microbatch key.

    with stash.defer(key): output = forward(...)   # F: the deferred layers bind to `key`
    output.backward(grad)                          # B: input gradients only; work stored
    stash.bytes_held(key)                          # what the stored work keeps alive
    stash.run(key)                                 # W: weight gradients into .grad / main_grad
    stash.check_drained()                          # end of iteration: nothing left behind
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._work: dict[Hashable, list[WeightGradWork]] = {}
        # Deferred ops whose forward ran under the key and whose backward has not run yet.
        self._awaiting_backward: dict[Hashable, int] = {}
        # Keys run since their last forward: only to tell "ran already" from "never seen".
        self._ran: set[Hashable] = set()

    # -- F ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def defer(self, key: Hashable) -> Iterator[None]:
        """Defer the weight gradients of every supported layer that runs forward in this block.

        Also wrap the backward of `key` in it when activations are recomputed (Megatron's
        recompute reruns the forward inside the backward)."""
        if _ACTIVE.frame is not None:
            stash, active_key = _ACTIVE.frame
            if stash is not self or active_key != key:
                raise WeightGradError(
                    f"defer({key!r}) inside defer({active_key!r}): one microbatch at a time")
        previous = _ACTIVE.frame
        with self._lock:
            self._ran.discard(key)
        _ACTIVE.frame = (self, key)
        try:
            yield
        finally:
            _ACTIVE.frame = previous

    def _forward_deferred(self, key: Hashable) -> None:
        """A deferred op ran forward under `key`; its backward will call `_store`."""
        with self._lock:
            self._awaiting_backward[key] = self._awaiting_backward.get(key, 0) + 1

    # -- B ---------------------------------------------------------------------------------
    def _store(self, key: Hashable, work: WeightGradWork) -> None:
        """Called from a deferred op's backward (possibly on autograd's device thread)."""
        with self._lock:
            left = self._awaiting_backward.get(key, 0) - 1
            if left > 0:
                self._awaiting_backward[key] = left
            else:
                self._awaiting_backward.pop(key, None)
            self._work.setdefault(key, []).append(work)

    # -- W ---------------------------------------------------------------------------------
    def run(self, key: Hashable) -> None:
        """Compute and accumulate every weight gradient stored under `key`, then forget it.

        The work runs in the order the backward stored it (output side first, as a fused backward
        accumulates). A parameter used more than once under the key (tied embeddings on one stage)
        gets one accumulation of the summed gradient, as autograd gives it, so DDP's hook fires
        once per parameter and microbatch either way."""
        with self._lock:
            awaiting = self._awaiting_backward.get(key, 0)
            if awaiting:
                raise WeightGradError(
                    f"run({key!r}): its backward has not finished ({awaiting} deferred ops still "
                    f"wait for their gradient); W must follow B")
            works = self._work.pop(key, None)
            if works is None:
                if key in self._ran:
                    raise WeightGradError(f"run({key!r}): this key's weight gradients already ran")
                held = sorted(map(repr, self._work))
                raise WeightGradError(
                    f"run({key!r}): nothing is stored under this key (keys holding work: "
                    f"{', '.join(held) or 'none'}); was its forward run under defer({key!r})?")
            self._ran.add(key)
        last_use = {}
        for index, work in enumerate(works):
            for param in work.params:
                if param is not None:
                    last_use[id(param)] = index
        pending: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
        with torch.no_grad():
            for index in range(len(works)):
                work = works[index]
                works[index] = None  # free this layer's tensors as soon as its gradients exist
                self._collect(work, pending)
                work = None
                ready = [ident for ident in pending if last_use[ident] == index]
                if ready:
                    params, grads = zip(*(pending.pop(ident) for ident in ready))
                    box = [grads]
                    del grads  # the box holds the only reference (see _HandOver)
                    # Through the parameters' AccumulateGrad nodes: .grad accumulates and the
                    # hooks on them (Megatron DDP's) run, exactly as in a fused backward.
                    _hand_over(params, box)

    @staticmethod
    def _collect(work: WeightGradWork, pending: dict) -> None:
        """Compute `work`'s gradients into `pending` (id(param) -> (param, summed gradient)).
        A function of its own so that no local name keeps a gradient alive after it returns."""
        grads = work.compute(*work.tensors)
        work.tensors = ()
        for param, grad in zip(work.params, grads):
            if param is None or grad is None:
                continue
            if id(param) in pending:
                grad = pending[id(param)][1] + grad
            pending[id(param)] = (param, grad)

    # -- accounting and checks -------------------------------------------------------------
    def bytes_held(self, key: Optional[Hashable] = None) -> int:
        """Bytes of the distinct tensor storages the stored work of `key` (of all keys when None)
        keeps alive. A storage shared with a live activation counts too: it stays alive until W."""
        with self._lock:
            lists = [self._work.get(key, [])] if key is not None else list(self._work.values())
            seen: dict[int, int] = {}
            for works in lists:
                for work in works:
                    for tensor in work.tensors:
                        storage = tensor.untyped_storage()
                        seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    def keys(self) -> list[Hashable]:
        """Keys with stored work or with deferred ops still waiting for their backward."""
        with self._lock:
            return list(dict.fromkeys([*self._work, *self._awaiting_backward]))

    def check_drained(self) -> None:
        """Raise when work is left behind (a W not run, or a B not finished)."""
        with self._lock:
            problems = [f"{key!r}: {len(works)} layers' work not run"
                        for key, works in self._work.items()]
            problems += [f"{key!r}: {count} deferred ops without their backward"
                         for key, count in self._awaiting_backward.items()]
        if problems:
            raise WeightGradError("weight-gradient work left behind: " + "; ".join(problems))

    def discard(self, key: Optional[Hashable] = None) -> None:
        """Drop the work of `key` (of every key when None) without running it (error recovery)."""
        with self._lock:
            if key is None:
                self._work.clear()
                self._awaiting_backward.clear()
                self._ran.clear()
            else:
                self._work.pop(key, None)
                self._awaiting_backward.pop(key, None)
                self._ran.discard(key)
