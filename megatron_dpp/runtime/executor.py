"""forward_backward_dpp: Megatron's forward_backward_func, run by a dynamic pipeline scheduler.

Each pipeline rank posts a tag-matched receive for every message it expects in this iteration, then
loops: take what has arrived (the ReadyTracker applies the one ready rule the simulator also uses),
ask the policy's RankScheduler (the same object the simulator drives) for the next ready task, run it
with the handler of its kind (runtime/handlers.py: Megatron-Core's own forward_step / backward_step),
send its output. When the policy has nothing to run, the rank blocks in the transport's wait_any
until a message arrives; a deadline without progress, or a lost peer, ends the iteration with a
`DPPFailure` carrying the rank's state, which ForwardBackwardDPP prints before exiting the job.

Tensor parallelism: the ranks of a tensor-parallel group must run the same task sequence (their
forward steps share collectives). Rank 0 of the group decides and sends each decision point-to-point
to the others, which follow it (runtime/tensor_parallel.py).

Data parallelism: gradient reduction is held back (Megatron's no_sync_func) until the last backward of
each model chunk, as in Megatron's schedules (runtime/grad_sync.py).

Split backwards (DPPConfig.split_backward, --dpp-split-backward) are the loop's one optional
feature, one object: `IterationRunner.split_backward`, runtime/split_backward.py's SplitBackward
(None without the flag, and in evaluation). Every use goes through it: it adds W tasks and the
stash's bytes to the task graph, puts its F, B and W handlers into the handler table (they reach
the stash only through it), and is told when the iteration ends (its stash must be empty, or is
emptied after a failure); the loop reports its state and memory next to its own, and its record
is IterationRecord.split_backward. Without the flag the loop runs F and B exactly as before.

Activation bytes per microbatch come from the caller too (activation_bytes_fn: training passes the
model's ModelSpec.activation_bytes, the search's analytical model), so the runtime knows no model.
Work and memory are apart: the policy orders by each microbatch's work (microbatch_work: GPT's
counts each document's attention beside its tokens), the budget admits by the activation bytes of
its tokens (microbatch_tokens; without one, the work is the token count).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_model_config, get_model_type

from megatron_dpp.comm.errors import is_peer_lost
from megatron_dpp.exit_codes import LOST_PEER
from megatron_dpp.mcore.schedules import (ForwardBackwardFunc, schedule_epilogue,
                                          schedule_prologue, unsupported_schedule_feature)
from megatron_dpp.pipeline import (Phase, RanTask, ReadyTracker, RunLog, Task, TaskGraph,
                                   make_scheduler)
from megatron_dpp.pipeline.budget import budget_bytes_for, largest_microbatch_bytes
from megatron_dpp.pipeline.placement import Placement, named_placement
from megatron_dpp.runtime.batch import GlobalBatch
from megatron_dpp.runtime.config import DPPConfig
from megatron_dpp.runtime.grad_sync import GradSync
from megatron_dpp.runtime.handlers import make_handlers
from megatron_dpp.runtime.layout import RankLayout
from megatron_dpp.runtime.split_backward import SplitBackward, SplitBackwardRecord, WeightGradBytesFn
from megatron_dpp.runtime.tags import decision_tag, message_tag
from megatron_dpp.runtime.tensor_parallel import DecisionChannel
from megatron_dpp.runtime.watchdog import ProgressDeadline, report_and_exit
from megatron_dpp.trace.recorder import POSTING_SEND, TraceRecorder

# (model_config, token counts, micro_batch_size, num_model_chunks, pipeline_size) -> bytes one
# forward of each microbatch keeps on one chunk until its backward (ModelSpec.activation_bytes)
ActivationBytesFn = Callable[[Any, Sequence[int], int, int, int], List[int]]
# One microbatch item, as the data iterator yields it -> its relative work (ModelSpec.microbatch_work
# bound to the model's config), or its tokens (ModelSpec.microbatch_tokens)
MicrobatchWorkFn = Callable[[Any], int]


class DPPFailure(RuntimeError):
    """The iteration cannot go on (no progress before the deadline, a lost peer, a scheduler bug).
    `state_lines` describe the rank: tasks run and ready, awaited tags, memory held."""

    def __init__(self, reason: str, state_lines: List[str], lost_peer: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.state_lines = state_lines
        self.lost_peer = lost_peer  # the transport said a peer is gone (exit code LOST_PEER)

    def __str__(self) -> str:
        return "\n".join([self.reason, *self.state_lines])


@dataclass
class IterationRecord:
    """What one call did on this rank: for benchmarks and tests."""

    microbatch_order: List[int]
    sizes: List[int]  # each microbatch's work (the task graph's sizes)
    tokens: List[int] = field(default_factory=list)  # each microbatch's tokens (its act_bytes')
    policy: str = ""
    # How the policy ran when that is not its usual way (RankScheduler.strategy), else None.
    strategy: Optional[str] = None
    # What ran, in order, with its times: the rank scheduler's RunLog, the one record the trace
    # reads too. Times are time.perf_counter() (one clock for all processes of a machine, so
    # ranks' timelines line up); a task's turn_seconds (harvest arrivals, decide, run, send) less
    # its step is what it costs beyond its own compute.
    log: RunLog = field(default_factory=RunLog)
    peak_held_bytes: int = 0
    budget_bytes: int = 0
    # With split backwards, what the stash held (estimated and measured bytes), else None.
    split_backward: Optional[SplitBackwardRecord] = None

    @property
    def ran(self) -> List[RanTask]:
        return self.log.entries

    # Views of `log` by field, in the order the tasks ran.
    @property
    def tasks(self) -> List[Task]:
        return self.log.tasks

    @property
    def task_started(self) -> List[float]:
        return [entry.started for entry in self.log.entries]

    @property
    def task_ended(self) -> List[float]:
        return [entry.ended for entry in self.log.entries]

    @property
    def task_seconds(self) -> List[float]:
        return [entry.turn_seconds for entry in self.log.entries]


@dataclass
class PendingReceive:
    """A receive posted for one task's input: the transport's handle and where it comes from."""

    handle: Any
    peer: int
    tag: int


@dataclass
class DPPSession:
    """State that lives across iterations: the transport, the tag iteration counter, the last record."""

    config: DPPConfig
    transport: Any
    microbatch_work: MicrobatchWorkFn
    activation_bytes_fn: ActivationBytesFn
    # What activation_bytes_fn counts; None: the work is the token count (microbatch_work's).
    microbatch_tokens: Optional[MicrobatchWorkFn] = None
    recorder: Optional[TraceRecorder] = None  # --trace: what each iteration did, per rank
    nvtx: bool = False  # --nvtx: an NVTX range named like the task around each task's step
    # Split backwards (DPPConfig.split_backward): the model side, given by the caller
    # (training/pipeline.py: models.weight_grad's megatron_weight_grad_bytes and a
    # WeightGradStash): the stash's bytes per microbatch, and the rank's stash (the model chunks'
    # deferred layers store into it). Each iteration's SplitBackward (runtime/split_backward.py,
    # IterationRunner.split_backward) is made from them and is the only user of them.
    weight_grad_bytes_fn: Optional[WeightGradBytesFn] = None
    stash: Any = None
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


def make_forward_backward_dpp(config: DPPConfig, transport: Any, microbatch_work: MicrobatchWorkFn,
                              activation_bytes_fn: ActivationBytesFn,
                              recorder: Optional[TraceRecorder] = None, nvtx: bool = False,
                              stash: Any = None,
                              weight_grad_bytes_fn: Optional[WeightGradBytesFn] = None,
                              trace: Any = None,
                              microbatch_tokens: Optional[MicrobatchWorkFn] = None
                              ) -> "ForwardBackwardDPP":
    """Megatron's forward_backward_func bound to a new DPP session (ForwardBackwardDPP).
    With a recorder, every iteration's tasks, waits, messages and memory go into it; `trace` is
    what close() writes first (training/tracing.py's RunTrace, whose recorder that is). With
    config.split_backward, `stash` and `weight_grad_bytes_fn` are the model side of the split
    (DPPSession), which runtime/split_backward.py's SplitBackward drives. `microbatch_tokens`: each
    microbatch's tokens, what activation_bytes_fn counts (None: microbatch_work is the tokens)."""
    session = DPPSession(config=config, transport=transport, microbatch_work=microbatch_work,
                         activation_bytes_fn=activation_bytes_fn,
                         microbatch_tokens=microbatch_tokens, recorder=recorder, nvtx=nvtx,
                         stash=stash, weight_grad_bytes_fn=weight_grad_bytes_fn)
    return ForwardBackwardDPP(session, trace=trace)


class ForwardBackwardDPP(ForwardBackwardFunc):
    """forward_backward_dpp bound to one DPP session: called with Megatron's forward_backward_func
    keywords (mcore/schedules.py's ForwardBackwardFunc), it runs one global batch under the
    session's policy; `close()` writes the trace, then closes the session's transport (collective:
    training.pipeline.close_forward_backward)."""

    def __init__(self, session: DPPSession, trace: Any = None):
        super().__init__(session.transport, trace)
        self.session = session

    @property
    def last_record(self) -> Optional[IterationRecord]:
        """What the last call did on this rank (None before the first)."""
        return self.session.last_record

    def run(self, kwargs: Dict[str, Any]):
        """One global batch. Returns the forward data store (losses on the last stage) in
        microbatch order, like Megatron's schedules.

        p2p_communicator is accepted for signature compatibility and not used: DPP sends through
        the session's transport. Shapes travel in the message headers; seq_length only sizes the
        memory budget (the largest microbatch a batch can contain)."""
        session = self.session
        models = kwargs["model"] if isinstance(kwargs["model"], list) else [kwargs["model"]]
        iterators = kwargs["data_iterator"]
        iterators = iterators if isinstance(iterators, list) else [iterators]
        forward_only = kwargs["forward_only"]
        config = get_model_config(models[0])
        pg_collection = kwargs["pg_collection"]
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        layout = RankLayout.from_process_groups(pg_collection.pp, pg_collection.tp,
                                                getattr(pg_collection, "mp", None),
                                                pg_collection.cp.size())
        _check_supported(config, layout.cp_size, kwargs["adjust_tensor_shapes_fn"], len(models),
                         iterators)
        placement = runtime_placement(layout.pp_size, len(models), session.config.placement)
        is_last_pipeline_rank = placement.local_chunk(layout.pp_rank, placement.last_stage) is not None

        embedding_module = schedule_prologue(config, models, forward_only, is_last_pipeline_rank)

        runner = IterationRunner(
            session=session, layout=layout, config=config, models=models, iterators=iterators,
            forward_step_func=kwargs["forward_step_func"],
            num_microbatches=kwargs["num_microbatches"], seq_length=kwargs["seq_length"],
            micro_batch_size=kwargs["micro_batch_size"], forward_only=forward_only,
            collect_non_loss_data=kwargs["collect_non_loss_data"],
            first_val_step=kwargs["first_val_step"],
        )
        try:
            forward_data_store = runner.run()
        except DPPFailure as failure:
            # os._exit inside: interpreter shutdown could block on the very peer that stopped.
            report_and_exit(failure.reason, failure.state_lines,
                            LOST_PEER if failure.lost_peer else session.config.timeout_exit_code)

        schedule_epilogue(config, models, forward_only, is_last_pipeline_rank, embedding_module,
                          runner.total_num_tokens, pg_collection, kwargs["force_all_reduce"])
        return forward_data_store


def forward_backward_dpp(*, dpp_session: DPPSession, **kwargs):
    """Run one global batch under dpp_session's DPP policy: Megatron's forward_backward_func
    keywords (ForwardBackwardFunc.__call__ spells them) plus the session, for a caller that holds
    a session rather than a ForwardBackwardDPP; the same call as ForwardBackwardDPP's."""
    return ForwardBackwardDPP(dpp_session)(**kwargs)


def _check_supported(config, cp_size: int, adjust_tensor_shapes_fn, num_chunks: int, iterators):
    if adjust_tensor_shapes_fn is not None:
        raise ValueError("forward_backward_dpp: adjust_tensor_shapes_fn is not supported "
                         "(DPP takes shapes from the message headers)")
    if cp_size > 1:
        raise ValueError("forward_backward_dpp: context parallelism is not supported; "
                         "use --context-parallel-size 1 or drop --use-dpp")
    if config.num_microbatches_with_partial_activation_checkpoints is not None:
        raise ValueError("forward_backward_dpp: partial activation checkpointing per microbatch "
                         "(num_microbatches_with_partial_activation_checkpoints) is not supported")
    if len(iterators) != num_chunks:
        raise ValueError(f"forward_backward_dpp: {num_chunks} model chunks but {len(iterators)} "
                         "data iterators (pass one per chunk, as for Megatron's interleaved schedule)")
    unsupported = unsupported_schedule_feature(config)
    if unsupported is not None:
        raise ValueError(f"forward_backward_dpp: {unsupported}")


class IterationRunner:
    """One global batch on one rank: the loop around the policy, the ready rule and the handlers.

    Needs no process group (RankLayout says where the rank sits), so it also runs in one process
    against an in-memory transport (tests/_runtime_harness.py)."""

    def __init__(self, *, session: DPPSession, layout: RankLayout, config, models, iterators,
                 forward_step_func, num_microbatches: int, seq_length: int, micro_batch_size: int,
                 forward_only: bool = False, collect_non_loss_data: bool = False,
                 first_val_step=None):
        self.session = session
        self.transport = session.transport
        self.dpp = session.config
        self.layout = layout
        self.config = config
        self.models = models
        self.forward_step_func = forward_step_func
        self.M = num_microbatches
        self.V = len(models)
        self.P = layout.pp_size
        self.rank = layout.pp_rank
        self.placement = runtime_placement(self.P, self.V, self.dpp.placement)
        self.forward_only = forward_only
        self.collect_non_loss_data = collect_non_loss_data
        self.first_val_step = first_val_step
        self.model_type = get_model_type(models[0])
        self.iteration = session.next_iteration()
        self.batch = GlobalBatch(iterators, num_microbatches)
        self.deadline = ProgressDeadline(self.dpp.timeout_s)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=device)
        # One agreement for both: each microbatch's work (the policy's sizes) and its tokens
        # (what its activation bytes count).
        agreed = layout.agree_sizes(self._local_sizes(), 2 * self.M)
        sizes, tokens = agreed[:self.M], agreed[self.M:]
        # Budgets are provisioned for the largest microbatch any batch can hold (a full sequence),
        # as Megatron's fixed schedules must be, not for the largest of this batch.
        largest_size = seq_length * micro_batch_size
        # The one optional feature: split backwards, in training only (None otherwise), reached
        # by this one name. The loop uses it through the task graph, the handler table, and the
        # hooks `end_iteration`, `state_lines` and `memory_counters`.
        self.split_backward = SplitBackward.for_iteration(session, models, config, forward_only,
                                                   tokens, largest_size)

        act_bytes = session.activation_bytes_fn(config, tokens, micro_batch_size, self.V, self.P)
        # The same computation as the flag check's minimum budget (runtime/flags.py).
        largest_possible = largest_microbatch_bytes(session.activation_bytes_fn, config, seq_length,
                                                    micro_batch_size, self.V, self.P)
        graph_options = {}
        if self.split_backward is not None:
            # What the feature keeps per microbatch counts against the budget like activations.
            act_bytes = [a + b for a, b in zip(act_bytes, self.split_backward.held_bytes)]
            largest_possible += self.split_backward.largest_held_bytes
            graph_options = self.split_backward.graph_options
        self.graph = TaskGraph(self.P, self.V, self.M, sizes, act_bytes,
                               max_act_bytes=max(largest_possible, max(act_bytes)),
                               placement=self.placement, **graph_options)
        self.channel = DecisionChannel(self.transport, layout.tp_ranks, layout.global_rank,
                                       partial(decision_tag, self.iteration))
        options = {}
        if self.V > 1:
            # --microbatch-group-size-per-virtual-pipeline-stage: interleaved-1f1b's order, and
            # for every policy the Megatron count the 'auto'/'provisioned' budgets hold (and
            # dpp:adaptive's spine).
            options["microbatch_group_size_per_vp_stage"] = getattr(
                config, "microbatch_group_size_per_vp_stage", None)
        if self.dpp.schedule is not None and not forward_only:  # --dpp-schedule's row
            self.scheduler = self.dpp.schedule.scheduler(
                self.graph, self.rank,
                budget_bytes_for(self.dpp.memory_budget_bytes, self.graph, self.rank))
        else:
            self.scheduler = make_scheduler(self.dpp.policy, self.graph, self.rank,
                                            budget_bytes=self.dpp.memory_budget_bytes, **options)
        self.record = IterationRecord(microbatch_order=list(self.scheduler.microbatch_order),
                                      sizes=sizes, tokens=tokens, policy=self.scheduler.name,
                                      strategy=self.scheduler.strategy,
                                      budget_bytes=self.scheduler.budget_bytes,
                                      log=self.scheduler.log,
                                      split_backward=(None if self.split_backward is None
                                                      else self.split_backward.record))
        self.order_position = {m: i for i, m in enumerate(self.scheduler.microbatch_order)}

        self.tracker = ReadyTracker(self.graph, self.rank, forward_only=forward_only)
        self.tasks = [t for t in self.graph.tasks(self.rank)
                      if not (forward_only and t.phase is not Phase.F)]
        self.receives: Dict[Task, PendingReceive] = {}  # posted and not arrived yet
        self.arrived: Dict[Task, torch.Tensor] = {}
        # What has run: the scheduler's RunLog (every rank writes it, see _execute).
        self.log = self.scheduler.log
        self.pending_sends: List[Any] = []
        self.outgoing: Optional[tuple] = None  # (task, output) handed to `send`, posted after the task
        self.saved: Dict[tuple, tuple] = {}  # (microbatch, chunk) -> (input, output) until backward
        self.outputs_by_microbatch: Dict[int, list] = {}
        self.grad_sync = GradSync(config, models, forward_only,
                                  launch_order=self.placement.chunks_deepest_first(self.rank))
        self.handlers = make_handlers(self)
        if self.split_backward is not None:
            self.split_backward.register_handlers(self, self.handlers)
        self.recorder = session.recorder

    # ---- setup ------------------------------------------------------------------------------
    def _local_sizes(self) -> Optional[List[int]]:
        """From the ranks that read data (the first and the last virtual stage): each microbatch's
        work, then each one's tokens (2M values)."""
        work = self.session.microbatch_work
        tokens = self.session.microbatch_tokens or work
        for stage in (self.placement.first_stage, self.placement.last_stage):
            chunk = self.placement.local_chunk(self.rank, stage)
            if chunk is not None and self.batch.has_source(chunk):
                items = self.batch.items(chunk)
                return [work(item) for item in items] + [tokens(item) for item in items]
        return None

    def _post_receives(self):
        for task in self.tasks:
            source = self.graph.input_source(self.rank, task)
            if source is None or source[0] == self.rank:  # none, or handed over on this rank
                continue
            peer = self.layout.pp_ranks[source[0]]
            tag = message_tag(self.iteration, source[1])
            self.receives[task] = PendingReceive(self.transport.irecv(peer, tag), peer, tag)

    # ---- main loop ----------------------------------------------------------------------------
    def run(self) -> list:
        if self.split_backward is None:
            return self._run()
        try:
            store = self._run()
        except BaseException:
            self.split_backward.end_iteration(failed=True)
            raise
        self.split_backward.end_iteration(failed=False)
        return store

    def _run(self) -> list:
        self.grad_sync.disable()
        if self.config.param_sync_func is not None and not self.forward_only:
            param_sync = self.config.param_sync_func
            for chunk in range(self.V):
                (param_sync[chunk] if isinstance(param_sync, list) else param_sync)(
                    self.models[chunk].parameters())
        self._post_receives()
        if self.recorder is not None:
            self.recorder.iteration_starts(self.iteration, time.perf_counter(),
                                           {"forward_only": self.forward_only,
                                            "policy": self.scheduler.name})
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
        while self.log.finished < len(self.tasks):
            turn_start = time.perf_counter()
            self._collect_arrivals()
            self._reap_sends()
            task = self._choose()
            if task is None:
                reason = self._wait_reason() if self.recorder is not None else None
                waited_from = time.perf_counter()
                self._wait_for_arrival()
                if reason is not None:
                    self.recorder.wait(waited_from, time.perf_counter(), reason)
                continue
            self.channel.publish(task)
            self._execute(task, turn_start)

    def _follow(self):
        while self.log.finished < len(self.tasks):
            handle = self.channel.expect_next()
            waited_from = time.perf_counter()
            decision = self._wait(handle, f"decision #{self.channel.sequence} from tensor-parallel "
                                          f"rank {self.channel.leader}")
            if self.recorder is not None:
                self.recorder.wait(waited_from, time.perf_counter(),
                                   f"the decision of tensor-parallel rank {self.channel.leader}")
            task = self.channel.decode(decision)
            if task not in self.tracker.ready:
                self._await_input(task)
            self._execute(task, time.perf_counter())

    def _choose(self) -> Optional[Task]:
        ready = self.tracker.ready
        if self.forward_only:
            # No activations are kept, so no budget: the earliest ready forward in the agreed order.
            if not ready:
                return None
            return min(ready, key=lambda t: (self.order_position[t.microbatch], t.chunk))
        # The live set, not a copy per decision: schedulers only read it during the call.
        return self.scheduler.next_task(ready)

    # ---- arrivals and waiting ------------------------------------------------------------------
    def _mark_arrived(self, task: Task, tensor: torch.Tensor):
        receive = self.receives.pop(task)
        if self.recorder is not None:
            self.recorder.message(f"recv {task}", time.perf_counter(),
                                  {"peer": receive.peer, "tag": receive.tag,
                                   "bytes": _nbytes(tensor)})
        self.arrived[task] = tensor
        self.tracker.input_arrived(task)
        self.deadline.progressed()

    def _collect_arrivals(self):
        """Every input that has arrived: one transport call for all outstanding receives (all of
        an iteration's are posted at its start, so a test() of each would grow with M), and one
        more per arrival."""
        while self.receives:
            tasks = list(self.receives)
            index = self._test_any([self.receives[task].handle for task in tasks], "an input")
            if index < 0:
                return
            self._mark_arrived(tasks[index], self.receives[tasks[index]].handle.wait())

    def _test_any(self, handles: list, what: str) -> int:
        """transport.test_any(handles): the index of a completed one, or -1; a transport error (a
        lost peer, whose handles fail) ends the iteration with the rank's state."""
        try:
            return self.transport.test_any(handles)
        except RuntimeError as error:
            self._fail(f"transport error while waiting for {what}: {error}", is_peer_lost(error))

    def _wait_for_arrival(self):
        if not self.receives:
            self._fail("the policy chose no task and no message is outstanding (scheduler bug)")
        tasks = list(self.receives)
        handles = [self.receives[t].handle for t in tasks]
        while True:
            index = self._wait_any(handles, "a message to arrive")
            if index is not None:
                self._mark_arrived(tasks[index], handles[index].wait())
                return
            if self.deadline.expired():
                self._fail(f"no progress for {self.dpp.timeout_s:g} s")

    def _await_input(self, task: Task):
        receive = self.receives.get(task)
        if receive is None:
            self._fail(f"told to run {task} whose input is neither here nor expected")
        self._mark_arrived(task, self._wait(receive.handle, f"input of {task} (tag "
                                                            f"{(receive.peer, receive.tag)})"))

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
        died) ends the iteration with the rank's state, like a timeout does.
        """
        slice_s = max(0.001, min(self.deadline.remaining(), 1.0))
        try:
            index = self.transport.wait_any(handles, slice_s)
        except TimeoutError:
            return None
        except RuntimeError as error:
            self._fail(f"transport error while waiting for {what}: {error}", is_peer_lost(error))
        return index if index is not None and index >= 0 else None

    # ---- running tasks ------------------------------------------------------------------------
    def _execute(self, task: Task, turn_start: float):
        self.tracker.start(task)
        # The leader of a training iteration tells the scheduler (its memory accounting), which
        # logs the task; a follower or an evaluation pass only logs it.
        accounts_memory = self.channel.is_leader and not self.forward_only
        if accounts_memory:
            self.scheduler.on_start(task)
            self.record.peak_held_bytes = max(self.record.peak_held_bytes, self.scheduler.held_bytes)
        else:
            self.log.start(task)
        ran = self.log.last
        ran.started = time.perf_counter()
        if self.session.nvtx:
            torch.cuda.nvtx.range_push(str(task))
        # On a GPU with --trace: events on the compute stream around the task's compute alone.
        device_start = None if self.recorder is None else self.recorder.task_starts()
        self.handlers[task.phase].run(task)
        device_span = None if self.recorder is None else self.recorder.task_ends(device_start)
        if self.session.nvtx:
            torch.cuda.nvtx.range_pop()
        ran.ended = time.perf_counter()
        self._post_output()
        self.tracker.finish(task)
        if accounts_memory:
            self.scheduler.on_finish(task)
            self.record.peak_held_bytes = max(self.record.peak_held_bytes, self.scheduler.held_bytes)
        else:
            self.log.finish(task)
        if self.recorder is not None:
            self._record_task(ran, accounts_memory, device_span)
        ran.turn_seconds = time.perf_counter() - turn_start
        self.deadline.progressed()

    # ---- what handlers call -------------------------------------------------------------------
    def is_last_virtual_stage(self, chunk: int) -> bool:
        return self.placement.stage(self.rank, chunk) == self.placement.last_stage

    def take_input(self, task: Task) -> Optional[torch.Tensor]:
        """The message `task` reads (None where it reads data or the loss), handed over once."""
        return self.arrived.pop(task, None)

    def send(self, task: Task, tensor: Optional[torch.Tensor]) -> None:
        """Hand over `task`'s output for the stage that reads it, if any (the ends of the pipeline
        send nothing). It is posted as soon as the task returns (_post_output), so the task's
        recorded span is its compute alone, as Megatron's compute timers measure theirs."""
        if self.graph.output_target(self.rank, task) is None:
            return
        # Detached now: the forward handler frees the output's data next (deallocate_output_tensor
        # gives the output a new storage; the detached tensor keeps the computed one).
        self.outgoing = (task, tensor.detach())

    def _post_output(self) -> None:
        """isend the output the task just run handed to `send`. Posting can take long (up to tens
        of ms with shm_tensor on a loaded machine), so the trace records it as its own wait."""
        if self.outgoing is None:
            return
        task, tensor = self.outgoing
        self.outgoing = None
        target = self.graph.output_target(self.rank, task)
        if target[0] == self.rank:
            self._hand_over(target[1], tensor)
            return
        peer, tag = self.layout.pp_ranks[target[0]], message_tag(self.iteration, task)
        posted = time.perf_counter()  # before isend: the peer may take the message in at once
        self.pending_sends.append(self.transport.isend(tensor, peer, tag))
        if self.recorder is not None:
            self.recorder.message(f"send {task}", posted,
                                  {"peer": peer, "tag": tag, "bytes": _nbytes(tensor)})
            self.recorder.wait(posted, time.perf_counter(), f"{POSTING_SEND} {task}")

    def _hand_over(self, task: Task, tensor: torch.Tensor) -> None:
        """The next stage is on this rank (the v placement's turn, stages P-1 and P): the output
        is its input as it is, no transport and no copy. `send` detached it, so the next stage's
        F starts a graph of its own at it (requires_grad on a leaf), as after a receive, and its
        B's input gradient is the previous stage's output gradient. A trace shows no message for
        it: its messages are the transport's."""
        self.arrived[task] = tensor
        self.tracker.input_arrived(task)

    def _reap_sends(self):
        while self.pending_sends:
            index = self._test_any(self.pending_sends, "a send to finish")
            if index < 0:
                return
            self.pending_sends.pop(index)

    def _drain_sends(self):
        self.channel.drain(self._wait)
        for handle in self.pending_sends:
            self._wait(handle, "a send to finish")
        self.pending_sends = []

    # ---- tracing ------------------------------------------------------------------------------
    def _record_task(self, ran: RanTask, with_memory: bool, device_span) -> None:
        task, m = ran.task, ran.task.microbatch
        self.recorder.task(str(task), task.phase.label, ran.started, ran.ended,
                           {"iteration": self.iteration, "microbatch": m, "chunk": task.chunk,
                            "virtual_stage": self.graph.virtual_stage(self.rank, task.chunk),
                            "tokens": int(self.record.tokens[m])}, device_span=device_span)
        if with_memory:
            extra = {} if self.split_backward is None else self.split_backward.memory_counters()
            self.recorder.memory(ran.ended, self.scheduler.held_bytes,
                                 self.scheduler.budget_bytes, **extra)

    def _wait_reason(self) -> str:
        """Why the rank just waited: nothing was ready, or the policy held ready tasks back."""
        ready = self.tracker.ready
        if not ready:
            return "no task ready: waiting for an input"
        return ("the policy held back ready tasks (memory budget or its order): "
                + " ".join(sorted(str(t) for t in ready)[:8]))

    # ---- failure ------------------------------------------------------------------------------
    def _state_lines(self) -> List[str]:
        role = "decides" if self.channel.is_leader else f"follows tensor-parallel rank {self.channel.leader}"
        policy = self.scheduler.name
        if self.scheduler.strategy:
            policy += f" ({self.scheduler.strategy})"
        lines = [
            f"iteration tag {self.iteration}, pipeline rank {self.rank}/{self.P}, V={self.V}, M={self.M}, "
            f"policy {policy}, {role}",
            f"tasks run {self.log.finished}/{len(self.tasks)}; last: "
            + " ".join(str(entry.task) for entry in self.log.entries[-3:]),
            "ready: " + " ".join(sorted(str(t) for t in self.tracker.ready)),
            "awaited (peer, tag) -> task: "
            + ", ".join(f"{(r.peer, r.tag)} -> {t}"
                        for t, r in sorted(self.receives.items(), key=lambda item: str(item[0]))),
            f"sends not finished: {len(self.pending_sends)}",
        ]
        if self.channel.is_leader and not self.forward_only:
            lines.append(f"activation bytes held {self.scheduler.held_bytes} of budget "
                         f"{self.scheduler.budget_bytes}")
        if self.split_backward is not None:
            lines += self.split_backward.state_lines()
        return lines

    def _fail(self, reason: str, lost_peer: bool = False):
        raise DPPFailure(reason, self._state_lines(), lost_peer)


def runtime_placement(P: int, V: int, name: str) -> Placement:
    """The placement the runtime runs (DPPConfig.placement): the models' chunks were built for it
    (models/init.py builds chunk c of rank r as the stage the placement puts there)."""
    return named_placement(name, P, V)


def _nbytes(tensor: Optional[torch.Tensor]) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()
