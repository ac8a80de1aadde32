"""Which optional kernel or backend each Megatron-Core feature uses on this machine, and why.

Megatron-Core switches a fusion on when its config asks, whether or not the kernel behind it is
installed; a missing one fails at the first forward (`No module named 'scaled_masked_softmax_cuda'`).
Every such choice is made here, from what is importable (nothing is imported to decide), and each
is a `Choice`: on/off and the reason, printed once at startup as one `kernels: ...` line. Those
lines replace Megatron-Core's own "Apex is not installed" warnings (`install_warning_filters`).

Nothing is imported at load time, torch included: the warning filters must be in place before the
first Megatron-Core import, and the launcher checks a job's flags (megatron_dpp.arguments) without torch.
"""
from __future__ import annotations

import argparse
import importlib.util
import warnings
from dataclasses import dataclass
from typing import Optional

from megatron_dpp.cuda_presence import cuda_available

# What each optional kernel is imported as, by Megatron-Core or by our attention module.
FUSED_SOFTMAX_MODULES = ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda",
                         "scaled_softmax_cuda")  # megatron/core/fusions/fused_softmax.py
FUSED_WGRAD_MODULE = "fused_weight_gradient_mlp_cuda"  # Apex; tensor_parallel/layers.py
TRANSFORMER_ENGINE_MODULE = "transformer_engine"
FLASH_ATTN_MODULE = "flash_attn"
TRITON_MODULE = "triton"  # torch.compile's GPU code generator (Megatron-Core's jit_fuser)

# --attention-backend values (Megatron-LM's flag). Megatron-LM's own values flash, fused and
# unfused pick Transformer Engine's attention kernels; sdpa is ours (torch's
# scaled_dot_product_attention, megatron_dpp.models.sdpa_attention).
ATTENTION_BACKENDS = ("auto", "sdpa", "local", "flash", "fused", "unfused")
TRANSFORMER_ENGINE_BACKENDS = ("flash", "fused", "unfused")

# The core attention modules a layer spec can get (CoreAttentionChoice.module).
TRANSFORMER_ENGINE = "transformer_engine"  # Transformer Engine's layers and TEDotProductAttention
SDPA = "sdpa"                              # ours: torch.nn.functional.scaled_dot_product_attention
FLASH_ATTN = "flash_attn"                  # ours, calling flash_attn.flash_attn_func
LOCAL = "local"                            # Megatron-Core's DotProductAttention (unfused softmax)


# ----------------------------------------------------------------------------------------------
# what is importable
# ----------------------------------------------------------------------------------------------
def module_importable(name: str) -> bool:
    """Whether `import name` would find the module (found, not imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False


def transformer_engine_available() -> bool:
    return cuda_available() and module_importable(TRANSFORMER_ENGINE_MODULE)


def flash_attn_available() -> bool:
    return cuda_available() and module_importable(FLASH_ATTN_MODULE)


def fused_softmax_kernels_available() -> bool:
    return cuda_available() and all(module_importable(name) for name in FUSED_SOFTMAX_MODULES)


def fused_wgrad_kernel_available() -> bool:
    """Apex's fused_weight_gradient_mlp_cuda on a CUDA machine: what Megatron-Core's linear layers
    need for gradient_accumulation_fusion (they refuse the setting without it)."""
    return cuda_available() and module_importable(FUSED_WGRAD_MODULE)


def persistent_layer_norm_available() -> bool:
    """Apex's persistent LayerNorm kernel, which Megatron-Core's FusedLayerNorm runs for
    persist_layer_norm (without Apex the local layers use torch's LayerNorm, which refuses it)."""
    from megatron.core.fusions import fused_layer_norm

    return fused_layer_norm.HAVE_PERSIST_LAYER_NORM


def torch_compile_fusions_available() -> bool:
    """Megatron-Core's bias-gelu and bias-dropout-add fusions are torch.compile'd (its jit_fuser):
    on a GPU that needs triton, which CUDA builds of torch ship."""
    return cuda_available() and module_importable(TRITON_MODULE)


# ----------------------------------------------------------------------------------------------
# the choices
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Choice:
    feature: str
    on: bool
    reason: str

    def line(self) -> str:
        return f"kernels: {self.feature} {'on' if self.on else 'off'}: {self.reason}"


@dataclass(frozen=True)
class CoreAttentionChoice:
    """Which core attention the layer specs get (`module`), and Transformer Engine's backend when
    it is Transformer Engine's (TransformerConfig.attention_backend, an AttnBackend name)."""

    module: str  # TRANSFORMER_ENGINE, SDPA, FLASH_ATTN or LOCAL
    reason: str
    te_backend: str = "auto"

    def line(self) -> str:
        names = {TRANSFORMER_ENGINE: "Transformer Engine's DotProductAttention",
                 SDPA: "torch scaled_dot_product_attention (megatron_dpp.models.sdpa_attention)",
                 FLASH_ATTN: "flash-attn's flash_attn_func (megatron_dpp.models.sdpa_attention)",
                 LOCAL: "Megatron-Core's local DotProductAttention"}
        return f"kernels: core attention: {names[self.module]}: {self.reason}"


def core_attention(backend: str = "auto", use_flash_attn: bool = False,
                   split_backward: bool = False,
                   transformer_impl: Optional[str] = None,
                   packed_sequences: bool = False) -> CoreAttentionChoice:
    """The core attention for --attention-backend `backend`, --use-flash-attn and
    --transformer-impl (all validated by megatron_dpp.arguments). --dpp-split-backward and
    --transformer-impl local build Megatron-Core's local layers, never Transformer Engine's: the
    attention is then ours on a GPU. packed_sequences (--dataloader-inter-document-masking): only
    our core attention runs documents apart here (models/flags.py refuses the backends that cannot;
    Transformer Engine's THD attention is not set up here), so auto picks it."""
    if packed_sequences and use_flash_attn and flash_attn_available():
        return CoreAttentionChoice(FLASH_ATTN, "--use-flash-attn with "
                                   "--dataloader-inter-document-masking (flash_attn_varlen_func)")
    if packed_sequences:
        return CoreAttentionChoice(SDPA, "--dataloader-inter-document-masking: per-document "
                                   "attention (see the per-document attention line)")
    te = transformer_engine_available() and not split_backward and transformer_impl != "local"
    if backend in TRANSFORMER_ENGINE_BACKENDS:
        return CoreAttentionChoice(TRANSFORMER_ENGINE, f"--attention-backend {backend}", backend)
    if use_flash_attn:
        if te and flash_attn_available():  # Transformer Engine's flash backend runs flash-attn
            return CoreAttentionChoice(TRANSFORMER_ENGINE,
                                       "--use-flash-attn: Transformer Engine's flash backend", "flash")
        if te:
            return CoreAttentionChoice(TRANSFORMER_ENGINE, "--use-flash-attn asked for flash-attn, "
                                       "which is not installed; Transformer Engine picks its own "
                                       "fused kernel instead")
        if flash_attn_available():
            return CoreAttentionChoice(FLASH_ATTN, "--use-flash-attn (flash-attn is installed; "
                                       "BERT's padding mask and fp32 go through torch SDPA)")
        return CoreAttentionChoice(SDPA, "--use-flash-attn asked for flash-attn, which is not "
                                   "installed; torch SDPA runs instead (its flash kernel is the same "
                                   "algorithm)")
    if backend == SDPA:
        return CoreAttentionChoice(SDPA, "--attention-backend sdpa")
    if backend == LOCAL:
        return CoreAttentionChoice(LOCAL, "--attention-backend local")
    if te:  # (installed on a CUDA machine)
        return CoreAttentionChoice(TRANSFORMER_ENGINE, "--transformer-impl transformer_engine"
                                   if transformer_impl else "Transformer Engine is installed")
    if not cuda_available():
        return CoreAttentionChoice(LOCAL, "CPU default (the activation-memory model of the search "
                                   "is checked against its saved tensors); --attention-backend "
                                   "sdpa for torch SDPA")
    if split_backward and transformer_engine_available():
        return CoreAttentionChoice(SDPA, "--dpp-split-backward builds Megatron-Core's local layers")
    if transformer_impl == "local" and transformer_engine_available():
        return CoreAttentionChoice(SDPA, "--transformer-impl local builds Megatron-Core's local "
                                   "layers")
    return CoreAttentionChoice(SDPA, "Transformer Engine not installed")


def core_attention_from_args(args: argparse.Namespace) -> CoreAttentionChoice:
    return core_attention(args.attention_backend, args.use_flash_attn,
                          getattr(args, "dpp_split_backward", False),
                          getattr(args, "transformer_impl", None),
                          bool(getattr(args, "dataloader_inter_document_masking", False)))


def packed_attention_obstacle(args: argparse.Namespace) -> Optional[str]:
    """Why --dataloader-inter-document-masking cannot run with the attention flags (the one-line
    error models/flags.py gives), or None: only our core attention (torch SDPA per document,
    torch varlen_attn, flash-attn's varlen kernel) runs the documents of a packed row apart."""
    flag = "--dataloader-inter-document-masking"
    if args.attention_backend not in ("auto", SDPA):
        return (f"{flag} needs a core attention that takes packed documents (THD): "
                f"--attention-backend {args.attention_backend} "
                + ("(Megatron-Core's local DotProductAttention) cannot"
                   if args.attention_backend == LOCAL
                   else "is Transformer Engine's, whose THD attention is not set up here")
                + "; use --attention-backend auto or sdpa")
    if getattr(args, "transformer_impl", None) == "transformer_engine":
        return (f"{flag} runs our per-document core attention in Megatron-Core's local layers; "
                f"Transformer Engine's THD attention is not set up here: use --transformer-impl "
                f"local")
    return None


# torch's variable-length (packed) flash attention, torch 2.10+ on a GPU.
TORCH_VARLEN_MODULE = "torch.nn.attention.varlen"


def packed_attention(args: argparse.Namespace) -> Choice:
    """Which kernel runs the documents of a packed row (--dataloader-inter-document-masking) apart,
    as SdpaCoreAttention picks it per call (models/sdpa_attention.py, packed_kernel)."""
    feature = "per-document attention"
    if not getattr(args, "dataloader_inter_document_masking", False):
        return Choice(feature, False, "--dataloader-inter-document-masking not given: causal "
                      "attention over each whole sample")
    per_document = "torch scaled_dot_product_attention once per document (causal inside it)"
    if not cuda_available():
        return Choice(feature, True, f"CPU: {per_document}")
    kernels = []
    if core_attention_from_args(args).module == FLASH_ATTN:
        kernels.append("flash-attn's flash_attn_varlen_func (fp16/bf16)")
    if module_importable(TORCH_VARLEN_MODULE):
        kernels.append("torch varlen_attn (fp16/bf16, no attention dropout)")
    if not kernels:
        return Choice(feature, True, f"{TORCH_VARLEN_MODULE} not in this torch: {per_document}")
    return Choice(feature, True, f"{' or '.join(kernels)}; otherwise {per_document}")


@dataclass(frozen=True)
class KernelChoices:
    """Every choice for one run; TransformerConfig's fusion settings are the `.on` of each."""

    attention: CoreAttentionChoice
    transformer_engine_layers: Choice
    masked_softmax_fusion: Choice
    bias_activation_fusion: Choice
    bias_dropout_fusion: Choice
    rope_fusion: Choice
    gradient_accumulation_fusion: Choice
    persist_layer_norm: Choice
    fused_optimizer: Choice
    cuda_graphs: Choice
    cross_entropy_fusion: Choice
    packed_attention: Choice

    def lines(self) -> list[str]:
        return [self.attention.line(), self.transformer_engine_layers.line(),
                self.masked_softmax_fusion.line(), self.bias_activation_fusion.line(),
                self.bias_dropout_fusion.line(), self.rope_fusion.line(),
                self.gradient_accumulation_fusion.line(), self.persist_layer_norm.line(),
                self.fused_optimizer.line(), self.cuda_graphs.line(),
                self.cross_entropy_fusion.line(), self.packed_attention.line()]


def _transformer_engine_layers(attention: CoreAttentionChoice) -> Choice:
    feature = "Transformer Engine layers"
    if attention.module == TRANSFORMER_ENGINE:
        return Choice(feature, True, "Transformer Engine is installed")
    if transformer_engine_available():
        return Choice(feature, False, "Megatron-Core's local layers, for the core attention chosen")
    return Choice(feature, False, "Megatron-Core's local layers (Transformer Engine not installed"
                  + ("" if cuda_available() else "; CPU") + ")")


def _masked_softmax_fusion(attention: CoreAttentionChoice, wanted: bool = True) -> Choice:
    feature = "masked softmax fusion"
    if attention.module != LOCAL:
        return Choice(feature, False, "unused: only Megatron-Core's local DotProductAttention "
                      "reads it")
    if not wanted:
        return Choice(feature, False, "--no-masked-softmax-fusion: torch softmax")
    if not cuda_available():
        return Choice(feature, False, "CPU: torch softmax")
    missing = [name for name in FUSED_SOFTMAX_MODULES if not module_importable(name)]
    if missing:
        return Choice(feature, False, f"{', '.join(missing)} not importable (Apex/Megatron "
                      "kernels not installed): torch softmax")
    return Choice(feature, True, "Megatron's scaled masked softmax kernels are installed")


def _compiled_fusion(feature: str, wanted: bool, off_flag: str) -> Choice:
    """A Megatron-Core fusion that its jit_fuser (torch.compile) builds: on where torch.compile
    has a GPU backend, unless its Megatron-LM flag turns it off."""
    if not wanted:
        return Choice(feature, False, f"{off_flag}: unfused torch ops")
    if not cuda_available():
        return Choice(feature, False, "CPU: unfused torch ops")
    if not module_importable(TRITON_MODULE):
        return Choice(feature, False, "triton not importable (torch.compile's GPU backend): "
                      "unfused torch ops")
    return Choice(feature, True, "torch.compile (Megatron-Core's jit_fuser), needs no extra package")


def _rope_fusion(args: argparse.Namespace) -> Choice:
    # The model family fills in its architecture when the flags are validated
    # (models/families.py); absent, Megatron-LM's default.
    position = getattr(args, "position_embedding_type", None) or "learned_absolute"
    if position != "rope":
        return Choice("rope fusion", False, "unused: the model uses learned absolute position "
                      "embeddings (the fused rotary kernel is Transformer Engine's)")
    if not getattr(args, "apply_rope_fusion", True):
        return Choice("rope fusion", False, "--no-rope-fusion: Megatron-Core's unfused rotary "
                      "embedding")
    return Choice("rope fusion", False, "Megatron-Core's unfused rotary embedding (the fused "
                  "kernel is Transformer Engine's, which is not set up for it here)")


def gradient_accumulation_fusion(args: argparse.Namespace) -> Choice:
    """Megatron-LM's choice: fused unless --no-gradient-accumulation-fusion, where the kernel
    exists. The deferred layers of --dpp-split-backward do not support the fusion."""
    feature = "gradient accumulation fusion"
    if not args.gradient_accumulation_fusion:
        return Choice(feature, False, "--no-gradient-accumulation-fusion")
    if getattr(args, "dpp_split_backward", False):
        return Choice(feature, False, "--dpp-split-backward defers weight gradients without it")
    if not fused_wgrad_kernel_available():
        return Choice(feature, False, f"{FUSED_WGRAD_MODULE} not importable (Apex not installed"
                      + ("" if cuda_available() else "; CPU") + ")")
    return Choice(feature, True, f"Apex {FUSED_WGRAD_MODULE} is installed")


def persist_layer_norm(args: argparse.Namespace, te_layers: Optional[bool] = None) -> Choice:
    """Megatron-LM's choice: the persistent LayerNorm kernel unless --no-persist-layer-norm, where
    the model's norm is Megatron-Core's local one and the kernel exists. Transformer Engine's norm
    does not read the setting; the deferred norm of --dpp-split-backward refuses it."""
    feature = "persistent layer norm"
    if te_layers is None:
        te_layers = core_attention_from_args(args).module == TRANSFORMER_ENGINE
    if args.no_persist_layer_norm:
        return Choice(feature, False, "--no-persist-layer-norm")
    if getattr(args, "dpp_split_backward", False):
        return Choice(feature, False, "--dpp-split-backward's deferred norm is torch's LayerNorm")
    if te_layers:
        return Choice(feature, False, "unused: Transformer Engine's norm")
    if not persistent_layer_norm_available():
        return Choice(feature, False, "Apex's persistent LayerNorm not importable: torch LayerNorm")
    return Choice(feature, True, "Apex's persistent LayerNorm is installed")


def _megatron_fused_optimizer_library() -> Optional[str]:
    """The library whose FusedAdam/FusedSGD Megatron-Core 0.16.1 imports (megatron/core/optimizer/
    __init__.py: Transformer Engine first, then Apex), or None where it falls back to torch.optim."""
    if module_importable(TRANSFORMER_ENGINE_MODULE):
        return "Transformer Engine"
    if module_importable("apex") and module_importable("amp_C"):
        return "Apex"
    return None


def torch_fused_adam(optimizer: str) -> bool:
    """Whether torch's AdamW, which Megatron-Core builds without Transformer Engine or Apex, runs
    fused (set_torch_adam_implementation): `--optimizer adam` on a CUDA machine. torch's fused
    AdamW updates every parameter in one multi-tensor kernel, as those libraries' FusedAdam does;
    its default on CUDA (foreach) launches a dozen foreach ops and reads each parameter's step on
    the host. On the CPU torch's default is kept (the CPU runs are the ones compared against
    Megatron's numbers bit for bit)."""
    return optimizer == "adam" and _megatron_fused_optimizer_library() is None and cuda_available()


def _fused_optimizer(args: argparse.Namespace) -> Choice:
    feature = "fused optimizer"
    name = "SGD" if getattr(args, "optimizer", "adam") == "sgd" else "Adam"
    library = _megatron_fused_optimizer_library()
    if library is not None:
        return Choice(feature, True, f"{library}'s Fused{name} and multi-tensor kernels")
    foreach = ("torch's foreach ops in place of Megatron-Core's per-tensor multi-tensor "
               "fallbacks (Transformer Engine and Apex not installed)")
    if torch_fused_adam(getattr(args, "optimizer", "adam")):
        return Choice(feature, True, f"torch's fused AdamW (torch.optim.AdamW(fused=True), one "
                      f"multi-tensor kernel per step), and {foreach}")
    return Choice(feature, False, f"torch {name}" + ("" if name == "SGD" else " (its fused "
                  "kernel is used on a GPU)") + f", and {foreach}")


def cuda_graph_obstacle(args: argparse.Namespace) -> Optional[str]:
    """Why --cuda-graph-impl local cannot run with the other flags (the error to give), or None."""
    flag = "--cuda-graph-impl local"
    if not cuda_available():
        return f"{flag} captures CUDA graphs and needs a CUDA GPU; drop it on CPU"
    if getattr(args, "use_dpp", False):
        return (f"{flag} runs under Megatron's schedules, which build the graphs at the end of the "
                f"first iteration; the --use-dpp runtime does not: drop one of them")
    if getattr(args, "recompute_granularity", None) is not None:
        return (f"{flag} does not graph recomputed layers (Megatron-Core supports recomputation "
                f"only with whole-iteration graphs); drop --recompute-activations / "
                f"--recompute-granularity or the graphs")
    if getattr(args, "dataloader_inter_document_masking", False):
        return (f"{flag} replays graphs captured for one set of document boundaries; "
                f"--dataloader-inter-document-masking changes them every micro-batch: drop one "
                f"of them")
    if getattr(args, "variable_seq_lengths", False):
        return (f"{flag} replays graphs captured for one shape; --variable-seq-lengths changes the "
                f"shape every micro-batch: drop one of them")
    return None


def cuda_graphs(args: argparse.Namespace) -> Choice:
    """Megatron-Core's local CUDA graphs (TransformerConfig.cuda_graph_impl "local"), asked for with
    Megatron-LM's --cuda-graph-impl local; the flag's checks (a GPU, Megatron's schedules, fixed
    shapes) are cuda_graph_obstacle's, which models/flags.py's validate_cuda_graph_args runs."""
    feature = "CUDA graphs"
    if getattr(args, "cuda_graph_impl", "none") != "local":
        reason = "--cuda-graph-impl none (Megatron-LM's default): every kernel is launched from Python"
        if cuda_graph_obstacle(args) is None:  # a GPU run that could take them: say what they give
            reason += ("; where the step waits for the host (a small model), --cuda-graph-impl "
                       "local launches each layer as one graph (docs/gpu.md, \"CUDA graphs\")")
        return Choice(feature, False, reason)
    return Choice(feature, True, "--cuda-graph-impl local: Megatron-Core's CudaGraphManager "
                  "captures each transformer layer's forward and backward at the end of the first "
                  "training iteration and replays them from then on")


def _mlp_activation(args: argparse.Namespace) -> str:
    """"gelu", "swiglu" or "squared_relu": the model's MLP, from --swiglu / --squared-relu, which
    the model family fills in when the flags are validated (models/families.py's mlp_activation);
    absent, Megatron-LM's default GeLU."""
    if getattr(args, "swiglu", None):
        return "swiglu"
    return "squared_relu" if getattr(args, "squared_relu", None) else "gelu"


def _bias_activation_fusion(args: argparse.Namespace, activation: str) -> Choice:
    """Megatron-LM's choice: --bias-swiglu-fusion for SwiGLU, --bias-gelu-fusion otherwise (it
    also sets squared ReLU's, which Megatron-Core has no kernel for), off without biases for
    GeLU (Megatron-LM turns it off there; SwiGLU's kernel takes no bias)."""
    flag = "swiglu" if activation == "swiglu" else "gelu"
    feature = f"bias-{activation.replace('_', '-')} fusion"
    if activation == "squared_relu":
        return Choice(feature, False, "Megatron-Core fuses GeLU and SwiGLU only: unfused torch ops")
    if activation == "gelu" and getattr(args, "add_bias_linear", True) is False:
        return Choice(feature, False, "--disable-bias-linear: no bias to fuse (as Megatron-LM)")
    return _compiled_fusion(feature, getattr(args, f"bias_{flag}_fusion"),
                            f"--no-bias-{flag}-fusion")


def _cross_entropy_fusion(args: argparse.Namespace) -> Choice:
    """Megatron-LM's --cross-entropy-loss-fusion (the flag check refused `te` where Transformer
    Engine is missing)."""
    feature = "cross-entropy fusion"
    if not getattr(args, "cross_entropy_loss_fusion", False):
        return Choice(feature, False, "Megatron-Core's vocab-parallel cross entropy, unfused "
                      "(--cross-entropy-loss-fusion fuses it)")
    if getattr(args, "cross_entropy_fusion_impl", "native") == "te":
        return Choice(feature, True, "--cross-entropy-fusion-impl te: Transformer Engine's "
                      "parallel cross entropy")
    bf16 = "" if getattr(args, "bf16", False) else (
        "; its backward rounds the logits' gradient to bf16 (it is meant for --bf16)")
    return Choice(feature, True, "--cross-entropy-loss-fusion: Megatron-Core's native fused cross "
                  "entropy" + (", torch.compile'd" if cuda_available() else ", plain torch on "
                               "the CPU") + bf16)


def kernel_choices(args: argparse.Namespace) -> KernelChoices:
    attention = core_attention_from_args(args)
    activation = _mlp_activation(args)
    te_layers = _transformer_engine_layers(attention)
    return KernelChoices(
        attention=attention,
        transformer_engine_layers=te_layers,
        masked_softmax_fusion=_masked_softmax_fusion(
            attention, getattr(args, "masked_softmax_fusion", True)),
        bias_activation_fusion=_bias_activation_fusion(args, activation),
        bias_dropout_fusion=_compiled_fusion("bias-dropout-add fusion",
                                             args.bias_dropout_fusion,
                                             "--no-bias-dropout-fusion"),
        rope_fusion=_rope_fusion(args),
        gradient_accumulation_fusion=gradient_accumulation_fusion(args),
        persist_layer_norm=persist_layer_norm(args, te_layers.on),
        fused_optimizer=_fused_optimizer(args),
        cuda_graphs=cuda_graphs(args),
        cross_entropy_fusion=_cross_entropy_fusion(args),
        packed_attention=packed_attention(args),
    )


# ----------------------------------------------------------------------------------------------
# Megatron-Core's warnings about the same packages
# ----------------------------------------------------------------------------------------------
# Each is a fallback the `kernels:` lines already report, or a deprecation of Megatron-Core's own
# default that a user cannot act on. Matched by message and by the warning's Megatron-Core module,
# so nothing else is hidden.
OPTIONAL_PACKAGE_WARNINGS = (
    r"Apex is not installed\. Falling back to Torch Norm",       # per spec module, at import
    r"Transformer Engine and Apex are not installed\. Falling back",  # optimizer modules, at import
    r"full scope is deprecated\.",  # TransformerConfig's own default cuda_graph_scope, per config
)


# Deprecations of torch.distributed.checkpoint that Megatron-Core's distributed checkpoints call
# into as they are written (its ShardedTensor-based loading): printed by every rank at every
# `torch_dist` load, and nothing a user of this trainer can change. (message, module that warns)
CHECKPOINT_LIBRARY_DEPRECATIONS = (
    (r"`load_state_dict` is deprecated", r"megatron\.core\.dist_checkpointing(\.|$)"),
    (r"Please use DTensor instead and we are deprecating ShardedTensor",
     r"torch\.distributed\.checkpoint(\.|$)"),
)


def install_warning_filters() -> None:
    """Silence Megatron-Core's optional-package warnings (process-wide; call before importing
    Megatron-Core): the `kernels:` lines say which path runs instead; and the checkpoint
    libraries' deprecations that Megatron-Core's loads set off (CHECKPOINT_LIBRARY_DEPRECATIONS)."""
    for message in OPTIONAL_PACKAGE_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning,
                                module=r"megatron\.core(\.|$)")
    for message, module in CHECKPOINT_LIBRARY_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning, module=module)


def import_megatron_core(compile_fusions: Optional[bool] = None) -> None:
    """Imports Megatron-Core (call before its first import). Its fusions, and a few other functions
    (RMSNorm's norm, GeLU variants), are wrapped in torch.compile (its jit_fuser) when their
    modules load, and that first call of torch.compile loads torch's Dynamo and Inductor: about 3 s
    of every rank's start on 2 CPU cores (docs/gpu.md). With compile_fusions False (a machine without a GPU, where
    the compiled fusions are off: `kernels:` lines) the wrapper is the identity instead: torch.compile
    is replaced by one while megatron.core loads, then Megatron-Core's own disable_jit_fuser() makes
    it so for the modules loaded later. The functions then run as plain torch ops, which is what
    they compute (tests run them eagerly anyway: TORCHDYNAMO_DISABLE). None: compile where a CUDA
    GPU is available, the choice the entry points make."""
    import sys

    if compile_fusions is None:
        compile_fusions = cuda_available()

    if compile_fusions or "megatron.core" in sys.modules:
        import megatron.core  # noqa: F401
        return
    import torch

    compile_ = torch.compile

    def identity(model=None, **_options):  # torch.compile(fn) and torch.compile(**options)(fn)
        return model if model is not None else (lambda fn: fn)

    torch.compile = identity
    try:
        import megatron.core  # noqa: F401
        from megatron.core import jit

        jit.disable_jit_fuser()
    finally:
        torch.compile = compile_


_logged = False


def log_kernel_choices(args: argparse.Namespace, log) -> None:
    """One `kernels:` line per feature through `log` (call on one rank), once per process."""
    global _logged
    if _logged:
        return
    _logged = True
    for line in kernel_choices(args).lines():
        log(line)
