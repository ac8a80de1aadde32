"""forward_backward_dpp: Megatron's forward_backward_func, run by a dynamic pipeline scheduler.

Each pipeline rank posts a tag-matched receive for every message it expects in this iteration, then
loops: take what has arrived, ask the RankScheduler (the same object the simulator drives) for the next
ready task, run it with Megatron-Core's own forward_step / backward_step, send its output. When the
policy has nothing to run, the rank blocks in the transport's wait_any until a message arrives; a
deadline without progress reports the rank's state and ends the job.

Tensor parallelism: the ranks of a tensor-parallel group must run the same task sequence (their
forward steps share collectives). Rank 0 of the group decides and sends each decision point-to-point
to the others, which follow it.

Data parallelism: gradient reduction is held back (Megatron's no_sync_func) until the last backward of
each model chunk, as in Megatron's schedules. The chunks of a rank always finish their backwards in the
order V-1, ..., 0 (backward of virtual stage s depends on that of s+1), so every data-parallel replica
launches its reductions in the same order whatever its dynamic schedule was.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import (
    backward_step,
    check_first_val_step,
    clear_embedding_activation_buffer,
    deallocate_output_tensor,
    finish_embedding_wgrad_compute,
    forward_step,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_model_config, get_model_type

from megatron_dpp.schedule import Phase, Task, TaskGraph, make_scheduler
from megatron_dpp.schedule.dpp_batch import GlobalBatch, agree_on_sizes, microbatch_work
from megatron_dpp.schedule.dpp_config import DPPConfig
from megatron_dpp.schedule.dpp_memory import megatron_activation_bytes
from megatron_dpp.schedule.dpp_tags import decision_tag, message_tag
from megatron_dpp.schedule.dpp_tp import DecisionChannel
from megatron_dpp.schedule.dpp_watchdog import ProgressDeadline, report_and_exit

# (model_config, sizes, micro_batch_size, num_model_chunks, pipeline_size) -> bytes per microbatch
ActivationBytesFn = Callable[[Any, Sequence[int], int, int, int], List[int]]


@dataclass
class IterationRecord:
    """What one call did on this rank: for benchmarks and tests."""

    microbatch_order: List[int]
    sizes: List[int]
    tasks: List[Task] = field(default_factory=list)
    # Wall seconds of the loop turn that ran each task (harvest arrivals, decide, run, send), in the
    # order of `tasks`: what a task costs beyond its own compute is measured from these.
    task_seconds: List[float] = field(default_factory=list)
    # time.perf_counter() when each task's step began (after the decision) and ended (its output
    # posted): one clock for all processes of a machine, so ranks' timelines line up.
    task_started: List[float] = field(default_factory=list)
    task_ended: List[float] = field(default_factory=list)
    peak_held_bytes: int = 0
    budget_bytes: int = 0


@dataclass
class DPPSession:
    """State that lives across iterations: the transport, the tag iteration counter, the last record."""

    config: DPPConfig
    transport: Any
    activation_bytes_fn: ActivationBytesFn = megatron_activation_bytes
    iteration: int = 0
    last_record: Optional[IterationRecord] = None

    def next_iteration(self) -> int:
        value = self.iteration
        self.iteration += 1
        return value


def dpp_peers() -> List[int]:
    """Global ranks this rank exchanges DPP messages with: its pipeline neighbours (activations and
    gradients) and its tensor-parallel group (decisions). Call after parallel_state is initialized."""
    from megatron_dpp.comm import pipeline_neighbors

    me = dist.get_rank()
    tp_ranks = dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group())
    return sorted((set(pipeline_neighbors()) | set(tp_ranks)) - {me})


def make_forward_backward_dpp(config: DPPConfig, transport: Any,
                              activation_bytes_fn: ActivationBytesFn = megatron_activation_bytes):
    """A callable with Megatron's forward_backward_func keyword signature, bound to one DPP session."""
    session = DPPSession(config=config, transport=transport, activation_bytes_fn=activation_bytes_fn)
    fn = partial(forward_backward_dpp, dpp_session=session)
    fn.dpp_session = session
    fn.close = transport.close  # training.pipeline.close_forward_backward calls it (collective)
    return fn


@dataclass
class _Groups:
    pp: dist.ProcessGroup
    tp: dist.ProcessGroup
    cp: dist.ProcessGroup
    mp: Optional[dist.ProcessGroup]
    collection: ProcessGroupCollection


def _resolve_groups(pg_collection: Optional[ProcessGroupCollection]) -> _Groups:
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    return _Groups(
        pp=pg_collection.pp,
        tp=pg_collection.tp,
        cp=pg_collection.cp,
        mp=getattr(pg_collection, "mp", None),
        collection=pg_collection,
    )


class _GradSync:
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


def _check_supported(config, groups: _Groups, adjust_tensor_shapes_fn, num_chunks: int, iterators):
    if adjust_tensor_shapes_fn is not None:
        raise ValueError("forward_backward_dpp: adjust_tensor_shapes_fn is not supported "
                         "(DPP takes shapes from the message headers)")
    if groups.cp.size() > 1:
        raise ValueError("forward_backward_dpp: context parallelism is not supported; "
                         "use --context-parallel-size 1 or drop --use-dpp")
    if config.num_microbatches_with_partial_activation_checkpoints is not None:
        raise ValueError("forward_backward_dpp: partial activation checkpointing per microbatch "
                         "(num_microbatches_with_partial_activation_checkpoints) is not supported")
    if len(iterators) != num_chunks:
        raise ValueError(f"forward_backward_dpp: {num_chunks} model chunks but {len(iterators)} "
                         "data iterators (pass one per chunk, as for Megatron's interleaved schedule)")


def forward_backward_dpp(
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
    dpp_session: DPPSession,
):
    """Run one global batch under the session's DPP policy. Returns the forward data store (losses on
    the last stage) in microbatch order, like Megatron's schedules.

    p2p_communicator is accepted for signature compatibility and not used: DPP sends through
    dpp_session.transport. Shapes travel in the message headers; seq_length only sizes the memory
    budget (the largest microbatch a batch can contain).
    """
    del p2p_communicator, decoder_seq_length
    models = model if isinstance(model, list) else [model]
    iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
    config = get_model_config(models[0])
    groups = _resolve_groups(pg_collection)
    _check_supported(config, groups, adjust_tensor_shapes_fn, len(models), iterators)

    runner = _IterationRunner(
        session=dpp_session, config=config, models=models, iterators=iterators, groups=groups,
        forward_step_func=forward_step_func, num_microbatches=num_microbatches,
        seq_length=seq_length, micro_batch_size=micro_batch_size, forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
    )

    if config.timers is not None:
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
    embedding_module = None
    if config.finalize_model_grads_func is not None and not forward_only:
        embedding_module = clear_embedding_activation_buffer(config, models, runner.rank == runner.P - 1)

    forward_data_store = runner.run()

    if config.finalize_model_grads_func is not None and not forward_only:
        finish_embedding_wgrad_compute(config, embedding_module, runner.rank == runner.P - 1, groups.tp)
        config.finalize_model_grads_func(
            models,
            runner.total_num_tokens if config.calculate_per_token_loss else None,
            pg_collection=groups.collection,
            force_all_reduce=force_all_reduce,
        )
    if config.timers is not None:
        config.timers("forward-backward").stop()
    return forward_data_store


class _IterationRunner:
    """One call of forward_backward_dpp on one rank."""

    def __init__(self, *, session: DPPSession, config, models, iterators, groups: _Groups,
                 forward_step_func, num_microbatches: int, seq_length: int, micro_batch_size: int,
                 forward_only: bool, collect_non_loss_data: bool, first_val_step):
        self.session = session
        self.transport = session.transport
        self.dpp = session.config
        self.config = config
        self.models = models
        self.groups = groups
        self.forward_step_func = forward_step_func
        self.M = num_microbatches
        self.V = len(models)
        self.P = groups.pp.size()
        self.rank = groups.pp.rank()
        self.pp_ranks = dist.get_process_group_ranks(groups.pp)
        self.forward_only = forward_only
        self.collect_non_loss_data = collect_non_loss_data
        self.first_val_step = first_val_step
        self.model_type = get_model_type(models[0])
        self.iteration = session.next_iteration()
        self.batch = GlobalBatch(iterators, num_microbatches)
        self.deadline = ProgressDeadline(self.dpp.timeout_s)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=device)

        sizes = agree_on_sizes(self._local_sizes(), self.M,
                               [groups.mp] if groups.mp is not None else [groups.pp, groups.tp])
        act_bytes = session.activation_bytes_fn(config, sizes, micro_batch_size, self.V, self.P)
        # Budgets are provisioned for the largest microbatch any batch can hold (a full sequence),
        # as Megatron's fixed schedules must be, not for the largest of this batch.
        largest_possible = session.activation_bytes_fn(
            config, [seq_length * micro_batch_size], micro_batch_size, self.V, self.P)[0]
        self.graph = TaskGraph(self.P, self.V, self.M, sizes, act_bytes,
                               max_act_bytes=max(largest_possible, max(act_bytes)))
        self.channel = DecisionChannel(self.transport, dist.get_process_group_ranks(groups.tp),
                                       dist.get_rank(), partial(decision_tag, self.iteration))
        options = {}
        if self.dpp.policy == "interleaved-1f1b":
            options["microbatch_group_size_per_vp_stage"] = config.microbatch_group_size_per_vp_stage
        self.scheduler = make_scheduler(self.dpp.policy, self.graph, self.rank,
                                        budget_bytes=self.dpp.memory_budget_bytes, **options)
        self.record = IterationRecord(microbatch_order=list(self.scheduler.microbatch_order), sizes=sizes,
                                      budget_bytes=self.scheduler.budget_bytes)
        self.order_position = {m: i for i, m in enumerate(self.scheduler.microbatch_order)}

        self.tasks = [t for t in self.graph.tasks(self.rank)
                      if not (forward_only and t.phase is Phase.B)]
        self.backwards_left = [self.M] * self.V
        self.ran_forward_on_chunk = [False] * self.V
        self.pending_recvs: Dict[Task, Any] = {}
        self.pending_recv_tags: Dict[Task, tuple] = {}
        self.arrived: Dict[Task, torch.Tensor] = {}
        self.ran: set = set()
        self.ready: set = set()
        self.pending_sends: List[Any] = []
        self.saved: Dict[tuple, tuple] = {}  # (microbatch, chunk) -> (input, output) until backward
        self.outputs_by_microbatch: Dict[int, list] = {}
        self.grad_sync = _GradSync(config, models, forward_only)

    # ---- setup ------------------------------------------------------------------------------
    def _local_sizes(self) -> Optional[List[int]]:
        """Sizes from the ranks that read data: the first and the last virtual stage."""
        if self.rank == 0 and self.batch.has_source(0):
            return [microbatch_work(item) for item in self.batch.items(0)]
        if self.rank == self.P - 1 and self.batch.has_source(self.V - 1):
            return [microbatch_work(item) for item in self.batch.items(self.V - 1)]
        return None

    def _post_receives(self):
        for task in self.tasks:
            source = self.graph.input_source(self.rank, task)
            if source is None:
                if task.phase is Phase.F:
                    self.ready.add(task)
                continue
            peer = self.pp_ranks[source[0]]
            tag = message_tag(self.iteration, source[1])
            self.pending_recvs[task] = self.transport.irecv(peer, tag)
            self.pending_recv_tags[task] = (peer, tag)

    # ---- main loop ----------------------------------------------------------------------------
    def run(self) -> list:
        self.grad_sync.disable()
        if self.config.param_sync_func is not None and not self.forward_only:
            param_sync = self.config.param_sync_func
            for chunk in range(self.V):
                (param_sync[chunk] if isinstance(param_sync, list) else param_sync)(
                    self.models[chunk].parameters())
        self._post_receives()
        if self.channel.is_leader:
            self._lead()
        else:
            self._follow()
        self._drain_sends()
        if not self.forward_only:
            self.grad_sync.finish()
        else:
            self.grad_sync.enable()
        self.session.last_record = self.record
        return [item for m in range(self.M) for item in self.outputs_by_microbatch.get(m, [])]

    def _lead(self):
        while len(self.ran) < len(self.tasks):
            turn_start = time.perf_counter()
            self._collect_arrivals()
            self._reap_sends()
            task = self._choose()
            if task is None:
                self._wait_for_arrival()
                continue
            self.channel.publish(task)
            self._execute(task, turn_start)

    def _follow(self):
        while len(self.ran) < len(self.tasks):
            handle = self.channel.expect_next()
            decision = self._wait(handle, f"decision #{self.channel.sequence} from tensor-parallel "
                                          f"rank {self.channel.leader}")
            task = self.channel.decode(decision)
            if task not in self.ready:
                self._await_input(task)
            self._execute(task, time.perf_counter())

    def _choose(self) -> Optional[Task]:
        if self.forward_only:
            # No activations are kept, so no budget: the earliest ready forward in the agreed order.
            if not self.ready:
                return None
            return min(self.ready, key=lambda t: (self.order_position[t.microbatch], t.chunk))
        # The live set, not a copy per decision: schedulers only read it during the call.
        return self.scheduler.next_task(self.ready)

    # ---- arrivals and waiting ------------------------------------------------------------------
    def _mark_arrived(self, task: Task, tensor: torch.Tensor):
        del self.pending_recvs[task]
        del self.pending_recv_tags[task]
        self.arrived[task] = tensor
        if task.phase is Phase.F or Task(Phase.F, task.microbatch, task.chunk) in self.ran:
            self.ready.add(task)
        self.deadline.progressed()

    def _collect_arrivals(self):
        for task, handle in list(self.pending_recvs.items()):
            if handle.test():
                self._mark_arrived(task, handle.wait())

    def _wait_for_arrival(self):
        if not self.pending_recvs:
            self._fail("the policy chose no task and no message is outstanding (scheduler bug)")
        tasks = list(self.pending_recvs)
        handles = [self.pending_recvs[t] for t in tasks]
        while True:
            index = self._wait_any(handles, "a message to arrive")
            if index is not None:
                self._mark_arrived(tasks[index], handles[index].wait())
                return
            if self.deadline.expired():
                self._fail(f"no progress for {self.dpp.timeout_s:g} s")

    def _await_input(self, task: Task):
        handle = self.pending_recvs.get(task)
        if handle is None:
            self._fail(f"told to run {task} whose input is neither here nor expected")
        self._mark_arrived(task, self._wait(handle, f"input of {task} (tag {self.pending_recv_tags[task]})"))

    def _wait(self, handle, what: str) -> torch.Tensor:
        while True:
            index = self._wait_any([handle], what)
            if index is not None:
                return handle.wait()
            if self.deadline.expired():
                self._fail(f"no progress for {self.dpp.timeout_s:g} s while waiting for {what}")

    def _wait_any(self, handles: list, what: str) -> Optional[int]:
        """Index of a completed handle, or None when this wait slice passed without one.

        Slices are bounded so an expired deadline is noticed; a transport error (a peer process
        died) ends the rank with its state report like a timeout does.
        """
        slice_s = max(0.001, min(self.deadline.remaining(), 1.0))
        try:
            index = self.transport.wait_any(handles, slice_s)
        except TimeoutError:
            return None
        except RuntimeError as error:
            self._fail(f"transport error while waiting for {what}: {error}")
        return index if index is not None and index >= 0 else None

    # ---- running tasks ------------------------------------------------------------------------
    def _execute(self, task: Task, turn_start: float):
        self.ready.discard(task)
        if self.channel.is_leader and not self.forward_only:
            self.scheduler.on_start(task)
            self.record.peak_held_bytes = max(self.record.peak_held_bytes, self.scheduler.held_bytes)
        self.record.task_started.append(time.perf_counter())
        if task.phase is Phase.F:
            self._run_forward(task)
        else:
            self._run_backward(task)
        self.record.task_ended.append(time.perf_counter())
        if self.channel.is_leader and not self.forward_only:
            self.scheduler.on_finish(task)
            self.record.peak_held_bytes = max(self.record.peak_held_bytes, self.scheduler.held_bytes)
        self.ran.add(task)
        self.record.tasks.append(task)
        self.record.task_seconds.append(time.perf_counter() - turn_start)
        self.deadline.progressed()

    def _is_last_virtual_stage(self, chunk: int) -> bool:
        return self.rank == self.P - 1 and chunk == self.V - 1

    def _run_forward(self, task: Task):
        m, c = task.microbatch, task.chunk
        input_tensor = self.arrived.pop(task, None)
        if input_tensor is not None:
            input_tensor.requires_grad_(True)
        store: list = []
        is_last = self._is_last_virtual_stage(c)
        output_tensor, num_tokens = forward_step(
            self.forward_step_func,
            self.batch.feed(c, m),
            self.models[c],
            self.M,
            input_tensor,
            store,
            self.config,
            cp_group_size=self.groups.cp.size(),
            collect_non_loss_data=self.collect_non_loss_data,
            checkpoint_activations_microbatch=None,
            is_first_microbatch=check_first_val_step(
                self.first_val_step, self.forward_only, not self.ran_forward_on_chunk[c]),
            current_microbatch=m,
            vp_stage=c if self.V > 1 else None,
            is_last_stage=is_last,
        )
        self.ran_forward_on_chunk[c] = True
        self.outputs_by_microbatch.setdefault(m, []).extend(store)
        self.total_num_tokens += num_tokens
        backward = Task(Phase.B, m, c)
        target = self.graph.output_target(self.rank, task)
        if target is not None:
            self._send(output_tensor, task, target)
        if not self.forward_only:
            # The transport holds the sent data through its own (detached) reference, so the
            # activation's data can go now, as in Megatron; its grad_fn stays for the backward.
            deallocate_output_tensor(output_tensor, self.config.deallocate_pipeline_outputs)
            self.saved[(m, c)] = (input_tensor, output_tensor)
            if self.graph.input_source(self.rank, backward) is None or backward in self.arrived:
                self.ready.add(backward)

    def _run_backward(self, task: Task):
        m, c = task.microbatch, task.chunk
        self.backwards_left[c] -= 1
        is_last_of_chunk = self.backwards_left[c] == 0
        input_tensor, output_tensor = self.saved.pop((m, c))
        output_tensor_grad = self.arrived.pop(task, None)
        self.grad_sync.before_backward(c, is_last_of_chunk)
        input_tensor_grad = backward_step(input_tensor, output_tensor, output_tensor_grad,
                                          self.model_type, self.config)
        self.grad_sync.after_backward(c, is_last_of_chunk)
        target = self.graph.output_target(self.rank, task)
        if target is not None:
            self._send(input_tensor_grad, task, target)

    def _send(self, tensor: torch.Tensor, task: Task, target):
        handle = self.transport.isend(tensor.detach(), self.pp_ranks[target[0]],
                                      message_tag(self.iteration, task))
        self.pending_sends.append(handle)

    def _reap_sends(self):
        self.pending_sends = [handle for handle in self.pending_sends if not handle.test()]

    def _drain_sends(self):
        self.channel.drain(self._wait)
        for handle in self.pending_sends:
            self._wait(handle, "a send to finish")
        self.pending_sends = []

    # ---- failure ------------------------------------------------------------------------------
    def _state_lines(self) -> List[str]:
        role = "decides" if self.channel.is_leader else f"follows tensor-parallel rank {self.channel.leader}"
        lines = [
            f"iteration tag {self.iteration}, pipeline rank {self.rank}/{self.P}, V={self.V}, M={self.M}, "
            f"policy {self.dpp.policy}, {role}",
            f"tasks run {len(self.ran)}/{len(self.tasks)}; last: {self.record.tasks[-3:]}",
            f"ready: {sorted(self.ready, key=str)}",
            f"awaited (peer, tag) -> task: "
            + ", ".join(f"{self.pending_recv_tags[t]} -> {t}" for t in sorted(self.pending_recvs, key=str)),
            f"sends not finished: {len(self.pending_sends)}",
        ]
        if self.channel.is_leader and not self.forward_only:
            lines.append(f"activation bytes held {self.scheduler.held_bytes} of budget "
                         f"{self.scheduler.budget_bytes}")
        return lines

    def _fail(self, reason: str):
        report_and_exit(reason, self._state_lines(), self.dpp.timeout_exit_code)
