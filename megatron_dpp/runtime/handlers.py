"""One handler per task kind: what running a task means on this rank.

A handler computes its task with Megatron-Core's own step functions (forward_step, backward_step)
and hands its output to the runner's `send`; the runner does everything around it (choosing the
task, the ready rule, memory accounting, the record). `IterationView` lists what a handler may use
of the runner. `make_handlers` gives the table of F and B; the split backward (the runner's one
optional feature, `IterationRunner.split_backward`, runtime/split_backward.py) puts its own F, B
and W into that table.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

import torch

from megatron_dpp.mcore.schedules import (
    backward_step,
    check_first_val_step,
    deallocate_output_tensor,
    forward_step,
)
from megatron_dpp.pipeline import Phase, Task
from megatron_dpp.runtime.batch import GlobalBatch
from megatron_dpp.runtime.grad_sync import GradSync
from megatron_dpp.runtime.layout import RankLayout


class IterationView(Protocol):
    """What a handler reads and writes of the iteration it runs in (IterationRunner provides it)."""

    M: int  # microbatches in the global batch
    V: int  # model chunks on this rank
    models: List[torch.nn.Module]
    config: Any  # Megatron's model config
    model_type: Any
    layout: RankLayout
    batch: GlobalBatch
    forward_step_func: Callable
    forward_only: bool
    collect_non_loss_data: bool
    first_val_step: Optional[bool]
    grad_sync: GradSync
    saved: Dict[Tuple[int, int], tuple]  # (microbatch, chunk) -> (input, output) until backward
    outputs_by_microbatch: Dict[int, list]
    total_num_tokens: torch.Tensor

    def is_last_virtual_stage(self, chunk: int) -> bool: ...

    def take_input(self, task: Task) -> Optional[torch.Tensor]: ...

    def send(self, task: Task, tensor: Optional[torch.Tensor]) -> None: ...


class ForwardHandler:
    """F(m, c): run the chunk's forward on its input (data on the first stage), send the output on,
    and keep input and output until the backward."""

    def __init__(self, runner: IterationView):
        self.runner = runner
        self.ran_on_chunk = [False] * runner.V  # Megatron's is_first_microbatch, per chunk

    def run(self, task: Task) -> None:
        runner = self.runner
        m, c = task.microbatch, task.chunk
        input_tensor = runner.take_input(task)
        if input_tensor is not None:
            input_tensor.requires_grad_(True)
        store: list = []
        output_tensor, num_tokens = self._forward(task, input_tensor, store)
        self.ran_on_chunk[c] = True
        runner.outputs_by_microbatch.setdefault(m, []).extend(store)
        runner.total_num_tokens += num_tokens
        runner.send(task, output_tensor)
        if not runner.forward_only:
            # `send` took its own (detached) reference to the output for the transport, so the
            # activation's data can go now, as in Megatron; its grad_fn stays for the backward.
            deallocate_output_tensor(output_tensor, runner.config.deallocate_pipeline_outputs)
            runner.saved[(m, c)] = (input_tensor, output_tensor)

    def _forward(self, task: Task, input_tensor, store: list):
        """Megatron's forward_step of the task alone (the split backward's F runs it under its
        stash's deferral)."""
        runner = self.runner
        m, c = task.microbatch, task.chunk
        return forward_step(
            runner.forward_step_func,
            runner.batch.feed(c, m),
            runner.models[c],
            runner.M,
            input_tensor,
            store,
            runner.config,
            cp_group_size=runner.layout.cp_size,
            collect_non_loss_data=runner.collect_non_loss_data,
            checkpoint_activations_microbatch=None,
            is_first_microbatch=check_first_val_step(
                runner.first_val_step, runner.forward_only, not self.ran_on_chunk[c]),
            current_microbatch=m,
            vp_stage=c if runner.V > 1 else None,
            is_last_stage=runner.is_last_virtual_stage(c),
        )


class BackwardHandler:
    """B(m, c): backpropagate the output gradient (the loss on the last stage) through the chunk,
    send the input gradient back, and drive the data-parallel gradient sync at each chunk's last
    backward."""

    def __init__(self, runner: IterationView):
        self.runner = runner
        self.backwards_left = [runner.M] * runner.V

    def run(self, task: Task) -> None:
        runner = self.runner
        m, c = task.microbatch, task.chunk
        self.backwards_left[c] -= 1
        is_last_of_chunk = self.backwards_left[c] == 0
        input_tensor, output_tensor = runner.saved.pop((m, c))
        output_tensor_grad = runner.take_input(task)
        runner.grad_sync.before_backward(c, is_last_of_chunk)
        input_tensor_grad = backward_step(input_tensor, output_tensor, output_tensor_grad,
                                          runner.model_type, runner.config)
        runner.grad_sync.after_backward(c, is_last_of_chunk)
        runner.send(task, input_tensor_grad)


def make_handlers(runner: IterationView) -> Dict[Phase, object]:
    """The handler of each task kind the runner executes without a feature: F and B."""
    return {Phase.F: ForwardHandler(runner), Phase.B: BackwardHandler(runner)}
