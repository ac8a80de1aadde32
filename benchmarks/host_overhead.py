"""Host-side work of one training iteration: our pp=1 GPT step against the plain-PyTorch anchor.

On a GPU every aten op costs the host some 5-15 us (dispatch and launch) and every host-device
synchronization stops the host from running ahead of the GPU; a step whose host work exceeds its
GPU work leaves the GPU waiting. This benchmark counts that work on the CPU, where it can be
counted op by op:

- ours: megatron_dpp's training iteration at pp=1 (training/step.py's Trainer.train_step over
  Megatron-Core's schedule, the optimizer step, the loss read when the loop logs, the stop
  agreement), built from the same flags as `megatron_dpp.pretrain_gpt`, SDPA core attention;
- anchor: benchmarks/gpu_speed_anchor.py's model and step (forward and backward per micro-batch,
  fused AdamW), same shape.

For each, over --iterations measured iterations (after --warmup), it reports:
- device ops per micro-batch (forward, backward) and per optimizer step, and the rest of the
  iteration: aten ops on tensors that live on the training device (view ops, which launch no
  kernel, counted apart); the anchor's forward/backward/optimizer likewise;
- host-device synchronization points per iteration, each with its call site: ops that would wait
  for the GPU on CUDA: `.item()` / `float()` / `bool()` of a device tensor (aten::_local_scalar_dense),
  aten::nonzero, aten::equal, .tolist() / .numpy() / .cpu() of a device tensor, torch.tensor() of
  device tensors (one per element), and torch.tensor(..., device=the device) (a blocking copy);
- host milliseconds per iteration and per part (no counting active; on the CPU this includes the
  arithmetic, which the default tiny width keeps small).

"Device" tensors are those the code would put on the GPU. Host tensors, whose ops and reads cost no
synchronization, are what the data iterator yields until `.to(device)`, RNG states
(torch.get_rng_state), torch.optim's per-parameter `step` counters (CPU tensors unless fused or
capturable), tensors made by torch.tensor() without a device, and whatever is computed from host
tensors alone. The CUDA choices that differ from the CPU's are emulated: torch.optim's Adam runs
fused (our choice on a GPU, kernels.torch_fused_adam), and the stop agreement is built as on a
GPU (training/loop.py's stop_signals). Not emulated: Megatron-Core's compiled fusions (bias-gelu,
bias-dropout-add: torch.compile on a GPU, eager here unless --compiled-fusions) and SDPA's kernels
(one op on a GPU, the math path here, for ours and the anchor alike).

    python benchmarks/host_overhead.py                      # GPT-125m depth, tiny width
    python benchmarks/host_overhead.py --quick --json runs/host.json
    python benchmarks/host_overhead.py --target ours --compare-linears 30   # direct linears A/B
    python benchmarks/host_overhead.py --target ours --compare-layers 30    # direct layer A/B
    python benchmarks/host_overhead.py --target ours --compare-rng-fork 30  # dropout fork A/B
    python benchmarks/host_overhead.py --target ours --compare-layer-calls 30  # layer calls A/B
    python benchmarks/host_overhead.py --target ours --compare-fused-adam 30   # fused AdamW A/B
    python benchmarks/host_overhead.py --target ours --compiled-fusions     # fusions' host cost
Run it on two versions of the code to compare them (before/after a change).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import sys
import time
import traceback
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

DEFAULT = dict(layers=12, hidden=64, heads=4, seq_length=32, micro_batch_size=2, micro_batches=4,
               warmup=2, iterations=3, timed_iterations=5)
QUICK = dict(layers=2, hidden=32, heads=2, seq_length=16, micro_batch_size=1, micro_batches=2,
             warmup=1, iterations=2, timed_iterations=2)

# aten ops that wait for the device on CUDA, whatever calls them.
SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::equal", "aten::masked_select",
            "aten::_unique2", "aten::unique_consecutive", "aten::unique_dim"}
# Tensor methods that copy a device tensor to the host (checked in a TorchFunctionMode, since on
# the CPU they dispatch nothing).
SYNC_METHODS = {"tolist", "numpy", "cpu"}


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, not {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Default shape: GPT-125m's depth (12 layers) at a tiny width, so that host work "
               "dominates the CPU's time; --quick: a 2-layer model for tests.")
    shape = parser.add_argument_group("shape (default: 12 layers, hidden 64; --quick: tiny)")
    shape.add_argument("--layers", type=int, help=f"transformer layers ({DEFAULT['layers']})")
    shape.add_argument("--hidden", type=int, help=f"hidden size ({DEFAULT['hidden']})")
    shape.add_argument("--heads", type=int, help=f"attention heads ({DEFAULT['heads']})")
    shape.add_argument("--seq-length", type=int,
                       help=f"tokens per sample ({DEFAULT['seq_length']})")
    shape.add_argument("--micro-batch-size", type=int,
                       help=f"samples per micro-batch ({DEFAULT['micro_batch_size']})")
    shape.add_argument("--micro-batches", type=int,
                       help=f"micro-batches per iteration ({DEFAULT['micro_batches']})")
    run = parser.add_argument_group("what to run")
    run.add_argument("--target", choices=("both", "ours", "anchor"), default="both",
                     help="our GPT iteration, the anchor's step, or both (default)")
    run.add_argument("--warmup", type=int,
                     help=f"iterations before counting ({DEFAULT['warmup']})")
    run.add_argument("--iterations", type=int,
                     help=f"counted iterations; ours logs (reads its losses) on the last one "
                          f"({DEFAULT['iterations']})")
    run.add_argument("--timed-iterations", type=int,
                     help=f"iterations timed without counting, median reported "
                          f"({DEFAULT['timed_iterations']})")
    run.add_argument("--compare-linears", type=_non_negative, default=0, metavar="ROUNDS",
                     help="also time our iteration with our direct linear layers "
                          "(megatron_dpp.mcore.direct_linear) against Megatron-Core's own "
                          "forward, alternating in one process for ROUNDS rounds (order "
                          "swapped every round); reports the per-round ratio (0: off)")
    run.add_argument("--compare-layers", type=_non_negative, default=0, metavar="ROUNDS",
                     help="the same with our direct transformer layer "
                          "(megatron_dpp.mcore.direct_layer) against Megatron-Core's "
                          "TransformerLayer forward (0: off)")
    run.add_argument("--compare-rng-fork", type=_non_negative, default=0, metavar="ROUNDS",
                     help="the same with core attention's dropout RNG fork "
                          "(megatron_dpp.mcore.rng) against Megatron-Core's tracker fork; "
                          "on the CPU Megatron's fork also filters a warning a GPU never logs, so "
                          "the CPU overstates the saving (0: off)")
    run.add_argument("--compare-bias-in-products", type=_non_negative, default=0,
                     metavar="ROUNDS",
                     help="the same with the direct layer's linears adding their bias in the "
                          "GEMM (torch.nn.functional.linear) against a product and a separate "
                          "addition, as Megatron-Core's linear function computes them (0: off)")
    run.add_argument("--compare-layer-calls", type=_non_negative, default=0, metavar="ROUNDS",
                     help="the same with the direct layer's shortened calls (nn.Module's __call__ "
                          "without Megatron's CUDA-graph checks, no IdentityOp q/k norm calls, "
                          "bias-dropout-add without its closures and grad handler) against "
                          "Megatron's calls (0: off)")
    run.add_argument("--compare-fused-adam", type=_non_negative, default=0, metavar="ROUNDS",
                     help="the same with torch's fused AdamW (mcore/optimizer.py set_torch_adam_implementation, our choice "
                          "on a GPU) against torch's foreach AdamW, its default on a GPU (0: off)")
    run.add_argument("--compiled-fusions", action="store_true",
                     help="ours with Megatron-Core's bias-gelu and bias-dropout-add fusions on, as "
                          "on a GPU: here torch.compile builds them for inductor's C++ backend, so "
                          "the timing shows what calling the compiled code costs the host (compare "
                          "with a run without the flag)")
    run.add_argument("--sites", type=int, default=12,
                     help="call-site frames kept per synchronization point (12)")
    run.add_argument("--quick", action="store_true",
                     help="a 2-layer model, 2 micro-batches, fewer iterations (tests)")
    run.add_argument("--json", type=str, default=None, help="write the results here")
    return parser


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    base = QUICK if args.quick else DEFAULT
    for name, value in base.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


# ----------------------------------------------------------------------------------------------
# counting
# ----------------------------------------------------------------------------------------------
def _site(limit: int) -> str:
    frames = [f for f in traceback.extract_stack()[:-3]
              if "torch/utils/_python_dispatch" not in f.filename
              and "torch/overrides" not in f.filename and f.filename != __file__]
    frames = frames[-limit:]
    return " < ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in reversed(frames))


class Counter:
    """Counts device ops by phase and synchronization points by call site (see the docstring)."""

    def __init__(self, site_frames: int):
        import torch
        from torch.utils.weak import WeakIdKeyDictionary

        self.torch = torch
        self.host = WeakIdKeyDictionary()  # tensors known to live on the host
        self.host_depth = 0
        self.phase = "other"
        self.ops = collections.Counter()     # (phase, kind) -> count; kind: compute/view/comm
        self.op_names = collections.Counter()  # (phase, op name)
        self.syncs = collections.Counter()   # (what, site)
        self.site_frames = site_frames
        self.device_request = 0  # >0 inside a Megatron-Core factory call that asked for "cuda"
        self.device_objects: list = []  # torch.device objects that stand for the GPU

    def names_device(self, device) -> bool:
        """Whether a factory's device= names the training device (not a literal "cpu")."""
        return self.device_request > 0 or any(device is d for d in self.device_objects)

    # --- regions and marks
    @contextlib.contextmanager
    def in_phase(self, phase: str):
        old, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = old

    @contextlib.contextmanager
    def host_region(self):
        self.host_depth += 1
        try:
            yield
        finally:
            self.host_depth -= 1

    def mark_host(self, value) -> None:
        for tensor in _tensors(value, self.torch):
            self.host[tensor] = True

    def is_host(self, tensor) -> bool:
        return tensor in self.host

    def record_sync(self, what: str, count: int = 1) -> None:
        self.syncs[(what, _site(self.site_frames))] += count

    def current_phase(self) -> str:
        if self.phase == "schedule":
            backward = self.torch._C._current_graph_task_id() != -1
            return "backward" if backward else "forward"
        return self.phase

    # --- modes
    def modes(self):
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        torch = self.torch

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                inputs = _tensors((args, kwargs), torch)
                name = func._schema.name
                if counter.host_depth > 0 or (inputs and all(counter.is_host(t) for t in inputs)):
                    counter.mark_host(out)  # host work: no launch, no synchronization
                    return out
                phase = counter.current_phase()
                if name.startswith("c10d::"):
                    kind = "comm"
                elif func.is_view or name in ("aten::detach", "aten::_unsafe_view", "aten::alias"):
                    kind = "view"
                else:
                    kind = "compute"
                counter.ops[(phase, kind)] += 1
                counter.op_names[(phase, name)] += 1
                if name in SYNC_OPS:
                    counter.record_sync(name)
                return out

        class Function(TorchFunctionMode):
            def __torch_function__(self, func, types_, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = getattr(func, "__name__", "")
                if name in SYNC_METHODS and args and isinstance(args[0], torch.Tensor) \
                        and counter.host_depth == 0 and not counter.is_host(args[0]):
                    counter.record_sync(f"Tensor.{name}")
                on_device = False
                if func is torch.tensor and counter.host_depth == 0:
                    device_elements = [t for t in _tensors(args[:1], torch)
                                       if not counter.is_host(t)]
                    if device_elements:  # each element read back to the host
                        counter.record_sync("torch.tensor(device tensors)", len(device_elements))
                    on_device = counter.names_device(kwargs.get("device"))
                    if on_device:
                        counter.record_sync("torch.tensor(..., device=device) (blocking copy)")
                out = func(*args, **kwargs)
                if func is torch.tensor and not on_device:
                    counter.mark_host(out)
                if name == "to" and args and isinstance(args[0], torch.Tensor) \
                        and out is args[0] and counter.is_host(args[0]) \
                        and counter.host_depth == 0:
                    del counter.host[args[0]]  # host -> device (a no-op on the CPU)
                return out

        return Function(), Dispatch()


def _tensors(value, torch) -> list:
    found = []

    def visit(item):
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            for element in item:
                visit(element)
        elif isinstance(item, dict):
            for element in item.values():
                visit(element)

    visit(value)
    return found


class _HostIterator:
    """Wraps a data iterator: what it yields is host data (the loader's CPU tensors)."""

    def __init__(self, iterator, counter: Counter | None):
        self.iterator, self.counter = iterator, counter

    def __iter__(self):
        return self

    def __next__(self):
        if self.counter is None:
            return next(self.iterator)
        with self.counter.host_region():
            item = next(self.iterator)
        self.counter.mark_host(item)
        return item


@contextlib.contextmanager
def _counting(counter: Counter):
    """The modes, with torch.get_rng_state's result a host tensor (on CUDA too)."""
    import torch

    original = torch.get_rng_state

    def get_rng_state():
        with counter.host_region():
            state = original()
        counter.mark_host(state)
        return state

    # On the CPU, megatron_dpp.mcore.cpu_patches gives Megatron-Core's modules a `torch` stand-in whose
    # factories turn device="cuda" into "cpu": such a call asks for the device.
    stand_in = getattr(sys.modules.get("megatron_dpp.mcore.cpu_patches"), "_CPU_TORCH", None)
    saved = {}
    if stand_in is not None:
        from megatron_dpp.mcore.cpu_patches import _is_cuda_device

        saved = {name: stand_in.__dict__.get(name) for name in ("get_rng_state", "tensor")}
        factory = getattr(stand_in, "tensor")

        def tensor(*args, **kwargs):
            asks_device = _is_cuda_device(kwargs.get("device"))
            counter.device_request += asks_device
            try:
                return factory(*args, **kwargs)
            finally:
                counter.device_request -= asks_device

        stand_in.get_rng_state = get_rng_state
        stand_in.tensor = tensor
    torch.get_rng_state = get_rng_state
    function_mode, dispatch_mode = counter.modes()
    try:
        with function_mode, dispatch_mode:
            yield
    finally:
        torch.get_rng_state = original
        for name, value in saved.items():
            if value is None:
                stand_in.__dict__.pop(name, None)
            else:
                setattr(stand_in, name, value)


def _summary(counter: Counter, iterations: int, micro_batches: int) -> dict:
    by_phase = collections.defaultdict(lambda: collections.Counter())
    for (phase, kind), count in counter.ops.items():
        by_phase[phase][kind] += count

    def per(phase: str, divisor: int) -> dict:
        counts = by_phase.get(phase, collections.Counter())
        return {kind: counts[kind] / divisor for kind in ("compute", "view", "comm")}

    forward = per("forward", iterations * micro_batches)
    backward = per("backward", iterations * micro_batches)
    per_micro_batch = {kind: forward[kind] + backward[kind] for kind in forward}
    sites = sorted(((count, what, site) for (what, site), count in counter.syncs.items()),
                   reverse=True)
    total_syncs = sum(count for count, _w, _s in sites)
    top_ops = collections.Counter()
    for (phase, name), count in counter.op_names.items():
        if phase in ("forward", "backward"):
            top_ops[name] += count
    return {
        "ops_per_micro_batch": per_micro_batch,
        "ops_per_micro_batch_forward": forward,
        "ops_per_micro_batch_backward": backward,
        "ops_per_optimizer_step": per("optimizer", iterations),
        "ops_per_iteration_other": per("other", iterations),
        "device_ops_per_iteration": sum(counter.ops.values()) / iterations,
        "syncs_per_iteration": total_syncs / iterations,
        "syncs_total": total_syncs,
        "sync_sites": [{"count": count, "what": what, "site": site}
                       for count, what, site in sites],
        "top_micro_batch_ops": {name: count / (iterations * micro_batches)
                                for name, count in top_ops.most_common(15)},
    }


# ----------------------------------------------------------------------------------------------
# ours
# ----------------------------------------------------------------------------------------------
def _our_argv(args: argparse.Namespace) -> list[str]:
    sys.path.insert(0, str(REPO / "tests"))
    from _train_util import data_args  # the sample data (made once, offline)

    return [
        "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
        "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq_length),
        "--max-position-embeddings", str(args.seq_length),
        "--micro-batch-size", str(args.micro_batch_size),
        "--global-batch-size", str(args.micro_batch_size * args.micro_batches),
        "--train-iters", "100000", "--lr", "6e-4", "--min-lr", "6e-5", "--lr-warmup-iters", "2",
        "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
        "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--seed", "1234",
        "--log-interval", str(args.iterations), "--eval-iters", "0",
        "--attention-backend", "sdpa", *data_args()]


def measure_ours(args: argparse.Namespace) -> dict:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 2000))
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(name, value)
    import torch

    from megatron_dpp.arguments import parse_args
    from megatron_dpp.models import MODEL_SPECS
    from megatron_dpp.data.tokenizer import build_tokenizer
    from megatron_dpp.platform import setup_platform
    from megatron_dpp.training import loop, setup, step
    from megatron_dpp.training.signals import StopSignals

    spec = MODEL_SPECS["gpt"]
    if args.compiled_fusions:
        _force_compiled_fusions()
    train_args = parse_args(_our_argv(args))
    platform = setup_platform(spec.cpu_patched_modules)
    setup.initialize_distributed(train_args, platform)
    try:
        setup.set_seeds(train_args.seed)
        tokenizer = build_tokenizer(train_args)
        train_ds, valid_ds, _ = spec.build_datasets(train_args, tokenizer)
        trainer = step.Trainer(train_args, platform, spec)
        iterators, _ = loop._iterators_per_chunk(train_args, train_ds, valid_ds, 0, 0,
                                                 len(trainer.model))
        # The stop agreement as the loop builds it on a GPU (emulated: the flag is on the
        # training device iff StopSignals got the platform's device).
        emulated = types.SimpleNamespace(device=platform.device, backend="nccl", is_cuda=True)
        make_signals = getattr(loop, "stop_signals", None)
        signals = make_signals(emulated) if make_signals else StopSignals(emulated.device)
        signals_on_host = signals.device is not emulated.device
        counter_box: list[Counter | None] = [None]
        host_iterators = [_HostIterator(it, None) for it in iterators]
        times: dict[str, list[float]] = collections.defaultdict(list)
        _instrument(trainer, counter_box, times)

        def iteration(index: int, log: bool) -> None:
            counter = counter_box[0]
            for wrapped in host_iterators:
                wrapped.counter = counter
            start = time.perf_counter()
            reduced, _grad_norm, _updated = trainer.train_step(host_iterators)
            if log and hasattr(reduced, "read"):  # the loop reads the losses when it logs
                reduced.read()
            region = (counter.host_region() if counter is not None and signals_on_host
                      else contextlib.nullcontext())
            with region:
                signals.agreed_stop()
            times["iteration"].append(time.perf_counter() - start)

        for index in range(args.warmup):
            iteration(index, log=False)
        _emulate_cuda_optimizer(trainer.optimizer)
        for index in range(args.warmup):  # once more with the emulated optimizer settings
            iteration(index, log=False)
        times.clear()
        for index in range(args.timed_iterations):
            iteration(index, log=(index + 1) % args.iterations == 0)
        timing = {name: statistics.median(values) * 1e3 for name, values in times.items()}
        comparisons = {name: _compare(name, trainer, iteration, getattr(args, f"compare_{name}"))
                       for name in COMPARISONS if getattr(args, f"compare_{name}")}
        counter = Counter(args.sites)
        counter.device_objects.append(platform.device)
        counter_box[0] = counter
        _mark_optimizer_steps(trainer.optimizer, counter)
        with _counting(counter):
            for index in range(args.iterations):
                iteration(index, log=index == args.iterations - 1)
        counter_box[0] = None
        result = _summary(counter, args.iterations, args.micro_batches)
        result["host_ms"] = {"iteration": timing.get("iteration"),
                             "forward_backward": timing.get("schedule"),
                             "optimizer_step": timing.get("optimizer")}
        result["optimizer"] = type(_inner_optimizers(trainer.optimizer)[0]).__name__
        from torch._dynamo.utils import counters as dynamo_counters

        result["compiled_frames"] = dynamo_counters["frames"]["ok"]  # torch.compile'd functions
        result.update(comparisons)
        return result
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def _force_compiled_fusions() -> None:
    """The compiled fusions' choice as on a GPU with triton (megatron_dpp.kernels turns them off on
    a CPU); Megatron-Core's jit_fuser then compiles them for the CPU."""
    from megatron_dpp import kernels

    def choice(feature: str, wanted: bool, off_flag: str):
        return kernels.Choice(feature, wanted, "forced on the CPU by host_overhead.py "
                              "--compiled-fusions" if wanted else off_flag)

    kernels._compiled_fusion = choice


def _switch_linears(trainer):
    """The direct linear layers (mcore.direct_linear) against Megatron-Core's forward of the same
    layers: `multiplies_directly` switched off."""
    from megatron_dpp.mcore.direct_linear import DIRECT_CLASSES

    layers = [module for chunk in trainer.model for module in chunk.modules()
              if isinstance(module, tuple(DIRECT_CLASSES.values())) and module.multiplies_directly]

    def switch(direct: bool) -> None:
        for layer in layers:
            layer.multiplies_directly = direct
    return layers, switch


def _switch_layers(trainer):
    """The direct transformer layer (mcore.direct_layer) against Megatron-Core's TransformerLayer
    forward: `runs_directly` switched off."""
    from megatron_dpp.mcore.direct_layer import DirectTransformerLayer

    layers = [module for chunk in trainer.model for module in chunk.modules()
              if isinstance(module, DirectTransformerLayer) and module.runs_directly]

    def switch(direct: bool) -> None:
        for layer in layers:
            layer.runs_directly = direct
    return layers, switch


def _switch_rng_fork(trainer):
    """Core attention's dropout fork (mcore.rng) against Megatron-Core's tracker fork. On the
    CPU Megatron's fork also runs megatron_dpp.mcore.cpu_patches's filter of its CPU-state warning, which a
    GPU does not: the CPU overstates what the GPU saves."""
    from megatron.core import tensor_parallel

    from megatron_dpp.mcore import rng as rng_fork
    from megatron_dpp.models import sdpa_attention

    attentions = [module for chunk in trainer.model for module in chunk.modules()
                  if isinstance(module, sdpa_attention.SdpaCoreAttention) and module.dropout_p > 0]

    def megatrons_fork(_device):
        return tensor_parallel.get_cuda_rng_tracker().fork()

    def switch(direct: bool) -> None:
        sdpa_attention.model_parallel_rng = (rng_fork.model_parallel_rng if direct
                                             else megatrons_fork)
    return attentions, switch


def _switch_bias_in_products(trainer):
    """The direct layer's linears with their bias in the GEMM (mcore.direct_linear's
    bias_in_product) against the product and a separate addition, as Megatron-Core's linear
    function computes them: `bias_in_products` switched off."""
    from megatron_dpp.mcore.direct_layer import DirectTransformerLayer

    layers = [module for chunk in trainer.model for module in chunk.modules()
              if isinstance(module, DirectTransformerLayer) and module.bias_in_products]

    def switch(direct: bool) -> None:
        for layer in layers:
            layer.bias_in_products = direct
    return layers, switch


def _switch_layer_calls(trainer):
    """The direct layer's shortened calls (mcore.direct_layer) against Megatron's: its __call__
    (CUDA-graph checks), IdentityOp q/k norm calls, bias-dropout-add through its closures and
    torch.enable_grad."""
    from megatron_dpp.mcore.direct_layer import DirectTransformerLayer

    layers = [module for chunk in trainer.model for module in chunk.modules()
              if isinstance(module, DirectTransformerLayer) and module.runs_directly]
    shortened = {layer: (layer.plain_call, layer.norms_q, layer.norms_k,
                         layer.bda_handler_enables_grad, layer.bda_unfused) for layer in layers}

    def switch(direct: bool) -> None:
        for layer, flags in shortened.items():
            attention = layer.self_attention
            (layer.plain_call, layer.norms_q, layer.norms_k, layer.bda_handler_enables_grad,
             layer.bda_unfused) = flags if direct else (
                False, attention.q_layernorm is not None, attention.k_layernorm is not None,
                False, False)
    return layers, switch


def _switch_fused_adam(trainer):
    """torch's fused AdamW (mcore.optimizer.set_torch_adam_implementation) against its foreach AdamW, torch's default on
    a GPU."""
    from megatron_dpp.mcore.optimizer import set_torch_adam_implementation, torch_adams

    def switch(direct: bool) -> None:
        set_torch_adam_implementation(trainer.optimizer, fused=direct)
        if not direct:
            _emulate_cuda_default_optimizer(trainer.optimizer)
    return torch_adams(trainer.optimizer), switch


# --compare-X: (what is compared, the function that finds the modules and switches them, what it
# is compared against).
COMPARISONS = {
    "linears": ("direct linears", _switch_linears, "Megatron-Core's"),
    "layers": ("direct transformer layers", _switch_layers, "Megatron-Core's"),
    "rng_fork": ("core attention's RNG fork", _switch_rng_fork, "Megatron-Core's"),
    "bias_in_products": ("linears' bias in the GEMM", _switch_bias_in_products,
                         "Megatron-Core's"),
    "layer_calls": ("direct layer's shortened calls", _switch_layer_calls, "Megatron-Core's"),
    "fused_adam": ("fused AdamW", _switch_fused_adam, "torch's foreach AdamW"),
}


def _compare(name: str, trainer, iteration, rounds: int) -> dict:
    """Our iteration with one of our host-time savings on and off (Megatron-Core's own code),
    paired round by round, the order swapped every round."""
    what, find, _ = COMPARISONS[name]
    modules, switch = find(trainer)
    if not modules:
        raise SystemExit(f"host_overhead: --compare-{name.replace('_', '-')}: the model has no "
                         f"module for the {what} (a feature that needs Megatron's code is on)")
    seconds: dict[bool, list[float]] = {True: [], False: []}
    try:
        for index in range(rounds):
            for direct in ((True, False) if index % 2 == 0 else (False, True)):
                switch(direct)
                start = time.perf_counter()
                iteration(index, log=False)
                seconds[direct].append(time.perf_counter() - start)
    finally:
        switch(True)
    ratios = sorted(a / b for a, b in zip(seconds[True], seconds[False]))
    return {"rounds": rounds, "layers": len(modules),
            "direct_ms": statistics.median(seconds[True]) * 1e3,
            "megatron_ms": statistics.median(seconds[False]) * 1e3,
            "ratio_median": statistics.median(ratios),
            "ratio_quartiles": [ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]]}


def _instrument(trainer, counter_box, times) -> None:
    """Phase labels and timers around the schedule and the optimizer step."""
    def wrap(call, phase):
        def wrapped(*args, **kwargs):
            counter = counter_box[0]
            region = counter.in_phase(phase) if counter is not None else contextlib.nullcontext()
            start = time.perf_counter()
            with region:
                result = call(*args, **kwargs)
            times[phase].append(time.perf_counter() - start)
            return result
        return wrapped

    trainer.forward_backward = wrap(trainer.forward_backward, "schedule")
    trainer.optimizer.step = wrap(trainer.optimizer.step, "optimizer")


def _inner_optimizers(optimizer) -> list:
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [getattr(o, "optimizer", o) for o in chained if getattr(o, "optimizer", None) is not None]


def _emulate_cuda_optimizer(optimizer) -> None:
    """Our optimizer as on a GPU: torch's AdamW fused (mcore.optimizer.set_torch_adam_implementation;
    kernels.torch_fused_adam, which chooses it where CUDA is, is what the CPU lacks)."""
    from megatron_dpp.mcore.optimizer import set_torch_adam_implementation

    set_torch_adam_implementation(optimizer, fused=True)


def _emulate_cuda_default_optimizer(optimizer) -> None:
    """torch.optim picks its foreach implementation for CUDA tensors when none is asked for."""
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            if group.get("foreach") is None and not group.get("fused"):
                group["foreach"] = True


def _mark_optimizer_steps(optimizer, counter: Counter) -> None:
    """torch.optim keeps `step` on the CPU unless fused or capturable."""
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            if group.get("fused") or group.get("capturable"):
                continue
            for param in group["params"]:
                step = inner.state.get(param, {}).get("step")
                if step is not None:
                    counter.mark_host(step)


# ----------------------------------------------------------------------------------------------
# anchor
# ----------------------------------------------------------------------------------------------
def measure_anchor(args: argparse.Namespace, vocab: int) -> dict:
    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_speed_anchor import GPT

    torch.manual_seed(1234)
    model = GPT(vocab, args.seq_length, args.layers, args.hidden, args.heads, 0.1, False).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=True)
    data = torch.randint(0, vocab, (args.micro_batches, args.micro_batch_size,
                                    args.seq_length + 1))
    counter_box: list[Counter | None] = [None]
    times: dict[str, list[float]] = collections.defaultdict(list)

    def phase(name):
        counter = counter_box[0]
        return counter.in_phase(name) if counter is not None else contextlib.nullcontext()

    def step() -> None:  # gpu_speed_anchor.measure's step
        start = time.perf_counter()
        total = torch.zeros(())
        with phase("schedule"):
            for m in range(args.micro_batches):
                loss = model(data[m, :, :-1], data[m, :, 1:]) / args.micro_batches
                loss.backward()
                total += loss.detach()
        optimizer_start = time.perf_counter()
        with phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        times["optimizer"].append(time.perf_counter() - optimizer_start)
        times["schedule"].append(optimizer_start - start)
        times["iteration"].append(time.perf_counter() - start)

    for _ in range(args.warmup):
        step()
    times.clear()
    for _ in range(args.timed_iterations):
        step()
    timing = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    counter = Counter(args.sites)
    counter_box[0] = counter
    with _counting(counter):
        for _ in range(args.iterations):
            step()
    result = _summary(counter, args.iterations, args.micro_batches)
    result["host_ms"] = {"iteration": timing["iteration"], "forward_backward": timing["schedule"],
                         "optimizer_step": timing["optimizer"]}
    result["optimizer"] = "AdamW(fused=True)"
    return result


# ----------------------------------------------------------------------------------------------
def print_table(result: dict) -> None:
    rows = [("device ops per micro-batch (compute / view)", "ops_per_micro_batch"),
            ("  forward", "ops_per_micro_batch_forward"),
            ("  backward", "ops_per_micro_batch_backward"),
            ("device ops per optimizer step", "ops_per_optimizer_step"),
            ("device ops per iteration, rest", "ops_per_iteration_other")]
    targets = [name for name in ("ours", "anchor") if name in result]
    print(f"{'':48s}" + "".join(f"{name:>18s}" for name in targets))
    for label, key in rows:
        cells = [f"{result[t][key]['compute']:.0f} / {result[t][key]['view']:.0f}" for t in targets]
        print(f"{label:48s}" + "".join(f"{cell:>18s}" for cell in cells))
    for label, key in (("syncs per iteration", "syncs_per_iteration"),):
        print(f"{label:48s}" + "".join(f"{result[t][key]:>18.1f}" for t in targets))
    for label, key in (("host ms per iteration", "iteration"),
                       ("  forward+backward", "forward_backward"),
                       ("  optimizer step", "optimizer_step")):
        print(f"{label:48s}" + "".join(f"{result[t]['host_ms'][key] or 0:>18.1f}"
                                       for t in targets))
    for name, (what, _, against) in COMPARISONS.items():
        compared = result.get("ours", {}).get(name)
        if compared:
            print(f"ours, {what} / {against} ({compared['layers']} modules, "
                  f"{compared['rounds']} paired rounds): {compared['direct_ms']:.1f} / "
                  f"{compared['megatron_ms']:.1f} ms per iteration, ratio median "
                  f"{compared['ratio_median']:.3f} (quartiles "
                  f"{compared['ratio_quartiles'][0]:.3f}-{compared['ratio_quartiles'][1]:.3f})")
    if "ratio" in result:
        print(f"ours / anchor: ops per micro-batch {result['ratio']['ops_per_micro_batch']:.2f}x, "
              f"host ms per iteration {result['ratio']['host_ms_per_iteration']:.2f}x")
    for target in targets:
        for entry in result[target]["sync_sites"]:
            print(f"{target} sync x{entry['count']} ({entry['what']}): {entry['site']}")


def main(argv=None) -> int:
    args = resolve(build_parser().parse_args(argv))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(REPO))
    from megatron_dpp.kernels import install_warning_filters

    install_warning_filters()
    import torch

    torch.set_num_threads(1)
    config = {name: getattr(args, name) for name in DEFAULT}
    result: dict = {"config": config, "torch": torch.__version__}
    vocab = None
    if args.target in ("both", "ours"):
        result["ours"] = measure_ours(args)
    if args.target in ("both", "anchor"):
        from megatron_dpp.data.tokenizer import build_tokenizer  # the sample data's vocabulary
        from megatron_dpp.arguments import parse_args

        vocab_args = parse_args(_our_argv(args))
        build_tokenizer(vocab_args)
        vocab = vocab_args.padded_vocab_size
        result["anchor"] = measure_anchor(args, vocab)
    if "ours" in result and "anchor" in result:
        ours, anchor = result["ours"], result["anchor"]
        result["ratio"] = {
            "ops_per_micro_batch": ours["ops_per_micro_batch"]["compute"]
            / max(anchor["ops_per_micro_batch"]["compute"], 1),
            "host_ms_per_iteration": ours["host_ms"]["iteration"] / anchor["host_ms"]["iteration"],
        }
    print_table(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
