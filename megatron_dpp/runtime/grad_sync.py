"""Megatron's data-parallel gradient-reduction protocol (no_sync_func, grad_sync_func), driven by
when each model chunk's last backward runs.

The chunks of a rank always finish their backwards in the order V-1, ..., 0 (the backward of
virtual stage s depends on that of s+1), so every data-parallel replica launches its reductions in
the same order, whatever its dynamic schedule was.
"""
from __future__ import annotations

import contextlib


class GradSync:
    """Megatron's no_sync / grad_sync_func protocol, driven by when each chunk's last backward runs."""

    def __init__(self, config, models, forward_only: bool):
        self.config = config
        self.models = models
        no_sync = config.no_sync_func
        if isinstance(no_sync, list):
            funcs = list(no_sync)

            def all_chunks_no_sync():
                stack = contextlib.ExitStack()
                for chunk_no_sync in funcs:
                    stack.enter_context(chunk_no_sync())
                return stack

            no_sync = all_chunks_no_sync
        self._no_sync_func = no_sync or contextlib.nullcontext
        self._context = None
        grad_sync = None if forward_only else config.grad_sync_func
        if grad_sync is not None and not isinstance(grad_sync, list):
            grad_sync = [grad_sync for _ in models]
        self.grad_sync_funcs = grad_sync
        self.synchronized = set()

    def disable(self):
        if self._context is None:
            self._context = self._no_sync_func()
            self._context.__enter__()

    def enable(self):
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None

    def before_backward(self, chunk: int, is_last_of_chunk: bool):
        # Default DDP path: the hooks of the chunk's last backward launch its reductions.
        if self.grad_sync_funcs is None and is_last_of_chunk:
            self.enable()
            self.synchronized.add(chunk)

    def after_backward(self, chunk: int, is_last_of_chunk: bool):
        if self.grad_sync_funcs is not None and is_last_of_chunk:
            self.enable()
            self.grad_sync_funcs[chunk](self.models[chunk].parameters())
            self.synchronized.add(chunk)
        self.disable()

    def finish(self):
        self.enable()
        if self.grad_sync_funcs is not None:
            for chunk in range(len(self.models)):
                if chunk not in self.synchronized:
                    self.grad_sync_funcs[chunk](self.models[chunk].parameters())
                    self.synchronized.add(chunk)
