"""--decoupled-lr / --decoupled-min-lr and --grad-reduce-in-bf16, as Megatron-LM's.

--decoupled-lr: the input embedding's and the output layer's parameters (Megatron-Core's
is_embedding_or_output_parameter, set by LanguageModule on the first and the last stage) get their
own param groups with max_lr / min_lr of the flags, which the scheduler reads per group; the
checkpoints (torch_dist and torch) save and resume them, and a changed --decoupled-lr stops the load
in one line as a changed --lr does. --grad-reduce-in-bf16: under --bf16, DDP accumulates and
reduces the gradients in bf16 (grad_reduce_in_fp32 off).

In this process: the flags' checks and configs, the model chunks' flagged parameters at each
pipeline position, the loop's own model and optimizer builder with the scheduler stepped. Real
runs: pp=2 with --decoupled-lr (log line, resume in both formats), dp=2 bf16 with
--grad-reduce-in-bf16.
"""
import math
import re

import pytest
import torch

from _one_rank import one_rank_megatron
from _train_util import TINY_GPT_ARGS, data_args, run_training

LR, MIN_LR = 1e-3, 1e-4  # TINY_GPT_ARGS's
DECOUPLED = ["--decoupled-lr", "3e-3", "--decoupled-min-lr", "3e-4"]
LR_RE = re.compile(r"\| learning rate: ([-+0-9.eE]+)")
DECOUPLED_RE = re.compile(r"\| decoupled learning rate: ([-+0-9.eE]+)")
ERROR_RE = re.compile(r"^megatron_dpp: error: .*$", re.MULTILINE)


def _parse(monkeypatch, *extra, world_size=1):
    from megatron_dpp.arguments import parse_args

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    args = parse_args([*data_args(), *TINY_GPT_ARGS, *extra], prog="megatron_dpp.pretrain_gpt")
    args.padded_vocab_size = 128  # what build_tokenizer sets
    return args


def _error(monkeypatch, capsys, *extra) -> str:
    with pytest.raises(SystemExit) as exit_:
        _parse(monkeypatch, *extra)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_.value.code == 2 and len(lines) == 1, lines
    return lines[0]


# ----------------------------------------------------------------------------------------------
# flags -> configs
# ----------------------------------------------------------------------------------------------
def test_decoupled_flags_reach_the_optimizer_and_training_configs(monkeypatch):
    from megatron_dpp.training.config import optimizer_config_from_args, training_config_from_args

    args = _parse(monkeypatch, *DECOUPLED)
    optimizer = optimizer_config_from_args(args)
    assert (optimizer.decoupled_lr, optimizer.decoupled_min_lr) == (3e-3, 3e-4)
    assert (optimizer.lr, optimizer.min_lr) == (LR, MIN_LR)
    train = training_config_from_args(args)
    assert (train.decoupled_lr, train.decoupled_min_lr) == (3e-3, 3e-4)
    # Not given: Megatron-LM's None, one group schedule for all.
    optimizer = optimizer_config_from_args(_parse(monkeypatch))
    assert (optimizer.decoupled_lr, optimizer.decoupled_min_lr) == (None, None)
    # --decoupled-min-lr alone is accepted and, as in Megatron-Core, unused.
    args = _parse(monkeypatch, "--decoupled-min-lr", "1e-5")
    assert optimizer_config_from_args(args).decoupled_lr is None


@pytest.mark.parametrize("extra, expected", [
    (["--decoupled-lr", "-0.001"], "--decoupled-lr must be >= 0, got -0.001"),
    (["--decoupled-lr", "1e-3", "--decoupled-min-lr", "-1"],
     "--decoupled-min-lr must be >= 0, got -1.0"),
    (["--decoupled-min-lr", "-1"], "--decoupled-min-lr must be >= 0, got -1.0"),
    (["--decoupled-lr", "1e-3", "--decoupled-min-lr", "2e-3"],
     "--decoupled-min-lr 0.002 must be in [0, --decoupled-lr 0.001]"),
    (["--decoupled-lr", "1e-5"], "--decoupled-lr 1e-05 is below its floor --min-lr 0.0001"),
])
def test_bad_values_are_one_line(monkeypatch, capsys, extra, expected):
    assert expected in _error(monkeypatch, capsys, *extra)


@pytest.mark.parametrize("extra, in_fp32", [
    (["--bf16"], True),
    (["--bf16", "--grad-reduce-in-bf16"], False),
    # Megatron-LM's validate_args: --grad-reduce-in-bf16 wins under --bf16
    (["--bf16", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"], False),
    (["--fp16"], True),
    (["--fp16", "--grad-reduce-in-bf16"], True),   # Megatron-LM ignores it without --bf16
    (["--fp16", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"], True),
    ([], False),                                   # fp32 parameters: fp32 gradients anyway
    (["--grad-reduce-in-bf16"], False),
])
def test_ddp_config_follows_grad_reduce_in_bf16(monkeypatch, extra, in_fp32):
    from megatron_dpp.training.config import ddp_config_from_args

    assert ddp_config_from_args(_parse(monkeypatch, *extra)).grad_reduce_in_fp32 is in_fp32


# ----------------------------------------------------------------------------------------------
# in this process: our chunks' flagged parameters, the loop's builder, the scheduler
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    from megatron_dpp.models.bert import BERT_SPEC

    with one_rank_megatron(tmp_path_factory.mktemp("decoupled"), BERT_SPEC.cpu_patched_modules):
        yield


def _config():
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                             use_cpu_initialization=True, hidden_dropout=0.0,
                             attention_dropout=0.0, bias_activation_fusion=False,
                             bias_dropout_fusion=False, masked_softmax_fusion=False,
                             gradient_accumulation_fusion=False)


def _chunk(model: str, first: bool, last: bool, monkeypatch):
    """This model's chunk at a pipeline position (first / last stage), built by our builders."""
    from megatron.core import parallel_state

    from megatron_dpp.models.bert import BertShape, build_bert_chunks
    from megatron_dpp.models.gpt import GPTShape, build_gpt_chunks

    # models/init.py asks parallel_state the pipeline's size and this rank's place in it: one
    # rank is both ends, the first or last of two, or the middle of three.
    size, rank = {(True, True): (1, 0), (True, False): (2, 0), (False, True): (2, 1),
                  (False, False): (3, 1)}[(first, last)]
    with monkeypatch.context() as patch:
        patch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: size)
        patch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: rank)
        if model == "bert":
            (chunk,) = build_bert_chunks(_config(), BertShape(128, 16, True), seed=3)
        else:
            shape = (GPTShape(128, 16, model != "gpt tied") if model != "llama" else
                     GPTShape(128, 16, True, position_embedding_type="rope",
                              normalization="RMSNorm"))
            (chunk,) = build_gpt_chunks(_config(), shape, seed=3)
    return chunk


@pytest.mark.parametrize("model", ["gpt tied", "gpt untied", "llama", "bert"])
@pytest.mark.parametrize("first, last", [(True, True), (True, False), (False, True),
                                         (False, False)])
def test_embedding_and_output_weights_are_flagged_on_their_stages(megatron, monkeypatch, model,
                                                                  first, last):
    chunk = _chunk(model, first, last, monkeypatch)
    flagged = {name for name, param in chunk.named_parameters()
               if getattr(param, "is_embedding_or_output_parameter", False)}
    expected = set()
    if first:
        expected.add("embedding.word_embeddings.weight")
    # A tied output layer is the embedding on a one-stage model; on the last of several it is
    # a copy of its own (Megatron-Core keeps the two in sync).
    tied_alone = model in ("gpt tied", "bert") and first
    if last and not tied_alone:
        expected.add("output_layer.weight")
    assert flagged == expected


def _built(monkeypatch, *extra):
    """The loop's own model, optimizer and scheduler of the tiny GPT with `extra`."""
    from megatron_dpp.models.gpt import GPT_SPEC
    from megatron_dpp.platform import setup_platform
    from megatron_dpp.training.config import training_config_from_args
    from megatron_dpp.training.setup import build_model_and_optimizer
    from megatron_dpp.training.lr_schedule import SampleSchedule

    args = _parse(monkeypatch, *extra)
    platform = setup_platform(GPT_SPEC.cpu_patched_modules)
    _, model, optimizer = build_model_and_optimizer(args, platform, args.seed, GPT_SPEC)
    return args, model, optimizer, SampleSchedule(optimizer, training_config_from_args(args))


def _cosine(step: int, peak: float, floor: float, warmup: int = 1, decay: int = 5) -> float:
    """Megatron-Core's warmup + cosine at iteration `step` (TINY_GPT_ARGS's lengths)."""
    if step <= warmup:
        return peak * step / warmup
    ratio = (step - warmup) / (decay - warmup)
    return floor + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (peak - floor)


@pytest.mark.parametrize("extra, floor", [
    ([*DECOUPLED, "--untie-embeddings-and-output-weights"], 3e-4),
    (["--decoupled-lr", "3e-3"], MIN_LR),  # tied; the floor defaults to --min-lr
], ids=["untied, with its floor", "tied, floor from --min-lr"])
def test_embedding_and_output_groups_follow_the_decoupled_schedule(megatron, monkeypatch, extra,
                                                                   floor):
    args, model, optimizer, scheduler = _built(monkeypatch, *extra)
    flagged = {id(param) for chunk in model for param in chunk.parameters()
               if getattr(param, "is_embedding_or_output_parameter", False)}
    assert len(flagged) == (2 if args.untie_embeddings_and_output_weights else 1)
    decoupled = [group for group in optimizer.param_groups if not group["default_config"]]
    others = [group for group in optimizer.param_groups if group["default_config"]]
    assert len(decoupled) == 1 and others
    # Marked, so that a saved group loads into its own (setup.optimizer_config_overrides)
    assert decoupled[0]["is_decoupled_lr"] and not any(g["is_decoupled_lr"] for g in others)
    assert {id(param) for param in decoupled[0]["params"]} == flagged
    assert not flagged & {id(param) for group in others for param in group["params"]}
    for iteration in range(1, args.train_iters + 1):
        scheduler.step_after_update(args.global_batch_size)
        assert decoupled[0]["lr"] == pytest.approx(_cosine(iteration, 3e-3, floor), rel=1e-12)
        for group in others:
            assert group["lr"] == pytest.approx(_cosine(iteration, LR, MIN_LR), rel=1e-12)
    assert decoupled[0]["lr"] == pytest.approx(floor) and others[0]["lr"] == pytest.approx(MIN_LR)
    # The scheduler's state carries them, for the load's comparison (lr_schedule._COMPARED).
    state = scheduler.state_dict()
    assert (state["decoupled_lr"], state["decoupled_min_lr"]) == (3e-3, floor)


def test_without_the_flag_one_schedule_covers_every_group(megatron, monkeypatch):
    args, _model, optimizer, scheduler = _built(monkeypatch)
    assert all(group["default_config"] for group in optimizer.param_groups)
    scheduler.step_after_update(args.global_batch_size * 2)
    assert {group["lr"] for group in optimizer.param_groups} == {_cosine(2, LR, MIN_LR)}


def test_override_gives_the_decoupled_groups_the_flags_values(megatron, monkeypatch):
    """--override-opt_param-scheduler after a load: each group its flag's peak and floor (the
    optimizer's checkpoint restored the saved ones)."""
    args, _model, optimizer, scheduler = _built(monkeypatch, *DECOUPLED,
                                                "--override-opt_param-scheduler")
    saved = scheduler.state_dict()
    for group in optimizer.param_groups:  # what a checkpoint of other flags restores
        group["max_lr"], group["min_lr"] = 1.0, 0.5
    scheduler.load_state_dict(saved)
    peaks = {(group["default_config"], group["max_lr"], group["min_lr"])
             for group in optimizer.param_groups}
    assert peaks == {(True, LR, MIN_LR), (False, 3e-3, 3e-4)}


@pytest.mark.parametrize("extra, dtype", [(["--bf16"], torch.float32),
                                          (["--bf16", "--grad-reduce-in-bf16"], torch.bfloat16)])
def test_grad_reduce_in_bf16_makes_the_main_grads_bf16(megatron, monkeypatch, extra, dtype):
    _args, model, _optimizer, _scheduler = _built(monkeypatch, *extra)
    params = [param for chunk in model for param in chunk.parameters()]
    assert {param.dtype for param in params} == {torch.bfloat16}
    assert {param.main_grad.dtype for param in params} == {dtype}
    assert {buffer.grad_dtype for chunk in model for buffer in chunk.buffers} == {dtype}


# ----------------------------------------------------------------------------------------------
# real runs
# ----------------------------------------------------------------------------------------------
PP2 = ["--pipeline-model-parallel-size", "2", *DECOUPLED]


def _train(*extra):
    rc, losses, _norms, out = run_training([*PP2, *extra], nproc=2, timeout=240)
    rates = [float(x) for x in LR_RE.findall(out)]
    return rc, losses, rates, [float(x) for x in DECOUPLED_RE.findall(out)], out


@pytest.fixture(scope="module")
def uninterrupted():
    rc, losses, rates, decoupled, out = _train()
    assert rc == 0 and len(losses) == 5 and all(map(math.isfinite, losses)), out[-3000:]
    return losses, rates, decoupled


@pytest.mark.timeout(300)
def test_pp2_run_logs_and_follows_the_decoupled_rate(uninterrupted):
    losses, rates, decoupled = uninterrupted
    assert len(rates) == len(decoupled) == 5
    # 3x --lr and 3x --min-lr: the same cosine, three times the rate (6 printed digits).
    assert decoupled == pytest.approx([3 * rate for rate in rates], rel=1e-5)
    assert rates == pytest.approx([_cosine(i, LR, MIN_LR) for i in range(1, 6)], rel=1e-5)
    # The embedding's and output layer's own rate changes the training.
    rc, plain, _norms, out = run_training(["--pipeline-model-parallel-size", "2"], nproc=2,
                                          timeout=240)
    assert rc == 0 and len(plain) == 5 and "decoupled learning rate" not in out, out[-3000:]
    assert plain[0] == losses[0] and plain[1:] != losses[1:]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch"])
def test_pp2_resume_keeps_the_decoupled_groups(uninterrupted, tmp_path, ckpt_format):
    save = str(tmp_path / "ckpt")
    fmt = ["--ckpt-format", ckpt_format]
    rc, first, _rates, _decoupled, out = _train(*fmt, "--train-iters", "3",
                                                "--lr-decay-iters", "5", "--save", save)
    assert rc == 0 and first == uninterrupted[0][:3], out[-3000:]
    rc, resumed, rates, decoupled, out = _train(*fmt, "--load", save)
    assert rc == 0, out[-3000:]
    assert resumed == uninterrupted[0][3:]
    assert (rates, decoupled) == (uninterrupted[1][3:], uninterrupted[2][3:])
    if ckpt_format == "torch":
        return
    # A changed --decoupled-lr stops the load in one line, as a changed --lr.
    rc, _losses, _rates, _decoupled, out = _train(*fmt, "--load", save, "--decoupled-lr", "2e-3")
    errors = ERROR_RE.findall(out)
    assert rc != 0 and len(errors) == 1, out[-3000:]
    assert "--decoupled-lr 0.003 in the checkpoint, 0.002 here" in errors[0], errors[0]


@pytest.mark.timeout(300)
def test_bf16_dp2_trains_with_grad_reduce_in_bf16():
    rc, losses, _norms, out = run_training(["--bf16", "--grad-reduce-in-bf16"], nproc=2,
                                           timeout=240)
    assert rc == 0 and len(losses) == 5 and all(map(math.isfinite, losses)), out[-3000:]
    assert losses[-1] < losses[0], losses
