"""Every flag of Megatron-LM's list of flags for the configuration search (tests/data/
megatron_flags_for_search.txt) is accepted with Megatron-LM's meaning, or refused with one line that
says why, exit code 2, before anything starts; each accepted flag that sets a Megatron-Core knob
reaches the config object.

Validation runs in this process (parse_args, as pretrain_gpt and pretrain_bert call it); one
subprocess per entry point checks the real command line.
"""
import argparse
import os
import subprocess
from pathlib import Path

import pytest
import torch

from _train_util import PYTHON, REPO_ROOT, data_args, ensure_sample_data

SEED_FLAGS = [line for line in (Path(__file__).parent / "data" / "megatron_flags_for_search.txt")
              .read_text().splitlines() if line.startswith("--")]

TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--micro-batch-size", "1", "--global-batch-size", "8",
        "--train-iters", "5", "--lr", "1e-3"]
FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", "1"]
PP2 = ["--pipeline-model-parallel-size", "2"]
INTERLEAVED = [*PP2, "--num-layers-per-virtual-pipeline-stage", "1"]
DIST_OPT = ["--use-distributed-optimizer", "--overlap-grad-reduce"]
ACCEPTED = None

# (seed flag, command line that uses it with what it needs, world size, on CPU: ACCEPTED or a
# piece of the one-line refusal). GPU_ONLY cases are refused on CPU and not decided here on a GPU.
CASES = [
    ("--recompute-activations", ["--recompute-activations"], 1, ACCEPTED),
    ("--recompute-granularity", FULL_RECOMPUTE, 1, ACCEPTED),
    ("--recompute-method", ["--recompute-granularity", "full", "--recompute-method", "block",
                            "--recompute-num-layers", "2"], 1, ACCEPTED),
    ("--recompute-num-layers", FULL_RECOMPUTE, 1, ACCEPTED),
    ("--distributed-backend", ["--distributed-backend", "gloo"], 1, ACCEPTED),
    ("--use-mcore-models", ["--use-mcore-models"], 1, ACCEPTED),
    ("--overlap-grad-reduce", ["--overlap-grad-reduce"], 2, ACCEPTED),
    ("--no-delay-grad-reduce", ["--overlap-grad-reduce", "--no-delay-grad-reduce"], 2, ACCEPTED),
    ("--use-cpu-initialization", ["--use-cpu-initialization"], 1, ACCEPTED),
    ("--no-clone-scatter-output-in-embedding", ["--no-clone-scatter-output-in-embedding"], 1,
     ACCEPTED),
    ("--tensor-model-parallel-size", ["--tensor-model-parallel-size", "2"], 2, ACCEPTED),
    ("--pipeline-model-parallel-size", PP2, 2, ACCEPTED),
    ("--num-layers-per-virtual-pipeline-stage", INTERLEAVED, 2, ACCEPTED),
    ("--use-distributed-optimizer", ["--use-distributed-optimizer"], 2, ACCEPTED),
    ("--overlap-param-gather", [*DIST_OPT, "--overlap-param-gather"], 2, ACCEPTED),
    ("--delay-param-gather", [*INTERLEAVED, *DIST_OPT, "--overlap-param-gather",
                              "--delay-param-gather"], 4, ACCEPTED),
    ("--context-parallel-size", ["--context-parallel-size", "1"], 1, ACCEPTED),
    ("--context-parallel-size", ["--context-parallel-size", "2"], 2,
     "--context-parallel-size 2: only 1 runs here"),
    ("--profile", ["--profile", "--use-pytorch-profiler", "--profile-step-start", "1",
                   "--profile-step-end", "3"], 1, ACCEPTED),
    ("--profile-step-start", ["--profile", "--use-pytorch-profiler", "--profile-step-start", "2",
                              "--profile-step-end", "4"], 1, ACCEPTED),
    ("--profile-step-end", ["--profile", "--use-pytorch-profiler", "--profile-step-start", "2",
                            "--profile-step-end", "5"], 1, ACCEPTED),
    ("--profile-ranks", ["--profile", "--use-pytorch-profiler", "--profile-step-start", "1",
                         "--profile-step-end", "2", "--profile-ranks", "0", "1"], 2, ACCEPTED),
    ("--manual-gc", ["--manual-gc"], 1, ACCEPTED),
    ("--manual-gc-interval", ["--manual-gc", "--manual-gc-interval", "2"], 1, ACCEPTED),
    ("--no-manual-gc-eval", ["--manual-gc", "--no-manual-gc-eval"], 1, ACCEPTED),
    ("--no-manual-gc-eval", ["--no-manual-gc-eval"], 1, ACCEPTED),
    ("--no-persist-layer-norm", ["--no-persist-layer-norm"], 1, ACCEPTED),
    ("--no-gradient-accumulation-fusion", ["--no-gradient-accumulation-fusion"], 1, ACCEPTED),
    ("--no-overlap-p2p-communication", [*INTERLEAVED, "--no-overlap-p2p-communication"], 2,
     ACCEPTED),
    ("--no-overlap-p2p-communication", [*PP2, "--use-dpp", "--no-overlap-p2p-communication"], 2,
     "--no-overlap-p2p-communication applies to Megatron's interleaved schedule"),
    ("--no-scatter-gather-tensors-in-pipeline", [*PP2, "--no-scatter-gather-tensors-in-pipeline"],
     2, ACCEPTED),
    # Transformer Engine userbuffers, custom PyTorch, encoder-decoder models, nsys: refused.
    ("--tp-comm-overlap", ["--tp-comm-overlap"], 1,
     "--tp-comm-overlap needs Transformer Engine's userbuffer overlap"),
    ("--tp-comm-overlap-cfg", ["--tp-comm-overlap-cfg", "ub.yaml"], 1,
     "--tp-comm-overlap-cfg configures --tp-comm-overlap, Transformer Engine's"),
    *[(flag, [flag], 1, f"{flag} tunes --tp-comm-overlap, Transformer Engine's")
      for flag in ("--disable-tp-comm-split-ag", "--disable-tp-comm-split-rs",
                   "--disable-tp-comm-bulk-dgrad", "--disable-tp-comm-bulk-wgrad")],
    ("--use-ring-exchange-p2p", ["--use-ring-exchange-p2p"], 1,
     "--use-ring-exchange-p2p needs torch.distributed.ring_exchange"),
    ("--no-async-tensor-model-parallel-allreduce", ["--no-async-tensor-model-parallel-allreduce"],
     1, "is ignored by Megatron-Core 0.16"),
    ("--pipeline-model-parallel-split-rank", [*PP2, "--pipeline-model-parallel-split-rank", "1"],
     2, "GPT and BERT are one stack of layers with no such split"),
    ("--force-overwrite", ["--force-overwrite", "true"], 1,
     "--force-overwrite is an option of `nsys profile`"),
    ("--capture-range", ["--capture-range=cudaProfilerApi"], 1,
     "--capture-range is an option of `nsys profile`"),
    ("--capture-range-end", ["--capture-range-end", "stop"], 1,
     "--capture-range-end is an option of `nsys profile`"),
]
GPU_ONLY = [
    ("--profile", ["--profile", "--profile-step-start", "1", "--profile-step-end", "3"], 1,
     "--profile opens an nsys capture range (cudaProfilerStart/Stop), which needs a CUDA GPU"),
    ("--use-flash-attn", ["--use-flash-attn"], 1, "--use-flash-attn needs a CUDA GPU"),
    ("--sequence-parallel", ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2,
     "--sequence-parallel needs Transformer Engine layers on a GPU"),
    ("--empty-unused-memory-level", ["--empty-unused-memory-level", "1"], 1,
     "--empty-unused-memory-level is GPU only"),
    ("--distribute-saved-activations", ["--tensor-model-parallel-size", "2", *FULL_RECOMPUTE,
                                        "--distribute-saved-activations"], 2,
     "--distribute-saved-activations needs CUDA GPUs"),
]
# Wrong combinations of the flags above: their own one-line refusals (on any machine).
BAD_COMBINATIONS = [
    (["--distribute-saved-activations", "--tensor-model-parallel-size", "2"], 2,
     "--distribute-saved-activations splits what full recomputation saves"),
    (["--distribute-saved-activations", *FULL_RECOMPUTE], 1,
     "--distribute-saved-activations splits across tensor-parallel ranks"),
    (["--overlap-param-gather"], 1, "add --use-distributed-optimizer"),
    (["--delay-param-gather"], 1, "--delay-param-gather aligns the all-gathers of "
                                  "--overlap-param-gather"),
    ([*PP2, "--use-dpp", "--dpp-split-backward", "--overlap-grad-reduce",
      "--no-delay-grad-reduce"], 4, "drop --no-delay-grad-reduce"),
]


def _id(case) -> str:
    return " ".join(case[1])


def _validate(argv, world_size, monkeypatch, capsys, model="gpt"):
    """parse_args as the entry point calls it: (args, None) or (None, its stderr lines)."""
    from megatron_dpp.arguments import parse_args

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    base = data_args() if model == "gpt" else _bert_data_args()
    try:
        args = parse_args([*base, *TINY, *argv], prog=f"megatron_dpp.pretrain_{model}", model=model)
    except SystemExit as exit_:
        assert exit_.code == 2, exit_.code
        return None, [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return args, None


def _bert_data_args():
    sample = ensure_sample_data()
    return ["--data-path", str(sample / "sample_bert_text_sentence"),
            "--vocab-file", str(sample / "bert-vocab.txt"), "--split", "98,2,0"]


def _check(argv, world_size, expected, monkeypatch, capsys, model="gpt"):
    args, errors = _validate(argv, world_size, monkeypatch, capsys, model)
    if expected is ACCEPTED:
        assert errors is None, errors
        return args
    assert errors is not None and len(errors) == 1, errors
    assert errors[0].startswith(f"megatron_dpp.pretrain_{model}: error: "), errors[0]
    assert expected in errors[0], errors[0]
    return None


def test_every_seed_flag_has_a_case():
    assert len(SEED_FLAGS) == len(set(SEED_FLAGS)) > 40
    covered = {flag for flag, *_ in [*CASES, *GPU_ONLY]}
    assert covered == set(SEED_FLAGS), (sorted(set(SEED_FLAGS) - covered),
                                        sorted(covered - set(SEED_FLAGS)))
    for flag, argv, *_ in [*CASES, *GPU_ONLY]:
        assert any(arg == flag or arg.startswith(flag + "=") for arg in argv), (flag, argv)


def test_help_explains_every_seed_flag(capsys):
    from megatron_dpp.arguments import build_parser

    for model in ("gpt", "bert"):
        actions = {option: action for action in build_parser(model=model)._actions
                   for option in action.option_strings}
        for flag in SEED_FLAGS:
            assert flag in actions and len(actions[flag].help or "") > 30, (model, flag)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_seed_flag_accepted_or_refused_with_reason(case, monkeypatch, capsys):
    _flag, argv, world_size, expected = case
    _check(argv, world_size, expected, monkeypatch, capsys)


@pytest.mark.parametrize("case", GPU_ONLY, ids=_id)
def test_gpu_only_seed_flag_refused_on_cpu(case, monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("GPU-only flags are valid here; their GPU conditions need the GPU tests")
    _flag, argv, world_size, expected = case
    _check(argv, world_size, expected, monkeypatch, capsys)


@pytest.mark.parametrize("case", BAD_COMBINATIONS, ids=lambda case: " ".join(case[0]))
def test_bad_combination_is_one_line(case, monkeypatch, capsys):
    argv, world_size, expected = case
    _check(argv, world_size, expected, monkeypatch, capsys)


@pytest.mark.parametrize("case", [case for case in CASES if case[3] is not ACCEPTED
                                  and "dpp" not in " ".join(case[1])] +
                         [("--no-persist-layer-norm", ["--no-persist-layer-norm", "--use-mcore-models",
                                                       "--no-gradient-accumulation-fusion"],
                           1, ACCEPTED)], ids=_id)
def test_bert_shares_the_seed_flags(case, monkeypatch, capsys):
    _flag, argv, world_size, expected = case
    _check(argv, world_size, expected, monkeypatch, capsys, model="bert")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("entry", ["megatron_dpp.pretrain_gpt", "megatron_dpp.pretrain_bert"])
def test_entry_point_refuses_before_starting(entry):
    """The real command line (no torchrun, no MASTER_ADDR: a process group would fail otherwise)."""
    base = data_args() if entry.endswith("gpt") else _bert_data_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="1", RANK="0")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    result = subprocess.run([PYTHON, "-m", entry, *base, *TINY, "--tp-comm-overlap"], env=env,
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=100)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith(f"{entry}: error: --tp-comm-overlap needs Transformer Engine")
    assert result.stdout == ""


def test_ring_exchange_is_absent_from_this_torch():
    """What the refusal of --use-ring-exchange-p2p says of this PyTorch."""
    assert not hasattr(torch.distributed, "ring_exchange")


# ----------------------------------------------------------------------------------------------
# The wired flags reach Megatron-Core's config objects (and ours)
# ----------------------------------------------------------------------------------------------
def _parsed(argv, world_size, monkeypatch, capsys):
    args = _check(argv, world_size, ACCEPTED, monkeypatch, capsys)
    args.padded_vocab_size = 128  # what build_tokenizer sets; unused by the configs
    return args


def test_clone_scatter_output_in_embedding_reaches_transformer_config(monkeypatch, capsys):
    from megatron_dpp.training.config import transformer_config_from_args

    assert transformer_config_from_args(_parsed([], 1, monkeypatch, capsys)) \
        .clone_scatter_output_in_embedding is True
    args = _parsed(["--no-clone-scatter-output-in-embedding"], 1, monkeypatch, capsys)
    assert transformer_config_from_args(args).clone_scatter_output_in_embedding is False


def test_overlap_p2p_comm_reaches_transformer_config(monkeypatch, capsys):
    from megatron_dpp.training.config import transformer_config_from_args

    config = transformer_config_from_args(_parsed(INTERLEAVED, 2, monkeypatch, capsys))
    assert (config.overlap_p2p_comm, config.batch_p2p_comm) == (True, False)
    config = transformer_config_from_args(
        _parsed([*INTERLEAVED, "--no-overlap-p2p-communication"], 2, monkeypatch, capsys))
    assert (config.overlap_p2p_comm, config.batch_p2p_comm) == (False, False)
    # Megatron's 1F1B never overlaps (Megatron-LM turns overlap_p2p_comm off without virtual stages).
    config = transformer_config_from_args(_parsed(PP2, 2, monkeypatch, capsys))
    assert (config.overlap_p2p_comm, config.batch_p2p_comm) == (False, True)


def test_distribute_saved_activations_reaches_transformer_config(monkeypatch, capsys):
    """GPU only as a flag (validation needs CUDA and tp > 1): the mapping from the parsed value."""
    from megatron_dpp.training.config import transformer_config_from_args

    args = _parsed(FULL_RECOMPUTE, 1, monkeypatch, capsys)
    assert args.distribute_saved_activations is False
    assert transformer_config_from_args(args).distribute_saved_activations is False
    args.distribute_saved_activations = True
    config = transformer_config_from_args(args)
    assert config.distribute_saved_activations is True
    assert config.recompute_granularity == "full"


@pytest.mark.parametrize("kernel_present", [True, False])
def test_gradient_accumulation_fusion_follows_the_flag_where_the_kernel_exists(
        kernel_present, monkeypatch, capsys):
    from megatron_dpp import kernels
    from megatron_dpp.training import config as config_module

    monkeypatch.setattr(kernels, "fused_wgrad_kernel_available", lambda: kernel_present)

    def fused(args):
        return kernels.gradient_accumulation_fusion(args).on

    assert fused(_parsed([], 1, monkeypatch, capsys)) is kernel_present
    assert fused(_parsed(["--no-gradient-accumulation-fusion"], 1, monkeypatch, capsys)) is False
    args = _parsed([*PP2, "--use-dpp", "--dpp-split-backward"], 2, monkeypatch, capsys)
    assert fused(args) is False  # the deferred layers of split backwards refuse the fusion
    if not kernel_present:  # (a config with the fusion on needs the kernel to be built on)
        config = config_module.transformer_config_from_args(_parsed([], 1, monkeypatch, capsys))
        assert config.gradient_accumulation_fusion is False


@pytest.mark.parametrize("kernel_present", [True, False])
def test_persist_layer_norm_follows_the_flag_where_the_kernel_exists(
        kernel_present, monkeypatch, capsys):
    from megatron_dpp import kernels
    from megatron_dpp.training import config as config_module

    monkeypatch.setattr(kernels, "persistent_layer_norm_available", lambda: kernel_present)
    monkeypatch.setattr(kernels, "transformer_engine_available", lambda: False)
    args = _parsed([], 1, monkeypatch, capsys)
    assert config_module.transformer_config_from_args(args).persist_layer_norm is kernel_present
    args = _parsed(["--no-persist-layer-norm"], 1, monkeypatch, capsys)
    assert config_module.transformer_config_from_args(args).persist_layer_norm is False
    args = _parsed([*PP2, "--use-dpp", "--dpp-split-backward"], 2, monkeypatch, capsys)
    assert kernels.persist_layer_norm(args).on is False
    # Transformer Engine's norm ignores the setting: left off.
    monkeypatch.setattr(kernels, "transformer_engine_available", lambda: True)
    assert kernels.persist_layer_norm(_parsed([], 1, monkeypatch, capsys)).on is False


def test_param_gather_flags_reach_ddp_config(monkeypatch, capsys):
    """GPU only as flags (the distributed optimizer needs CUDA): the mapping from parsed values."""
    from megatron_dpp.training.config import ddp_config_from_args

    args = _parsed([], 1, monkeypatch, capsys)
    ddp = ddp_config_from_args(args)
    assert (ddp.overlap_param_gather, ddp.align_param_gather) == (False, False)
    assert (args.overlap_param_gather, args.delay_param_gather) == (False, False)
    args.use_distributed_optimizer = args.overlap_grad_reduce = True
    args.overlap_param_gather = args.delay_param_gather = True
    ddp = ddp_config_from_args(args)
    assert (ddp.overlap_param_gather, ddp.align_param_gather) == (True, True)


def test_manual_gc_eval_reaches_training_config(monkeypatch, capsys):
    from megatron_dpp.training.config import training_config_from_args

    assert training_config_from_args(_parsed(["--manual-gc"], 1, monkeypatch, capsys)).manual_gc_eval
    args = _parsed(["--manual-gc", "--no-manual-gc-eval"], 1, monkeypatch, capsys)
    assert training_config_from_args(args).manual_gc_eval is False


class _Chunk:
    """What set_sync_funcs and params_gathered use of a Megatron DDP model chunk."""

    def __init__(self, use_forward_hook=False):
        self.use_forward_hook = use_forward_hook
        self.calls = []

    def no_sync(self):
        pass

    def start_grad_sync(self, *unused):
        pass

    def start_param_sync(self, *unused):
        pass

    def disable_forward_pre_hook(self):
        self.calls.append("disable")

    def enable_forward_pre_hook(self):
        self.calls.append("enable")


@pytest.mark.parametrize("chunks", [1, 2])
def test_delay_flags_set_the_schedule_sync_funcs(chunks, monkeypatch, capsys):
    from megatron_dpp.training.setup import set_sync_funcs

    model = [_Chunk() for _ in range(chunks)]

    def sync_funcs(argv, **values):
        args = _parsed(argv, 2, monkeypatch, capsys)
        vars(args).update(values)  # the GPU-only flags, set as validation would leave them
        config = argparse.Namespace(no_sync_func=None, grad_sync_func=None, param_sync_func=None)
        set_sync_funcs(config, model, args)
        return config

    def per_chunk(name):
        funcs = [getattr(chunk, name) for chunk in model]
        return funcs[0] if chunks == 1 else funcs

    config = sync_funcs([])
    assert (config.no_sync_func, config.grad_sync_func, config.param_sync_func) == \
        (per_chunk("no_sync"), None, None)
    assert sync_funcs(["--overlap-grad-reduce"]).grad_sync_func == per_chunk("start_grad_sync")
    assert sync_funcs(["--overlap-grad-reduce", "--no-delay-grad-reduce"]).grad_sync_func is None
    config = sync_funcs(["--overlap-grad-reduce"], use_distributed_optimizer=True,
                        overlap_param_gather=True)
    assert config.param_sync_func is None
    config = sync_funcs(["--overlap-grad-reduce"], use_distributed_optimizer=True,
                        overlap_param_gather=True, delay_param_gather=True)
    assert config.param_sync_func == per_chunk("start_param_sync")


def test_params_gathered_around_evaluation_and_checkpoints_with_overlap_param_gather():
    from megatron_dpp.training.setup import params_gathered

    hooked, plain = _Chunk(use_forward_hook=True), _Chunk()
    with params_gathered([hooked, plain]):
        assert hooked.calls == ["disable"]
    assert hooked.calls == ["disable", "enable"] and plain.calls == []
    with pytest.raises(RuntimeError), params_gathered([hooked]):
        raise RuntimeError("evaluation failed")
    assert hooked.calls[-1] == "enable"
