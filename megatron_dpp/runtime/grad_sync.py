"""Megatron's data-parallel gradient-reduction protocol (no_sync_func, grad_sync_func), driven by
when each model chunk's last backward runs.

The chunks of a rank always finish their backwards deepest stage first (the backward of virtual
stage s depends on that of s+1): `launch_order`, the placement's chunks_deepest_first (V-1, ..., 0,
as a rank numbers its chunks in stage order). So every data-parallel replica launches its
reductions in the same order, whatever its dynamic schedule was.

Split backwards (--dpp-split-backward): a chunk's gradients are complete after its LAST W, not its
last B, so the protocol follows the W tasks (`before_weight_grad` / `after_weight_grad`, called
by runtime/split_backward.py's W handler); every B runs under no_sync. W tasks depend on nothing
across chunks, so the order in which chunks run their last W differs between data-parallel
replicas (their schedules and microbatch sizes differ), while reductions on one data-parallel group
must start in the same order on every replica. So
grad_sync_func (--overlap-grad-reduce) starts chunk c's reductions only once c and every chunk
before it in `launch_order` have run their last W, always in that order: a chunk whose last W comes early
waits for the chunks after it, and the rest still overlaps with the remaining W tasks. Without
grad_sync_func, no_sync is lifted for each chunk's last W as for the last B: without
overlap_grad_reduce, DDP's hooks only accumulate and finalize_model_grads reduces in chunk order;
overlap_grad_reduce without grad_sync_func (hooks launching reductions in last-W order) is refused
(`check_split_backward`).
"""
from __future__ import annotations

from megatron_dpp.mcore import schedules


class GradSync:
    """Megatron's no_sync / grad_sync_func protocol, driven by when each chunk's last backward runs."""

    def __init__(self, config, models, forward_only: bool, launch_order=None):
        """launch_order: the rank's chunks deepest stage first (Placement.chunks_deepest_first);
        None: V-1, ..., 0."""
        self.config = config
        self.models = models
        self._no_sync_func = schedules.no_sync_func(config)
        self._context = None
        self.grad_sync_funcs = schedules.grad_sync_funcs(config, models, forward_only)
        self.synchronized = set()
        # Split backwards: chunks whose last W ran, and the next chunk whose reductions may start.
        self._weight_grads_done: set = set()
        if launch_order is None:
            launch_order = range(len(models) - 1, -1, -1)
        self._launch_order = list(launch_order)
        if sorted(self._launch_order) != list(range(len(models))):
            raise ValueError(f"grad sync: launch_order {self._launch_order} must order the "
                             f"{len(models)} chunks")
        self._launched = 0  # how many of launch_order have started their reductions

    def check_split_backward(self):
        """Split backwards (the W tasks complete the gradients): refuse overlap_grad_reduce
        without grad_sync_func, where DDP's hooks would start reductions in the order the last W
        tasks run, which differs between data-parallel replicas."""
        if self.grad_sync_funcs is None and any(
                getattr(getattr(model, "ddp_config", None), "overlap_grad_reduce", False)
                for model in self.models):
            raise ValueError("split backwards with overlap_grad_reduce need config.grad_sync_func "
                             "(each chunk's start_grad_sync), so that reductions start in chunk "
                             "order on every data-parallel replica")

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

    def before_weight_grad(self, chunk: int, is_last_of_chunk: bool):
        """Split backwards: before W; the chunk's last W plays the role of its last backward."""
        self.before_backward(chunk, is_last_of_chunk)

    def after_weight_grad(self, chunk: int, is_last_of_chunk: bool):
        if self.grad_sync_funcs is not None and is_last_of_chunk:
            self._weight_grads_done.add(chunk)
            order = self._launch_order
            while self._launched < len(order) and order[self._launched] in self._weight_grads_done:
                launch = order[self._launched]
                self.enable()
                self.grad_sync_funcs[launch](self.models[launch].parameters())
                self.synchronized.add(launch)
                self._launched += 1
        self.disable()

    def finish(self):
        self.enable()
        if self.grad_sync_funcs is not None:
            for chunk in range(len(self.models)):
                if chunk not in self.synchronized:
                    self.grad_sync_funcs[chunk](self.models[chunk].parameters())
                    self.synchronized.add(chunk)
