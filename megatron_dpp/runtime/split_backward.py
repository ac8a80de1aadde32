"""--dpp-split-backward in the executor: one feature object, `SplitBackward`.

Every backward is two tasks: B computes the input gradient and sends it upstream at once, W
computes the weight gradients later, when the policy picks it. The model side (the deferred layers
and their `WeightGradStash`, models.weight_grad) is given by the caller through the session
(`DPPSession.stash`, `DPPSession.weight_grad_bytes_fn`). This module owns everything the executor
does differently for it, so the executor itself has no split-specific code:

- the task graph: W tasks (`graph_options`), and the stash's estimated bytes added to what each
  microbatch holds from F to the end of its W (`held_bytes`, `largest_held_bytes`), which the
  scheduler's budget counts;
- the handler table (`register_handlers`): F forwards under `deferring(task)` (the stash's
  `defer((m, c))`), B stores the weight-gradient work under that key, W runs it
  (`run_weight_grad`) and drives the data-parallel gradient sync. The handlers reach the stash
  only through this object;
- the stash's measured bytes, from B to W (`SplitBackwardRecord`, the trace's `stash` counter);
- the end of the iteration (`end_iteration`): every W ran, so the stash must be empty; a failed
  iteration empties it, so the next one finds no stale work;
- its lines in a failure report (`state_lines`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence

import torch

from megatron_dpp.mcore.schedules import backward_step
from megatron_dpp.pipeline import Phase, Task
from megatron_dpp.runtime.handlers import ForwardHandler, IterationView

# (model chunks of the rank, sizes, pipeline dtype) -> bytes a split backward's stash adds per
# microbatch, held from B to W (models.weight_grad's megatron_weight_grad_bytes)
WeightGradBytesFn = Callable[[Sequence[Any], Sequence[int], torch.dtype], List[int]]


@dataclass
class SplitBackwardRecord:
    """What the stash held in one iteration on one rank (IterationRecord.split_backward)."""

    # Bytes per microbatch the budget counts for the stash (estimated, in the graph's act_bytes).
    weight_grad_bytes_estimated: List[int] = field(default_factory=list)
    # What the stash held for each (microbatch, chunk) right after its B (measured: distinct
    # storages, the layer inputs included), and the largest total at any time.
    weight_grad_bytes_measured: Dict[tuple, int] = field(default_factory=dict)
    peak_stash_bytes: int = 0


class SplitBackward:
    """The split backward of one iteration on one rank: the executor's only optional feature,
    `IterationRunner.split_backward`.

    The executor reads it at setup (`graph_options`, `held_bytes`, `largest_held_bytes`,
    `register_handlers`) and calls it when it records memory (`memory_counters`), at the end of
    the iteration (`end_iteration`) and when it reports its state (`state_lines`); the F, B and W
    handlers it registers do the rest."""

    # TaskGraph keywords: every backward is a B and a W task.
    graph_options = {"split_backward": True}

    def __init__(self, stash: Any, weight_grad_bytes_fn: WeightGradBytesFn,
                 models: Sequence[torch.nn.Module], dtype: torch.dtype, sizes: Sequence[int],
                 largest_size: int):
        self.stash = stash  # models.weight_grad.WeightGradStash: the chunks' layers store into it
        # Estimated stash bytes per microbatch of `sizes`, and of the largest microbatch a batch
        # can hold (the budget's provisioning). They count against the budget from F (the
        # scheduler cannot know B's moment in advance, so it reserves at F) to the end of W, like
        # the activations.
        self.record = SplitBackwardRecord(
            weight_grad_bytes_estimated=weight_grad_bytes_fn(models, sizes, dtype))
        self.largest_held_bytes = weight_grad_bytes_fn(models, [largest_size], dtype)[0]
        self.stash_bytes_held = 0  # measured bytes of the work B stored and W has not run yet

    @classmethod
    def for_iteration(cls, session, models: Sequence[torch.nn.Module], config, forward_only: bool,
                      sizes: Sequence[int], largest_size: int) -> Optional["SplitBackward"]:
        """The feature for one iteration of microbatches of `sizes`, or None: without
        DPPConfig.split_backward, and in evaluation (forward_only keeps no gradients, so there is
        nothing to split)."""
        if not session.config.split_backward or forward_only:
            return None
        if session.stash is None or session.weight_grad_bytes_fn is None:
            raise ValueError("forward_backward_dpp: split_backward needs the session's stash and "
                             "weight_grad_bytes_fn (models.weight_grad's WeightGradStash and "
                             "megatron_weight_grad_bytes; training/pipeline.py passes them)")
        dtype = (getattr(config, "pipeline_dtype", None) or getattr(config, "params_dtype", None)
                 or torch.float32)
        return cls(session.stash, session.weight_grad_bytes_fn, models, dtype, sizes, largest_size)

    # ---- setup --------------------------------------------------------------------------------
    @property
    def held_bytes(self) -> List[int]:
        """Estimated stash bytes per microbatch, added to its activation bytes."""
        return self.record.weight_grad_bytes_estimated

    def register_handlers(self, runner: IterationView, handlers: Dict[Phase, object]) -> None:
        """Put the split's F, B and W handlers into the runner's table. The W handler drives the
        gradient sync (each chunk's last W completes its gradients), so B never releases it."""
        runner.grad_sync.check_split_backward()
        handlers[Phase.F] = DeferringForwardHandler(runner, self)
        handlers[Phase.B] = InputGradHandler(runner, self)
        handlers[Phase.W] = WeightGradHandler(runner, self)

    # ---- the stash, as the handlers use it -----------------------------------------------------
    def deferring(self, task: Task) -> ContextManager:
        """The deferred layers bind the weight-gradient work they make inside to task's
        (microbatch, chunk)."""
        return self.stash.defer((task.microbatch, task.chunk))

    def run_weight_grad(self, task: Task) -> None:
        """Run the weight-gradient work B(task) stored (W(task)); what it held is free again."""
        self.stash.run((task.microbatch, task.chunk))
        self.work_ran(task)

    # ---- the stash's bytes, measured ----------------------------------------------------------
    def work_stored(self, task: Task) -> None:
        """B(task) has stored its weight-gradient work: count what it keeps alive until W."""
        key = (task.microbatch, task.chunk)
        nbytes = self.stash.bytes_held(key)
        self.record.weight_grad_bytes_measured[key] = nbytes
        self.stash_bytes_held += nbytes
        self.record.peak_stash_bytes = max(self.record.peak_stash_bytes, self.stash_bytes_held)

    def work_ran(self, task: Task) -> None:
        """W(task) has run its work: what B stored is free again."""
        self.stash_bytes_held -= self.record.weight_grad_bytes_measured.get(
            (task.microbatch, task.chunk), 0)

    def memory_counters(self) -> Dict[str, int]:
        """Keywords for TraceRecorder.memory: the stash's bytes next to the scheduler's held."""
        return {"stash_bytes": self.stash_bytes_held}

    # ---- end of the iteration and failure ------------------------------------------------------
    def end_iteration(self, failed: bool) -> None:
        """After a complete iteration every W ran, so nothing may be left in the stash (raises
        otherwise). A failed iteration, or one that left work behind, leaves the stash empty so
        the next iteration does not find stale work."""
        if failed:
            self.stash.discard()
            return
        try:
            self.stash.check_drained()
        except BaseException:
            self.stash.discard()
            raise

    def state_lines(self) -> List[str]:
        """What the stash holds, for a failure report."""
        keys = sorted(self.stash.keys(), key=str)[:16]
        return [f"weight-gradient stash: {self.stash_bytes_held} bytes, keys "
                + " ".join(f"{m}.{c}" for m, c in keys)]


class DeferringForwardHandler(ForwardHandler):
    """F(m, c) of a split backward: Megatron's forward step under `split.deferring(task)`, so the
    chunk's deferred layers bind their weight-gradient work to (m, c)."""

    def __init__(self, runner: IterationView, split: SplitBackward):
        super().__init__(runner)
        self.split = split

    def _forward(self, task: Task, input_tensor, store: list):
        with self.split.deferring(task):
            return super()._forward(task, input_tensor, store)


class InputGradHandler:
    """B(m, c) of a split backward: the input gradient only, sent upstream at once. The deferred
    layers store the weight-gradient work under (m, c); its data-parallel sync moves to W. The
    backward runs under `split.deferring(task)` too, so a recomputed forward (activation
    checkpointing) defers into the same key."""

    def __init__(self, runner: IterationView, split: SplitBackward):
        self.runner = runner
        self.split = split

    def run(self, task: Task) -> None:
        runner = self.runner
        m, c = task.microbatch, task.chunk
        input_tensor, output_tensor = runner.saved.pop((m, c))
        output_tensor_grad = runner.take_input(task)
        with self.split.deferring(task):  # no_sync is on: GradSync follows the W tasks
            input_tensor_grad = backward_step(input_tensor, output_tensor, output_tensor_grad,
                                              runner.model_type, runner.config)
        runner.send(task, input_tensor_grad)
        self.split.work_stored(task)


class WeightGradHandler:
    """W(m, c): the weight gradients B(m, c) stored, into .grad / DDP's main_grad (the hooks run
    here). Drives the data-parallel gradient sync at each chunk's last W."""

    def __init__(self, runner: IterationView, split: SplitBackward):
        self.runner = runner
        self.split = split
        self.weight_grads_left = [runner.M] * runner.V

    def run(self, task: Task) -> None:
        runner = self.runner
        c = task.chunk
        self.weight_grads_left[c] -= 1
        is_last_of_chunk = self.weight_grads_left[c] == 0
        runner.grad_sync.before_weight_grad(c, is_last_of_chunk)
        self.split.run_weight_grad(task)
        runner.grad_sync.after_weight_grad(c, is_last_of_chunk)
