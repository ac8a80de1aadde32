"""--trace and --nvtx for Megatron-Core's own schedules (1F1B, interleaved 1F1B), recorded like the
DPP runtime: the same recorder, task names, args, lanes and wait reasons, so the two sides of a
comparison are recorded by the same code; with --nvtx, an NVTX range named like the task around
each forward and backward step, as the DPP runtime pushes around its tasks.

How the schedule is hooked (no Megatron function is wrapped, patched or copied):
- Steps. Megatron's forward_step and backward_step start and stop the timers 'forward-compute' and
  'backward-compute' on `config.timers`, TransformerConfig's public timing hook, around exactly the
  model's forward (with the loss) and its backward. While a traced schedule runs, config.timers is a
  HookedTimers (training/observe/timer_hooks.py) that turns those two into task spans and passes every
  timer call on to the timers it stands in for, if any. Wrapping forward_step_func alone would miss the backward, which
  Megatron runs from inside its schedule.
- Which task a step is. Megatron's interleaved schedule runs its forwards in the order of its
  schedule table (get_schedule_table: the (microbatch, chunk) of each virtual microbatch) and its
  backwards in the same order with the chunks reversed (its get_model_chunk_id(forward=False)); 1F1B
  is the one-chunk case, microbatches 0, 1, 2, ... So the k-th forward of an iteration is table[k]
  and the k-th backward is table[k] with chunk V-1-c; `MegatronTaskOrder` holds both lists.
- Messages and waits. TransportP2PCommunicator reports each send, receive and blocking wait
  (comm/megatron_p2p.py's P2PObserver). Megatron pairs messages in program order, so the k-th send
  of a direction posted in an iteration carries the output of the k-th task of that direction that
  sends one, and the k-th receive posted is the input of the k-th task that reads one (TaskGraph says
  which do, as for the DPP runtime). A receive is named when posted: the overlapped interleaved
  schedule may take it in later.
- Device time. On a GPU the recorder's DeviceClock (trace/device_clock.py) brackets each step's
  compute with CUDA events, so its span is device time, as for the DPP runtime's tasks.
- Tokens. Each chunk's data iterator is wrapped to note the tokens (ModelSpec.microbatch_tokens) of
  each item drawn: the forward of microbatch m on chunk c draws that chunk's m-th item. A stage whose
  forward step reads no data records no tokens.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
from megatron.core.pipeline_parallel.schedules import get_schedule_table

from megatron_dpp.comm.tags import Direction
from megatron_dpp.pipeline import Phase, Task, TaskGraph
from megatron_dpp.trace.recorder import POSTING_SEND, TraceRecorder
from megatron_dpp.training.observe.timer_hooks import HookedTimers

# Megatron's timer names around its forward_step and backward_step.
STEP_TIMERS = {"forward-compute": Phase.F, "backward-compute": Phase.B}
PHASE_OF_DIRECTION = {Direction.FORWARD: Phase.F, Direction.BACKWARD: Phase.B}


class MegatronTaskOrder:
    """The tasks of one iteration on one pipeline rank in the order Megatron's schedule runs them:
    `tasks[kind][phase]` for kind "steps" (every task), "sends" (those that send their output) and
    "reads" (those that receive their input)."""

    def __init__(self, graph: TaskGraph, rank: int, group_size: Optional[int]):
        if graph.V == 1:
            table = [(m, 0) for m in range(graph.M)]
        else:
            table = get_schedule_table(graph.M, graph.V, group_size)
        # Megatron's backwards visit its k-th forward's chunks in reverse stage order (its
        # get_model_chunk_id(forward=False)): the c-th chunk deepest first.
        deepest_first = graph.placement.chunks_deepest_first(rank)
        steps = {Phase.F: [Task(Phase.F, m, c) for m, c in table],
                 Phase.B: [Task(Phase.B, m, deepest_first[c]) for m, c in table]}
        self.tasks = {
            "steps": steps,
            "sends": {phase: [t for t in tasks if graph.output_target(rank, t) is not None]
                      for phase, tasks in steps.items()},
            "reads": {phase: [t for t in tasks if graph.input_source(rank, t) is not None]
                      for phase, tasks in steps.items()},
        }


class _WorkCountingIterator:
    """A chunk's data iterator that notes the work of every item drawn, in order."""

    def __init__(self, source: Iterator, work: Callable[[Any], int]):
        self._source, self._work = source, work
        self.works: List[int] = []

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self._source)
        self.works.append(int(self._work(item)))
        return item


class MegatronScheduleTracer:
    """Fills a TraceRecorder (--trace) and pushes NVTX ranges (--nvtx) from one rank's Megatron
    schedule; one instance for the run, `run` once per forward_backward call (an iteration, as the
    DPP runtime counts them). Its message hooks (the P2PObserver part) need the recorder."""

    def __init__(self, recorder: Optional[TraceRecorder], pipeline_rank: int, pipeline_size: int,
                 microbatch_work: Callable[[Any], int], policy: str, nvtx: bool = False):
        self.recorder = recorder
        self.nvtx = nvtx
        self.rank, self.P = pipeline_rank, pipeline_size
        self.microbatch_work = microbatch_work
        self.policy = policy
        self.iteration = -1
        self.graph: Optional[TaskGraph] = None
        self.upcoming: Dict[tuple, Iterator[Task]] = {}  # (kind, phase) -> the rest of the order
        self.expected: Dict[tuple, Task] = {}  # (peer, tag) of a posted receive -> its reader
        self.iterators: List[Optional[_WorkCountingIterator]] = []
        self.step_started: Dict[Phase, tuple] = {}  # phase -> (task, start time, device start)

    def run(self, schedule: Callable, config, kwargs: Dict[str, Any]) -> Any:
        """schedule(**kwargs) with this rank's steps, messages and waits recorded."""
        model = kwargs["model"]
        num_chunks = len(model) if isinstance(model, list) else 1
        self._begin(kwargs["num_microbatches"], num_chunks, config.microbatch_group_size_per_vp_stage,
                    bool(kwargs.get("forward_only", False)))
        kwargs = dict(kwargs, data_iterator=self._wrap_iterators(kwargs["data_iterator"]))
        replaced = config.timers
        config.timers = HookedTimers(STEP_TIMERS, lambda name: self.started(STEP_TIMERS[name]),
                                     lambda name: self.finished(STEP_TIMERS[name]), replaced)
        try:
            return schedule(**kwargs)
        finally:
            config.timers = replaced

    def _begin(self, num_microbatches: int, num_chunks: int, group_size: Optional[int],
               forward_only: bool) -> None:
        self.iteration += 1
        self.graph = TaskGraph(self.P, num_chunks, num_microbatches)
        order = MegatronTaskOrder(self.graph, self.rank, group_size)
        self.upcoming = {(kind, phase): iter(tasks) for kind, by_phase in order.tasks.items()
                         for phase, tasks in by_phase.items()}
        self.step_started = {}
        if self.recorder is not None:
            self.recorder.iteration_starts(self.iteration, time.perf_counter(),
                                           {"forward_only": forward_only, "policy": self.policy})

    def _wrap_iterators(self, data_iterator):
        sources = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        self.iterators = [None if source is None else _WorkCountingIterator(source, self.microbatch_work)
                          for source in sources]
        return self.iterators if isinstance(data_iterator, list) else self.iterators[0]

    def _next(self, kind: str, phase: Phase) -> Task:
        """The task of this rank's next step, send or read (`kind`) of `phase`."""
        task = next(self.upcoming[(kind, phase)], None)
        if task is None:
            raise RuntimeError(f"--trace/--nvtx: Megatron's schedule ran more {phase.label} {kind} than its "
                               f"schedule table has in iteration {self.iteration}; the traced task "
                               "order does not match this Megatron-Core version")
        return task

    def _tokens(self, task: Task) -> Optional[int]:
        source = self.iterators[task.chunk] if task.chunk < len(self.iterators) else None
        if source is None or task.microbatch >= len(source.works):
            return None
        return source.works[task.microbatch]

    # ---- the step timers (HookedTimers) ----------------------------------------------------------
    def started(self, phase: Phase) -> None:
        task = self._next("steps", phase)  # the k-th step of a phase started is its k-th task
        if self.nvtx:
            torch.cuda.nvtx.range_push(str(task))
        # On a GPU with --trace: an event on the compute stream where the step starts.
        device_start = None if self.recorder is None else self.recorder.task_starts()
        self.step_started[phase] = (task, time.perf_counter(), device_start)

    def finished(self, phase: Phase) -> None:
        ended = time.perf_counter()
        if self.nvtx:
            torch.cuda.nvtx.range_pop()
        task, started, device_start = self.step_started.pop(phase)
        if self.recorder is None:
            return
        device_span = self.recorder.task_ends(device_start)
        args = {"iteration": self.iteration, "microbatch": task.microbatch, "chunk": task.chunk,
                "virtual_stage": self.graph.virtual_stage(self.rank, task.chunk)}
        tokens = self._tokens(task)
        if tokens is not None:
            args["tokens"] = tokens
        self.recorder.task(str(task), phase.label, started, ended, args, device_span=device_span)

    # ---- P2PObserver (comm/megatron_p2p.py) ------------------------------------------------------
    def sent(self, direction: Direction, peer: int, tag: int, nbytes: int, posted: float) -> None:
        task = self._next("sends", PHASE_OF_DIRECTION[direction])
        self.recorder.message(f"send {task}", posted, {"peer": peer, "tag": tag, "bytes": nbytes})
        # Called as the isend returns: its time is a wait of the same reason as the DPP runtime's.
        self.recorder.wait(posted, time.perf_counter(), f"{POSTING_SEND} {task}")

    def expecting(self, direction: Direction, peer: int, tag: int) -> None:
        self.expected[(peer, tag)] = self._next("reads", PHASE_OF_DIRECTION[direction])

    def received(self, peer: int, tag: int, nbytes: int, taken: float) -> None:
        task = self.expected.pop((peer, tag))
        self.recorder.message(f"recv {task}", taken, {"peer": peer, "tag": tag, "bytes": nbytes})

    def waited(self, started: float, ended: float, reason: str) -> None:
        self.recorder.wait(started, ended, reason)

