"""The CPU stand-ins Megatron-Core needs to run without CUDA (platform.setup_platform applies them).

Megatron-Core's modules see a CPU stand-in for `torch.cuda` and for `device="cuda"` factory calls.
The patches touch only Megatron-Core's module namespaces, not torch (the exceptions, each only
during one Megatron-Core method: Tensor.cuda() returns the tensor itself in
LanguageModule.setup_embeddings_and_output_layer, DistributedOptimizer.get_parameter_state_dp_zero
and DynamicGradScaler.load_state_dict, and Tensor.type() names a CPU float tensor as its CUDA type
in the constructors of Float16OptimizerWithFloat16Params and DistributedOptimizer), and each is
listed below with the reason it is needed; the modules of one model come from its ModelSpec
(cpu_patched_modules), with their reasons there.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import sys
import types
from typing import Sequence

import torch


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


def _cpu_rng_state(*_args, **_kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, *_args, **_kwargs) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(seed)


class _CpuCudaNamespace(types.SimpleNamespace):
    """What Megatron-Core's `torch.cuda.X` resolves to on CPU; unknown names fall through to torch.cuda."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


# The calls Megatron-Core makes on `torch.cuda` in the code paths we run, each mapped to its CPU
# meaning: the "current device" is the CPU, and the model-parallel RNG tracker keeps CPU generator
# states (its dropout and init forks must still work, or tensor-parallel init/dropout break).
_CPU_CUDA = _CpuCudaNamespace(
    current_device=lambda: "cpu",
    get_rng_state=_cpu_rng_state,
    set_rng_state=_set_cpu_rng_state,
    manual_seed=_cpu_manual_seed,
    synchronize=lambda *args, **kwargs: None,
)

_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "randn", "rand", "randint")


def _cpu_factory(factory):
    def make(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    make.__name__ = factory.__name__
    return make


class _CpuTorch(types.ModuleType):
    """Stands in for the `torch` global inside one Megatron-Core module on CPU.

    Attributes are torch's, except `torch.cuda` (see _CPU_CUDA) and tensor factories whose
    hard-coded `device="cuda"` becomes the CPU. Lookups are cached on the instance.
    """

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CPU_CUDA
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):
        value = getattr(torch, name)
        setattr(self, name, value)
        return value


# One stand-in for every patched module, so they share its cached lookups.
_CPU_TORCH = _CpuTorch()

# Megatron-Core modules whose code paths (local layer spec, tensor-parallel layers, DDP buffers,
# optimizers, gradient clipping, pipeline schedules, RNG tracker) call torch.cuda or create tensors
# with device="cuda", whatever the model. Their `torch` global is replaced by the CPU stand-in, as
# is that of the model's own modules (ModelSpec.cpu_patched_modules).
_PATCHED_MODULES = (
    "megatron.core.tensor_parallel.random",          # RNG tracker on torch.cuda generator states
    "megatron.core.tensor_parallel.layers",          # weights/buffers on current_device()
    "megatron.core.tensor_parallel.mappings",        # gather buffers on current_device()
    "megatron.core.tensor_parallel.utils",           # gather buffers on current_device()
    "megatron.core.tensor_parallel.data",            # broadcast buffers on current_device()
    "megatron.core.tensor_parallel.cross_entropy",   # loss buffers
    "megatron.core.transformer.module",              # current_device() buffers
    "megatron.core.transformer.attention",           # current_device() buffers
    "megatron.core.transformer.dot_product_attention",  # current_device() masks
    "megatron.core.transformer.transformer_layer",   # current_device() buffers
    "megatron.core.transformer.transformer_block",   # current_device() buffers
    "megatron.core.transformer.utils",               # causal mask created with device="cuda"
    "megatron.core.distributed.param_and_grad_buffer",  # grad buffers on current_device()
    "megatron.core.distributed.distributed_data_parallel",  # current_device()
    "megatron.core.distributed.finalize_model_grads",  # reduction buffers
    "megatron.core.optimizer.optimizer",             # found_inf / scale tensors on "cuda"
    "megatron.core.optimizer.grad_scaler",           # fp16's loss scale on "cuda"
    "megatron.core.optimizer.distrib_optimizer",     # shard buffers on current_device()
    "megatron.core.optimizer.clip_grads",            # norm buffers on "cuda" (CPU-safe clipping)
    "megatron.core.pipeline_parallel.schedules",     # token counters on "cuda"
    "megatron.core.pipeline_parallel.p2p_communication",  # receive buffers on current_device()
    "megatron.core.pipeline_parallel.utils",         # current_device() helpers
    "megatron.core.utils",                           # current_device() helpers
)

# Whether the patches beyond the `torch` globals are applied (they must be applied once).
_APPLIED = False


def _cpu_get_cuda_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False):
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_cuda_rng_state(new_state, device: int = -1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


def _cpu_clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm,
                                      use_decoupled_grad: bool = False):
    """Megatron's clip_grad_by_total_norm_fp32 without its `torch.cuda.FloatTensor` assertion."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attribute = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attribute).detach() for p in parameters
             if getattr(p, attribute, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    """Tensor.cuda() returns the tensor itself."""
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor",
                    "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


@contextlib.contextmanager
def _cpu_tensors_named_as_cuda():
    """Tensor.type() without arguments names a CPU float tensor as its CUDA type."""
    original = torch.Tensor.type

    def named_as_cuda(self, *args, **kwargs):
        if args or kwargs:
            return original(self, *args, **kwargs)
        name = original(self)
        return _CUDA_TYPE_NAMES.get(name, name)

    torch.Tensor.type = named_as_cuda
    try:
        yield
    finally:
        torch.Tensor.type = original


def _within(patch, method):
    """`method` run inside the context `patch()` (the patch holds only during the call)."""

    @functools.wraps(method)
    def run(*args, **kwargs):
        with patch():
            return method(*args, **kwargs)

    return run


class _DropMessage(logging.Filter):
    def __init__(self, message: str):
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != self.message


def apply_cpu_patches(extra_patched_modules: Sequence[str] = ()) -> None:
    """Patch Megatron-Core for a CUDA-less process. Never call when CUDA is available.

    Idempotent: a module is patched once; a later call patches only the extra modules it adds."""
    global _APPLIED
    if torch.cuda.is_available():
        raise RuntimeError("apply_cpu_patches() called on a machine with CUDA; use setup_platform()")
    for name in (*_PATCHED_MODULES, *extra_patched_modules):
        module = importlib.import_module(name)
        # A patched module's `torch` is already the stand-in.
        if getattr(module, "torch", None) is torch:
            module.torch = _CPU_TORCH
    if _APPLIED:
        return
    random_module = sys.modules["megatron.core.tensor_parallel.random"]
    # torch's CUDA RNG setter queues the call until CUDA initializes, which never happens on CPU:
    # the tracker's fork would silently not restore states. Use the CPU generator instead.
    random_module._get_cuda_rng_state = _cpu_get_cuda_rng_state
    random_module._set_cuda_rng_state = _cpu_set_cuda_rng_state
    # The tracker warns when the CPU generator changes inside a fork; on CPU the fork *is* the CPU
    # generator, so the warning fires on every dropout/init and means nothing.
    logging.getLogger(random_module.__name__).addFilter(
        _DropMessage("CPU RNG state changed within GPU RNG context"))
    # Gradient clipping asserts CUDA gradients; the optimizer calls it by its imported name.
    for name in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"):
        sys.modules[name].clip_grad_by_total_norm_fp32 = _cpu_clip_grad_by_total_norm_fp32
    # The pipeline's last stage copies the shared embedding with `weight.data.cuda()` before the
    # all-reduce that makes it equal to the first stage's.
    from megatron.core.models.common.language_module.language_module import LanguageModule

    LanguageModule.setup_embeddings_and_output_layer = _within(
        _tensor_cuda_is_identity, LanguageModule.setup_embeddings_and_output_layer)
    # The 16-bit and distributed optimizers accept parameters by their type() names, CUDA ones
    # only; the distributed optimizer gathers its state for a fully reshardable checkpoint with
    # `send_tensor.cuda()`, and fp16's loss scaler loads its scale with `.cuda()`.
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    for cls in (Float16OptimizerWithFloat16Params, DistributedOptimizer):
        cls.__init__ = _within(_cpu_tensors_named_as_cuda, cls.__init__)
    DistributedOptimizer.get_parameter_state_dp_zero = _within(
        _tensor_cuda_is_identity, DistributedOptimizer.get_parameter_state_dp_zero)
    DynamicGradScaler.load_state_dict = _within(_tensor_cuda_is_identity,
                                                DynamicGradScaler.load_state_dict)
    _APPLIED = True
