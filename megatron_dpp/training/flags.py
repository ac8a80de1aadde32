"""The training loop's flags and their checks, in --help's groups "training" (optimization, batch,
precision, garbage collection), "checkpointing", "logging and evaluation", "tracing" (--trace,
training/observe/tracing.py) and "profiling" (Megatron-LM's --profile window, training/observe/profiler_window.py;
--nvtx). training/config.py turns the parsed flags into config dataclasses; megatron_dpp.arguments
composes this module with the other packages' flags.

Standard library only: tracing.py and profiler_window.py import Megatron-Core, and the launcher's
flag check loads neither it nor torch (whether there is a CUDA GPU: megatron_dpp.cuda_presence).
"""
from __future__ import annotations

import argparse

from megatron_dpp.cuda_presence import cuda_available
from megatron_dpp.flag_errors import (add_refused_flags, add_stated_flags, first_given, require,
                                      require_output_dir)
from megatron_dpp.training import megatron_lm_flags
from megatron_dpp.training.batch_ramp import BatchSizeRamp, running_batch
from megatron_dpp.training.checkpoint.flags import (add_checkpoint_format_args,
                                                    add_load_scope_args, check_load_dir,
                                                    check_load_scope_args)
from megatron_dpp.training.observe.timers import (DEFAULT_LOG_LEVEL, DEFAULT_LOG_OPTION, LOG_LEVELS,
                                          LOG_OPTIONS)
from megatron_dpp.training.observe.wandb_log import save_dir as wandb_save_dir


# ----------------------------------------------------------------------------------------------
# optimization, batch, precision
# ----------------------------------------------------------------------------------------------
# Megatron-LM's flags that cannot apply here, by group: flag -> why (flag_errors.py).
REFUSED_TRAINING_FLAGS: dict[str, str] = dict(megatron_lm_flags.REFUSED_TRAINING)
REFUSED_CHECKPOINT_FLAGS: dict[str, str] = {
    "--async-save": "(saving in the background) is not built here: a save is one atomic, "
                    "checksummed transaction that training waits for (docs/checkpoints.md)",
    "--no-save-optim": "is not built here: a checkpoint always holds the optimizer's state "
                       "(--no-load-optim leaves it out at --load)",
    "--no-save-rng": "is not built here: a checkpoint always holds the RNG states "
                     "(--no-load-rng leaves them out at --load)",
    "--use-checkpoint-args": "is not built here: give the model's flags on the command line "
                             "(--load checks the checkpoint's tensors against them)",
    # Deprecated in Megatron-LM 0.16, where they do nothing either.
    "--use-dist-ckpt": "is deprecated in Megatron-LM and does nothing there: --ckpt-format "
                       "chooses the format (torch_dist, the default)",
    "--dist-ckpt-format": "is deprecated in Megatron-LM and does nothing there: --ckpt-format "
                          "chooses the format (torch_dist, the default)",
    **megatron_lm_flags.REFUSED_CHECKPOINT,
}
REFUSED_LOGGING_FLAGS: dict[str, str] = dict(megatron_lm_flags.REFUSED_LOGGING)
# --tensorboard-dir's defaults, as Megatron-LM's.
TENSORBOARD_LOG_INTERVAL, TENSORBOARD_QUEUE_SIZE = 1, 1000


def add_training_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("training")
    group.add_argument("--micro-batch-size", type=int, default=None,
                       help="Samples per micro-batch on one data-parallel rank.")
    group.add_argument("--global-batch-size", type=int, default=None,
                       help="Samples per optimizer step across all data-parallel ranks "
                            "(default: micro-batch size x data-parallel size).")
    group.add_argument("--train-iters", type=int, default=None,
                       help="Optimizer steps to train (iteration-based training; or --train-samples).")
    group.add_argument("--train-samples", type=int, default=None,
                       help="Samples to train (sample-based training, as Megatron-LM's): "
                            "--train-samples // --global-batch-size iterations; the schedule's "
                            "lengths are then --lr-decay-samples and --lr-warmup-samples.")
    group.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                       metavar=("START", "INCREMENT", "SAMPLES"),
                       help="Grow the global batch from START by INCREMENT to --global-batch-size "
                            "over the first SAMPLES samples, as Megatron-LM (with --train-samples;"
                            " every size a multiple of --micro-batch-size x data-parallel size; "
                            "training/batch_ramp.py).")
    group.add_argument("--lr", type=float, default=None, help="Peak learning rate.")
    group.add_argument("--min-lr", type=float, default=0.0, help="Learning rate floor of the decay.")
    group.add_argument("--decoupled-lr", type=float, default=None,
                       help="A peak learning rate of its own for the input embedding and the "
                            "output layer (Megatron-Core's is_embedding_or_output_parameter; a "
                            "tied output layer is the embedding), as Megatron-LM: same schedule, "
                            "own peak; its floor is --decoupled-min-lr, else --min-lr. The log "
                            "line adds `decoupled learning rate`.")
    group.add_argument("--decoupled-min-lr", type=float, default=None,
                       help="With --decoupled-lr: the floor of its decay (default --min-lr). "
                            "Without --decoupled-lr it does nothing, as in Megatron-LM.")
    group.add_argument("--lr-decay-style", type=str, default="linear",
                       choices=["constant", "linear", "cosine", "inverse-square-root"],
                       help="Learning rate decay function.")
    group.add_argument("--lr-decay-iters", type=int, default=None,
                       help="Iterations to decay over (default: --train-iters).")
    group.add_argument("--lr-decay-samples", type=int, default=None,
                       help="With --train-samples: samples to decay over (default: --train-samples).")
    group.add_argument("--lr-warmup-iters", type=int, default=0,
                       help="Iterations of linear warmup from 0 to --lr.")
    group.add_argument("--lr-warmup-samples", type=int, default=0,
                       help="With --train-samples: samples of linear warmup from 0 to --lr.")
    group.add_argument("--lr-warmup-fraction", type=float, default=None,
                       help="Warm up over this fraction of the decay's length instead of "
                            "--lr-warmup-iters/--lr-warmup-samples.")
    group.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                       action="store_true", dest="override_opt_param_scheduler",
                       help="On --load, take the learning-rate schedule (--lr, --min-lr, its "
                            "lengths and style, the weight decay) from this run's flags where "
                            "the checkpoint's differs. Without it or "
                            "--use-checkpoint-opt_param-scheduler a difference stops the load "
                            "in one line, as in Megatron-LM.")
    group.add_argument("--use-checkpoint-opt_param-scheduler",
                       "--use-checkpoint-opt-param-scheduler", action="store_true",
                       dest="use_checkpoint_opt_param_scheduler",
                       help="On --load, keep the checkpoint's learning-rate schedule where this "
                            "run's flags differ (the run still stops at its own --train-iters).")
    group.add_argument("--optimizer", choices=OPTIMIZERS, default="adam",
                       help="adam: Adam with decoupled weight decay (AdamW), Megatron-LM's "
                            "default; sgd: SGD with momentum (Megatron-LM's; not with "
                            "--use-distributed-optimizer, which Megatron-Core builds for Adam "
                            "only).")
    group.add_argument("--weight-decay", type=float, default=0.01,
                       help="Weight decay: decoupled for Adam (AdamW), an L2 term for SGD.")
    group.add_argument("--clip-grad", type=float, default=1.0,
                       help="Clip gradients to this global L2 norm (0 disables clipping).")
    group.add_argument("--adam-beta1", type=float, default=None,
                       help=f"Adam's beta1 (default {OPTIMIZER_DEFAULTS['adam_beta1']}).")
    group.add_argument("--adam-beta2", type=float, default=None,
                       help=f"Adam's beta2 (default {OPTIMIZER_DEFAULTS['adam_beta2']}).")
    group.add_argument("--adam-eps", type=float, default=None,
                       help=f"Adam's epsilon (default {OPTIMIZER_DEFAULTS['adam_eps']:g}).")
    group.add_argument("--sgd-momentum", type=float, default=None,
                       help=f"SGD's momentum (default {OPTIMIZER_DEFAULTS['sgd_momentum']}; "
                            f"--optimizer sgd only).")
    group.add_argument("--seed", type=int, default=1234, help="Random seed.")
    group.add_argument("--bf16", action="store_true",
                       help="bfloat16 mixed precision, as Megatron-LM's (16-bit model, fp32 main "
                            "parameters and gradients); CPU ranks run it too, slowly.")
    group.add_argument("--fp16", action="store_true",
                       help="float16 mixed precision with dynamic loss scaling (the log line's "
                            "`loss scale`); CPU ranks run it too, slowly.")
    group.add_argument("--loss-scale", type=float, default=None,
                       help="A constant loss scale for --fp16 or --bf16 (Megatron-LM's; a power "
                            "of 2 keeps it exact); without it --fp16 scales dynamically.")
    group.add_argument("--initial-loss-scale", type=float, default=None,
                       help=f"--fp16's dynamic loss scale at the start (default "
                            f"{DYNAMIC_LOSS_SCALE_DEFAULTS['initial_loss_scale']:.0f}, 2**32).")
    group.add_argument("--min-loss-scale", type=float, default=None,
                       help=f"--fp16's dynamic loss scale never falls below this (default "
                            f"{DYNAMIC_LOSS_SCALE_DEFAULTS['min_loss_scale']:g}).")
    group.add_argument("--loss-scale-window", type=float, default=None,
                       help=f"--fp16: double the dynamic loss scale after this many updates "
                            f"without an overflow (default "
                            f"{DYNAMIC_LOSS_SCALE_DEFAULTS['loss_scale_window']:g}).")
    group.add_argument("--hysteresis", type=int, default=None,
                       help=f"--fp16: halve the dynamic loss scale after this many overflows "
                            f"(default {DYNAMIC_LOSS_SCALE_DEFAULTS['hysteresis']}).")
    group.add_argument("--exit-interval", type=int, default=None,
                       help="Stop after an iteration that is a multiple of this, with a "
                            "checkpoint first when --save is given, and exit 0 (Megatron-LM's).")
    group.add_argument("--exit-duration-in-mins", type=float, default=None,
                       help="Stop after the first iteration that ends this many minutes after "
                            "the start (the ranks agree), with a checkpoint first when --save is "
                            "given, and exit 0 (Megatron-LM's): for a job's time limit.")
    group.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                       help="Accepted for Megatron-LM command lines and always so here: under "
                            "--bf16 and --fp16 the gradients are accumulated and all-reduced in "
                            "fp32 (Megatron-LM does so for bf16 unless --grad-reduce-in-bf16, for "
                            "fp16 with this flag), except under --bf16 --grad-reduce-in-bf16, "
                            "which wins over it, as in Megatron-LM's validate_args.")
    group.add_argument("--grad-reduce-in-bf16", action="store_true",
                       help="Under --bf16, accumulate and all-reduce the gradients in bf16 "
                            "instead of fp32 (DDP's grad_reduce_in_fp32 off; the optimizer's main "
                            "parameters stay fp32), as Megatron-LM: half the gradient memory and "
                            "traffic. Without --bf16 it does nothing, as in Megatron-LM. "
                            "megatron_dpp.search's memory and cost models still count fp32 "
                            "gradients.")
    add_refused_flags(group, REFUSED_TRAINING_FLAGS,
                      taking_values=megatron_lm_flags.REFUSED_TRAINING)
    add_stated_flags(group, megatron_lm_flags.STATED_TRAINING)
    group.add_argument("--calculate-per-token-loss", action="store_true",
                       help="Scale the loss by the number of loss tokens in the whole global "
                            "batch instead of averaging it per micro-batch, as Megatron-LM: every "
                            "token weighs the same where micro-batches count different numbers "
                            "(--eod-mask-loss, --variable-seq-lengths' padding). GPT and Llama.")
    group.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                       dest="check_for_nan_in_loss_and_grad",
                       help="Train on when the gradients or the loss hold a NaN or Inf. By "
                            "default, as Megatron-LM, the run stops with one line and exit code "
                            "1 at the first such iteration, saving nothing after it: checked on "
                            "the gradient norm that the optimizer reads at every step (with "
                            "--clip-grad > 0), and on the loss at the iterations that log it. "
                            "Off under --fp16 without --loss-scale, as in Megatron-LM (the "
                            "dynamic loss scale skips the steps whose gradients overflow).")
    group.add_argument("--decrease-batch-size-if-needed", action="store_true",
                       help="Where --global-batch-size (or a --rampup-batch-size step) is not a "
                            "multiple of --micro-batch-size x the data-parallel size, train with "
                            "the largest multiple below it instead of stopping, as Megatron-LM "
                            "(for a job restarted on fewer GPUs); the learning-rate schedule "
                            "keeps counting the samples of the batch asked for.")
    group.add_argument("--exit-signal-handler", action="store_true",
                       help="Accepted for Megatron-LM command lines; always so here (the flag "
                            "does nothing here: its behaviour is always on). On SIGTERM or "
                            "SIGINT every rank stops after "
                            "the same iteration, saves a checkpoint when --save is given, and "
                            "exits with 128 + the signal number (training/signals.py).")
    group.add_argument("--skip-train", action="store_true",
                       help="Bypass the training loop, as Megatron-LM: evaluate the model on the "
                            "validation and the test split (--eval-iters batches each, those "
                            "with data) and exit, saving nothing. With --load the checkpoint's "
                            "model at its iteration (its optimizer state is not loaded, as "
                            "--no-load-optim), else the model as initialized, at iteration 0.")
    group.add_argument("--manual-gc", action="store_true",
                       help="Disable Python's automatic garbage collector and collect every "
                            "--manual-gc-interval iterations, aligned across ranks.")
    group.add_argument("--manual-gc-interval", type=int, default=0,
                       help="Iterations between manual collections (0: only around evaluation).")
    group.add_argument("--no-manual-gc-eval", "--disable-manual-gc-eval", action="store_false",
                       dest="manual_gc_eval",
                       help="With --manual-gc: do not collect at the start and the end of each "
                            "evaluation (without --manual-gc Python's collector runs as usual).")


def validate_training_args(args: argparse.Namespace) -> None:
    require(args.micro_batch_size is not None and args.micro_batch_size > 0,
            "--micro-batch-size is required and must be positive")
    require((args.train_iters is None) != (args.train_samples is None),
            "give one of --train-iters and --train-samples" if args.train_iters is None else
            "--train-iters and --train-samples are exclusive; give one")
    require(args.train_iters is None or args.train_iters > 0,
            "--train-iters must be positive")
    require(args.train_samples is None or args.train_samples > 0,
            "--train-samples must be positive")
    require(args.lr is not None and args.lr >= 0, "--lr is required and must be >= 0")
    per_step = args.micro_batch_size * args.parallel.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    require(args.global_batch_size > 0,
            f"--global-batch-size must be positive, got {args.global_batch_size}; use a multiple "
            f"of --micro-batch-size {args.micro_batch_size} x data-parallel size "
            f"{args.parallel.data_parallel_size} = {per_step}")
    running = running_batch(args.global_batch_size, per_step)
    if not args.decrease_batch_size_if_needed:
        require(args.global_batch_size % per_step == 0,
                f"--global-batch-size {args.global_batch_size} is not divisible by "
                f"--micro-batch-size {args.micro_batch_size} x data-parallel size "
                f"{args.parallel.data_parallel_size}; use a multiple of {per_step}"
                + (f" (or --decrease-batch-size-if-needed to train with {running})"
                   if running else ""))
    require(running > 0,
            f"--global-batch-size {args.global_batch_size} is below one micro-batch on each "
            f"data-parallel rank (--micro-batch-size {args.micro_batch_size} x data-parallel "
            f"size {args.parallel.data_parallel_size} = {per_step}), even with "
            f"--decrease-batch-size-if-needed")
    # Of the batch trained (--decrease-batch-size-if-needed: rounded down); the learning-rate
    # schedule's lengths count --global-batch-size's samples, as Megatron-LM's.
    args.num_microbatches = running // per_step
    require(0 <= args.min_lr <= args.lr, f"--min-lr {args.min_lr} must be in [0, --lr]")
    _validate_decoupled_lr(args)
    _validate_schedule_lengths(args)
    require(args.clip_grad >= 0, f"--clip-grad must be >= 0 (0 disables clipping), got "
                                 f"{args.clip_grad}")
    require(args.weight_decay >= 0, f"--weight-decay must be >= 0, got {args.weight_decay}")
    _validate_optimizer(args)
    # numpy's seed (set with Python's and torch's, training/setup.py) takes 0..2**32-1.
    require(0 <= args.seed < 2**32, f"--seed must be in [0, 2**32), got {args.seed}")
    require(not (args.bf16 and args.fp16), "--bf16 and --fp16 are exclusive; pick one")
    _validate_loss_scaling(args)
    require(args.exit_interval is None or args.exit_interval > 0,
            "--exit-interval must be positive")
    require(args.exit_duration_in_mins is None or args.exit_duration_in_mins > 0,
            "--exit-duration-in-mins must be positive")
    # Megatron-LM would start, evaluate nothing and exit: a run that does nothing at all.
    require(not (args.skip_train and args.eval_iters == 0),
            "--skip-train only evaluates, and --eval-iters 0 evaluates nothing; give "
            "--eval-iters N (batches per split)")
    require(args.manual_gc_interval >= 0, "--manual-gc-interval must be >= 0")
    require(args.manual_gc or args.manual_gc_interval == 0,
            "--manual-gc-interval needs --manual-gc")
    if args.parallel.virtual_pipeline_model_parallel_size is not None:
        refusal = interleaved_microbatches_refusal(args, args.num_microbatches)
        require(refusal is None, f"{refusal}; adjust --global-batch-size or {GROUP_SIZE_FLAG}")


GROUP_SIZE_FLAG = "--microbatch-group-size-per-virtual-pipeline-stage"


def interleaved_microbatches_refusal(args: argparse.Namespace, num_microbatches: int) -> str | None:
    """Why Megatron-Core 0.16.1's interleaved schedule refuses `num_microbatches` per step with
    the group size G (args.parallel.microbatch_group_size_per_vp_stage, by default
    --pipeline-model-parallel-size P), or None: G at most the micro-batches, and the last group
    (micro-batches mod G) empty or at least P. With G = P that is a multiple of P."""
    pp = args.pipeline_model_parallel_size
    group = args.parallel.microbatch_group_size_per_vp_stage or pp
    size = (f"{group} micro-batches ({GROUP_SIZE_FLAG})" if group != pp
            else f"{group} micro-batches (the default: --pipeline-model-parallel-size)")
    if num_microbatches < group:
        return (f"the interleaved schedule runs groups of {size}, more than the "
                f"{num_microbatches} micro-batches per step")
    last = num_microbatches % group
    if 0 < last < pp:
        return (f"the interleaved schedule runs the {num_microbatches} micro-batches per step in "
                f"groups of {size}, and the last group would have {last}, fewer than "
                f"--pipeline-model-parallel-size {pp} (it must be empty or at least that)")
    return None


def _validate_decoupled_lr(args: argparse.Namespace) -> None:
    """--decoupled-lr and its floor in range, as --lr and --min-lr (Megatron-LM checks neither:
    a floor above the peak would make the decay rise). --decoupled-min-lr alone is accepted and
    unused, as in Megatron-LM."""
    for flag, value in (("--decoupled-lr", args.decoupled_lr),
                        ("--decoupled-min-lr", args.decoupled_min_lr)):
        require(value is None or value >= 0, f"{flag} must be >= 0, got {value}")
    if args.decoupled_lr is None:
        return
    if args.decoupled_min_lr is None:
        require(args.min_lr <= args.decoupled_lr,
                f"--decoupled-lr {args.decoupled_lr} is below its floor --min-lr {args.min_lr} "
                f"(the default of --decoupled-min-lr); give --decoupled-min-lr")
    else:
        require(args.decoupled_min_lr <= args.decoupled_lr,
                f"--decoupled-min-lr {args.decoupled_min_lr} must be in [0, --decoupled-lr "
                f"{args.decoupled_lr}]")


OPTIMIZERS = ("adam", "sgd")
# Megatron-LM's defaults of each optimizer's own flags (attribute -> default), and whose they are.
OPTIMIZER_DEFAULTS = {"adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-8,
                      "sgd_momentum": 0.9}
_OPTIMIZER_OF = {"adam_beta1": "adam", "adam_beta2": "adam", "adam_eps": "adam",
                 "sgd_momentum": "sgd"}


def _validate_optimizer(args: argparse.Namespace) -> None:
    """Each optimizer's own flags in range; fills in their defaults. --sgd-momentum without
    --optimizer sgd is refused; Adam's flags with it are listed in args.unused_optimizer_flags
    for the startup line (the recipes carry Adam's betas, and `--optimizer sgd` appended to a
    launcher's command line must still run)."""
    args.unused_optimizer_flags = []
    for name, default in OPTIMIZER_DEFAULTS.items():
        flag = "--" + name.replace("_", "-")
        value = getattr(args, name)
        if value is None:
            setattr(args, name, default)
            continue
        if _OPTIMIZER_OF[name] != args.optimizer:
            require(_OPTIMIZER_OF[name] == "adam",
                    f"{flag} configures --optimizer {_OPTIMIZER_OF[name]}, and this run's is "
                    f"{args.optimizer}: remove it")
            args.unused_optimizer_flags.append(flag)
        if name == "adam_eps":
            require(value > 0, f"--adam-eps must be positive, got {value}")
        else:
            require(0 <= value < 1, f"{flag} must be in [0, 1), got {value}")
    require(not (args.optimizer == "sgd" and args.use_distributed_optimizer),
            "--optimizer sgd does not run with --use-distributed-optimizer: Megatron-Core's "
            "distributed optimizer supports Adam only")


# Megatron-LM's defaults of --fp16's dynamic loss scaler.
DYNAMIC_LOSS_SCALE_DEFAULTS = {"initial_loss_scale": 2.0 ** 32, "min_loss_scale": 1.0,
                               "loss_scale_window": 1000.0, "hysteresis": 2}


def _validate_loss_scaling(args: argparse.Namespace) -> None:
    """--loss-scale with a 16-bit precision; the dynamic scaler's flags with --fp16 and without
    --loss-scale (they configure nothing else). Fills in the dynamic scaler's defaults. Under the
    dynamic scale NaN and Inf gradients are its signal, so the NaN check is off (Megatron-LM's
    rule)."""
    if args.fp16 and args.loss_scale is None:
        args.check_for_nan_in_loss_and_grad = False
    if args.loss_scale is not None:
        require(args.fp16 or args.bf16, "--loss-scale needs --fp16 or --bf16")
        require(args.loss_scale > 0, f"--loss-scale must be positive, got {args.loss_scale}")
    for name, default in DYNAMIC_LOSS_SCALE_DEFAULTS.items():
        flag = "--" + name.replace("_", "-")
        value = getattr(args, name)
        if value is not None:
            require(args.fp16 and args.loss_scale is None,
                    f"{flag} configures --fp16's dynamic loss scale; "
                    + ("drop --loss-scale (a constant scale) or it"
                       if args.loss_scale is not None else "add --fp16 or drop it"))
            require(value >= 1 if name == "hysteresis" else value > 0,
                    f"{flag} must be {'>= 1' if name == 'hysteresis' else 'positive'}, got {value}")
        else:
            setattr(args, name, default)
    require(args.min_loss_scale <= args.initial_loss_scale,
            f"--min-loss-scale {args.min_loss_scale:g} exceeds --initial-loss-scale "
            f"{args.initial_loss_scale:g}")


def batch_ramp_from_args(args: argparse.Namespace) -> BatchSizeRamp | None:
    """--rampup-batch-size, checked against the batch flags (args.num_microbatches set), or
    None."""
    if args.rampup_batch_size is None:
        return None
    start, increment, samples = args.rampup_batch_size
    final = args.global_batch_size
    require(start > 0 and increment > 0 and samples > 0,
            f"--rampup-batch-size START INCREMENT SAMPLES must be positive, got "
            f"{start} {increment} {samples}")
    require(start < final, f"--rampup-batch-size starts at {start}, not below --global-batch-size "
                           f"{final}: nothing to ramp up; remove it or lower START")
    require((final - start) % increment == 0,
            f"--rampup-batch-size: INCREMENT {increment} does not divide --global-batch-size "
            f"{final} - START {start} = {final - start}")
    ramp = BatchSizeRamp(start, increment, samples, final)
    per_step = args.micro_batch_size * args.parallel.data_parallel_size
    for size in ramp.sizes:
        if args.decrease_batch_size_if_needed:
            require(size >= per_step,
                    f"--rampup-batch-size starts at a global batch of {size}, below one "
                    f"micro-batch on each data-parallel rank ({per_step}), even with "
                    f"--decrease-batch-size-if-needed")
        else:
            require(size % per_step == 0,
                    f"--rampup-batch-size reaches a global batch of {size}, not divisible by "
                    f"--micro-batch-size {args.micro_batch_size} x data-parallel size "
                    f"{args.parallel.data_parallel_size}; make START and INCREMENT multiples of "
                    f"{per_step} (or add --decrease-batch-size-if-needed)")
        if args.parallel.virtual_pipeline_model_parallel_size is not None:
            size = running_batch(size, per_step)
            refusal = interleaved_microbatches_refusal(args, size // per_step)
            require(refusal is None,
                    f"--rampup-batch-size reaches a global batch of {size}, and {refusal}; "
                    f"change START and INCREMENT (or {GROUP_SIZE_FLAG})")
    require(getattr(args, "cuda_graph_impl", "none") != "local",
            "--rampup-batch-size changes the number of micro-batches, and --cuda-graph-impl "
            "local's graphs were captured for one; use one of the two")
    return ramp


def _validate_schedule_lengths(args: argparse.Namespace) -> None:
    """Megatron-LM's two ways to give the training's and the schedule's lengths, in iterations or
    in samples, never mixed. Sets args.train_iters (sample-based: --train-samples //
    --global-batch-size, Megatron-LM's update_train_iters without a batch-size ramp-up) and
    args.lr_warmup_steps, args.lr_decay_steps, args.wd_incr_steps: the scheduler's lengths in
    samples, as Megatron-LM counts them (training/lr_schedule.py)."""
    batch = args.global_batch_size
    for flag, value in (("--lr-warmup-iters", args.lr_warmup_iters),
                        ("--lr-warmup-samples", args.lr_warmup_samples)):
        require(value >= 0, f"{flag} must be >= 0")
    if args.train_samples is not None:
        # (the flag given, the one of this kind to use instead)
        wrong = (("--lr-decay-iters", "--lr-decay-samples") if args.lr_decay_iters is not None
                 else ("--lr-warmup-iters", "--lr-warmup-samples") if args.lr_warmup_iters
                 else None)
        require(wrong is None, wrong and f"{wrong[0]} counts iterations and --train-samples "
                                         f"samples; use {wrong[1]}")
        ramp = batch_ramp_from_args(args)
        first = ramp.start if ramp is not None else batch
        require(args.train_samples >= first,
                f"--train-samples {args.train_samples} is less than one global batch "
                f"({first}); train at least {first} samples")
        args.train_iters = (ramp.train_iters(args.train_samples) if ramp is not None
                            else args.train_samples // batch)
        if ramp is not None:  # the ramp's last iteration may end past --train-samples
            args.train_samples_drawn = ramp.samples_consumed(args.train_iters)
        decay = args.lr_decay_samples if args.lr_decay_samples is not None else args.train_samples
        warmup = args.lr_warmup_samples
        args.wd_incr_steps = args.train_samples
        decay_flag, warmup_flag = "--lr-decay-samples", "--lr-warmup-samples"
    else:
        require(args.rampup_batch_size is None,
                "--rampup-batch-size counts samples: give --train-samples (and --lr-decay-samples,"
                " --lr-warmup-samples) instead of --train-iters, as Megatron-LM asks")
        wrong = (("--lr-decay-samples", "--lr-decay-iters") if args.lr_decay_samples is not None
                 else ("--lr-warmup-samples", "--lr-warmup-iters") if args.lr_warmup_samples
                 else None)
        require(wrong is None, wrong and f"{wrong[0]} counts samples and --train-iters "
                                         f"iterations; use --train-samples, or {wrong[1]}")
        if args.lr_decay_iters is None:
            args.lr_decay_iters = args.train_iters
        decay = args.lr_decay_iters * batch
        warmup = args.lr_warmup_iters * batch
        args.wd_incr_steps = args.train_iters * batch
        decay_flag, warmup_flag = "--lr-decay-iters", "--lr-warmup-iters"
    require(decay > 0, f"{decay_flag} must be positive")
    if args.lr_warmup_fraction is not None:
        require(args.lr_warmup_iters == 0 and args.lr_warmup_samples == 0,
                f"--lr-warmup-fraction and {warmup_flag} both give the warmup; give one")
        require(0 <= args.lr_warmup_fraction < 1,
                f"--lr-warmup-fraction must be in [0, 1), got {args.lr_warmup_fraction}")
        warmup = args.lr_warmup_fraction * decay
        warmup_flag = "--lr-warmup-fraction"
    unit, units = (1, "samples") if args.train_samples is not None else (batch, "iterations")
    require(decay > warmup, f"{decay_flag} ({decay // unit} {units}) must exceed {warmup_flag} "
                            f"({warmup / unit:g} {units})")
    require(not (args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler),
            "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are "
            "exclusive; give one")
    args.lr_warmup_steps, args.lr_decay_steps = warmup, decay


# ----------------------------------------------------------------------------------------------
# checkpoints
# ----------------------------------------------------------------------------------------------
def add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("checkpointing")
    group.add_argument("--save", type=str, default=None, help="Directory to save checkpoints to.")
    group.add_argument("--load", type=str, default=None,
                       help="Directory to resume from: a --save directory (its latest checkpoint) "
                            "or one of its iter_NNNNNNN folders. Without a checkpoint in it (or "
                            "not there yet), the run starts from randomly initialized weights, "
                            "as in Megatron-LM, with a warning unless it is also --save.")
    group.add_argument("--save-interval", type=int, default=None,
                       help="Save a checkpoint every this many iterations (needs --save).")
    add_checkpoint_format_args(group)
    add_load_scope_args(group)
    group.add_argument("--auto-detect-ckpt-format", action="store_true",
                       help="Accepted for Megatron-LM command lines and always so here: --load "
                            "tells torch_dist and torch checkpoints apart by their files.")
    group.add_argument("--exit-on-missing-checkpoint", action="store_true",
                       help="With --load: a --load directory without a checkpoint stops the run "
                            "in one line before it starts, as in Megatron-LM, also where it is "
                            "--save too (without the flag such a run starts from scratch).")
    add_refused_flags(group, REFUSED_CHECKPOINT_FLAGS, taking_a_value=("--dist-ckpt-format",),
                      taking_values=megatron_lm_flags.REFUSED_CHECKPOINT)
    add_stated_flags(group, megatron_lm_flags.STATED_CHECKPOINT)


def validate_checkpoint_args(args: argparse.Namespace) -> None:
    if args.save_interval is not None:
        require(args.save_interval > 0, "--save-interval must be positive")
        require(args.save is not None, "--save-interval needs --save DIR")
    if args.save is not None:  # written after the first --save-interval iterations, or at the end
        require_output_dir("--save", args.save)
    require(not args.exit_on_missing_checkpoint or args.load is not None,
            "--exit-on-missing-checkpoint needs --load DIR")
    if args.load is not None:  # without a checkpoint: starts from scratch, unless...
        check_load_dir(args.load, args.save, args.exit_on_missing_checkpoint)
    check_load_scope_args(args)


# ----------------------------------------------------------------------------------------------
# logging and evaluation
# ----------------------------------------------------------------------------------------------
def add_logging_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("logging and evaluation")
    group.add_argument("--log-interval", type=int, default=100,
                       help="Print an iteration line every this many iterations.")
    group.add_argument("--eval-interval", type=int, default=1000,
                       help="Evaluate on the validation set every this many iterations; after "
                            "the last iteration the run evaluates again on the validation and "
                            "the test split (those with data), as Megatron-LM.")
    group.add_argument("--eval-iters", type=int, default=100,
                       help="Batches per evaluation, of the validation or the test split (0 "
                            "disables evaluation).")
    group.add_argument("--log-num-zeros-in-grad", action="store_true",
                       help="Count the zero elements of the gradients at each step and log them "
                            "(`num zeros`, Megatron-LM's; one more host-device wait per step on "
                            "a GPU).")
    group.add_argument("--log-params-norm", action="store_true",
                       help="Log the L2 norm of all parameters (`params norm`, Megatron-LM's; with "
                            "--tensorboard-dir also `params-norm`): an all-reduce over the "
                            "model-parallel ranks and one host-device wait at each iteration "
                            "that logs it (training/observe/params_norm.py).")
    group.add_argument("--log-throughput", action="store_true",
                       help="Log the model's TFLOP/s per rank (`throughput per GPU "
                            "(TFLOP/s/GPU)`), counted as Megatron-LM counts them "
                            "(training/observe/throughput.py: the GEMMs at the full --seq-length, "
                            "attention halved as causal).")
    group.add_argument("--tensorboard-dir", type=str, default=None,
                       help="Write Megatron-LM's TensorBoard scalars here (losses, learning-rate, "
                            "loss-scale, grad-norm, validation loss, each also `vs samples`); "
                            "needs the tensorboard package (training/observe/tensorboard_log.py).")
    group.add_argument("--tensorboard-log-interval", type=int, default=TENSORBOARD_LOG_INTERVAL,
                       help="With --tensorboard-dir: write every this many iterations (each "
                            "write reads the losses: one host-device wait).")
    group.add_argument("--tensorboard-queue-size", type=int, default=TENSORBOARD_QUEUE_SIZE,
                       help="With --tensorboard-dir: events buffered before they are written.")
    group.add_argument("--no-log-learnig-rate-to-tensorboard",
                       "--no-log-learning-rate-to-tensorboard", action="store_false",
                       dest="log_learning_rate_to_tensorboard",
                       help="With --tensorboard-dir: leave out learning-rate (the first spelling "
                            "is Megatron-LM's).")
    group.add_argument("--no-log-loss-scale-to-tensorboard",
                       "--disable-log-loss-scale-to-tensorboard", action="store_false",
                       dest="log_loss_scale_to_tensorboard",
                       help="With --tensorboard-dir: leave out loss-scale.")
    group.add_argument("--log-batch-size-to-tensorboard", action="store_true",
                       help="With --tensorboard-dir: add batch-size.")
    group.add_argument("--log-world-size-to-tensorboard", action="store_true",
                       help="With --tensorboard-dir: add world-size.")
    group.add_argument("--log-memory-to-tensorboard", action="store_true",
                       help="With --tensorboard-dir on a CUDA GPU: add the caching allocator's "
                            "mem-reserved-bytes, mem-allocated-bytes, mem-max-allocated-bytes and "
                            "mem-allocated-count.")
    group.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                       help="With --tensorboard-dir: add the validation loss's perplexity.")
    group.add_argument("--wandb-project", type=str, default=None,
                       help="Log the TensorBoard scalars (losses, learning-rate, grad-norm, ...; "
                            "the --log-...-to-tensorboard flags and --tensorboard-log-interval "
                            "apply) to this Weights & Biases project, as Megatron-LM; needs the "
                            "wandb package and --wandb-exp-name (training/observe/wandb_log.py).")
    group.add_argument("--wandb-exp-name", type=str, default=None,
                       help="With --wandb-project: the run's name.")
    group.add_argument("--wandb-save-dir", type=str, default=None,
                       help="With --wandb-project: W&B's local files (default: <--save>/wandb).")
    group.add_argument("--wandb-entity", type=str, default=None,
                       help="With --wandb-project: the W&B user or team (default: W&B's own).")
    group.add_argument("--timing-log-level", type=int, default=DEFAULT_LOG_LEVEL,
                       choices=LOG_LEVELS,
                       help="Megatron-LM's timers, printed per iteration under each logged "
                            "iteration line: 0 none of those (the default; at every level, as "
                            "in Megatron-LM, the set-up's, each checkpoint load's and save's "
                            "and each evaluation's time is printed after it), 1 the iteration's "
                            "parts "
                            "(forward-backward, the gradient all-reduces, the optimizer step and "
                            "its parts), 2 also batch-generator, forward-compute and "
                            "backward-compute (and, with Megatron's schedules, their "
                            "send/receive waits). On a GPU they time the device with CUDA events, "
                            "without synchronizing at each timer (training/observe/timers.py).")
    group.add_argument("--timing-log-option", type=str, default=DEFAULT_LOG_OPTION,
                       choices=LOG_OPTIONS,
                       help="Print each timer's max over the ranks, its (min, max) (the "
                            "default), or every rank's time.")
    group.add_argument("--no-barrier-with-level-1-timing", action="store_false",
                       dest="barrier_with_L1_time",
                       help="With --timing-log-level 1 or 2: do not make all ranks meet before "
                            "the forward-backward, optimizer and gradient-sync timers start "
                            "(Megatron-LM's default meets, so that the times compare).")
    group.add_argument("--log-timers-to-tensorboard", action="store_true",
                       help="With --tensorboard-dir or --wandb-project: at each logged iteration "
                            "write iteration-time and each timer of --timing-log-level as "
                            "`<timer>-time` (its max over the ranks), in seconds per iteration, "
                            "as Megatron-LM.")
    add_refused_flags(group, REFUSED_LOGGING_FLAGS, taking_values=REFUSED_LOGGING_FLAGS)
    add_stated_flags(group, megatron_lm_flags.STATED_LOGGING)


def validate_logging_args(args: argparse.Namespace) -> None:
    require(args.log_interval > 0, "--log-interval must be positive")
    require(args.eval_interval > 0, "--eval-interval must be positive")
    require(args.eval_iters >= 0, "--eval-iters must be >= 0")
    _validate_tensorboard_args(args)
    _validate_wandb_args(args)
    _validate_timing_args(args)


def _validate_timing_args(args: argparse.Namespace) -> None:
    # --timing-log-option also formats the level-0 timers (set-up, checkpoints, evaluation).
    require(args.timing_log_level > 0 or args.barrier_with_L1_time,
            "--no-barrier-with-level-1-timing needs --timing-log-level 1 or 2 (at the default 0 "
            "no level-1 timer runs)")


def _validate_tensorboard_args(args: argparse.Namespace) -> None:
    # What the scalar logs get; W&B (--wandb-project) gets the same, chosen by the same flags.
    choosing = {"--tensorboard-log-interval":
                    args.tensorboard_log_interval != TENSORBOARD_LOG_INTERVAL,
                "--no-log-learnig-rate-to-tensorboard": not args.log_learning_rate_to_tensorboard,
                "--no-log-loss-scale-to-tensorboard": not args.log_loss_scale_to_tensorboard,
                "--log-batch-size-to-tensorboard": args.log_batch_size_to_tensorboard,
                "--log-world-size-to-tensorboard": args.log_world_size_to_tensorboard,
                "--log-memory-to-tensorboard": args.log_memory_to_tensorboard,
                "--log-validation-ppl-to-tensorboard": args.log_validation_ppl_to_tensorboard,
                "--log-timers-to-tensorboard": args.log_timers_to_tensorboard}
    if args.tensorboard_dir is None:
        require(args.tensorboard_queue_size == TENSORBOARD_QUEUE_SIZE,
                "--tensorboard-queue-size needs --tensorboard-dir DIR")
        given = first_given(choosing.items())
        require(given is None or bool(args.wandb_project),
                f"{given} needs --tensorboard-dir DIR (or --wandb-project NAME)")
    else:
        import importlib.util

        require(importlib.util.find_spec("tensorboard") is not None,
                "--tensorboard-dir needs the tensorboard package, which this Python lacks: pip "
                "install tensorboard (into the venv), or drop the flag")
        require_output_dir("--tensorboard-dir", args.tensorboard_dir)
        require(args.tensorboard_queue_size > 0, "--tensorboard-queue-size must be positive")
    require(args.tensorboard_log_interval > 0, "--tensorboard-log-interval must be positive")
    require(not args.log_memory_to_tensorboard or cuda_available(),
            "--log-memory-to-tensorboard reports the CUDA caching allocator, and there is no "
            "CUDA GPU here; drop it")


def _validate_wandb_args(args: argparse.Namespace) -> None:
    if not args.wandb_project:
        given = first_given((("--wandb-exp-name", args.wandb_exp_name),
                             ("--wandb-save-dir", args.wandb_save_dir),
                             ("--wandb-entity", args.wandb_entity)))
        require(given is None, f"{given} needs --wandb-project NAME")
        return
    import importlib.util

    require(bool(args.wandb_exp_name),
            "--wandb-project needs --wandb-exp-name NAME (the run's name), as in Megatron-LM")
    require(importlib.util.find_spec("wandb") is not None,
            "--wandb-project needs the wandb package, which this Python lacks: pip install "
            "wandb (into the venv), or drop the flag")
    directory = wandb_save_dir(args)
    require(directory is not None,
            "--wandb-project needs --wandb-save-dir DIR or --save DIR (W&B's files then go to "
            "<save>/wandb)")
    require_output_dir("--wandb-save-dir" if args.wandb_save_dir else "--save (for W&B's files)",
                       directory)


# ----------------------------------------------------------------------------------------------
# tracing
# ----------------------------------------------------------------------------------------------
def add_trace_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tracing")
    group.add_argument("--trace", action="store_true",
                       help="Record what every pipeline rank did (each task, each wait and its reason, "
                            "each message; with --use-dpp also the activation bytes held) as one "
                            "Chrome trace per rank, on rank 0's clock: "
                            "TRACE_DIR/<run>/benchmark-rank<R>.json, written when training ends (a file "
                            "that cannot be written is one warning line, never a failed run). "
                            "Records the DPP runtime with --use-dpp, else Megatron's own 1F1B or "
                            "interleaved schedule (run over --p2p-transport, torch included).")
    group.add_argument("--trace-dir", type=str, default="benchmark",
                       help="Directory that gets one sub-directory per traced or profiled run (--trace, "
                            "--profile --use-pytorch-profiler), named by its start "
                            "time, layout and schedule (e.g. 20261124-153000-pp2-dpp, "
                            "20261124-153000-pp2-vpp2-interleaved).")


def validate_trace_args(args: argparse.Namespace) -> None:
    if not args.trace:
        return
    require(args.pipeline_model_parallel_size >= 2,
            "--trace records a pipeline schedule; set --pipeline-model-parallel-size 2 or more, or "
            "drop --trace")
    check_trace_dir(args.trace_dir)


def check_trace_dir(trace_dir: str) -> None:
    """--trace-dir, where --trace and --profile write: a directory, or one that can be made."""
    require_output_dir("--trace-dir", trace_dir)


# ----------------------------------------------------------------------------------------------
# profiling (Megatron-LM's --profile flags; training/observe/profiler_window.py)
# ----------------------------------------------------------------------------------------------
# nsys options that Megatron-LM's --profile help shows: refused, each with its reason
# (flag_errors.py).
NSYS_OPTIONS = ("--force-overwrite", "--capture-range", "--capture-range-end")
REFUSED_PROFILE_FLAGS: dict[str, str] = {
    flag: "is an option of `nsys profile` (Megatron-LM's --profile help shows it on the nsys "
          "command line), not of training; give it to nsys"
    for flag in NSYS_OPTIONS}
REFUSED_PROFILE_FLAGS.update(megatron_lm_flags.REFUSED_PROFILE)
PROFILE_STEP_START, PROFILE_STEP_END, PROFILE_RANKS = 10, 12, [0]


def add_profile_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("profiling")
    group.add_argument("--profile", action="store_true",
                       help="As in Megatron-LM: on each rank of --profile-ranks, open an nsys capture "
                            "range (torch.cuda.cudart().cudaProfilerStart()) when iteration "
                            "--profile-step-start starts and close it (cudaProfilerStop()) before "
                            "iteration --profile-step-end, for `nsys profile "
                            "--capture-range=cudaProfilerApi --capture-range-end=stop ...` around "
                            "the training command; needs a CUDA GPU. With --use-pytorch-profiler: "
                            "torch.profiler over the same iterations instead.")
    group.add_argument("--use-pytorch-profiler", action="store_true",
                       help="With --profile, as in Megatron-LM: torch.profiler instead of the nsys "
                            "capture range (CPU activities; CUDA too on a GPU; with shapes), which "
                            "writes TRACE_DIR/<run>/profile-rank<R>.json (a Chrome trace) on each "
                            "rank of --profile-ranks when the window closes. Works on CPU.")
    group.add_argument("--profile-step-start", type=int, default=None,
                       help=f"With --profile: the first profiled iteration, counted as Megatron-LM "
                            f"does (iterations completed before it; default {PROFILE_STEP_START}, "
                            f"i.e. the one logged as iteration {PROFILE_STEP_START + 1}).")
    group.add_argument("--profile-step-end", type=int, default=None,
                       help=f"With --profile: profiling stops before this iteration (default "
                            f"{PROFILE_STEP_END}); at most --train-iters.")
    group.add_argument("--profile-ranks", type=int, nargs="+", default=None, metavar="RANK",
                       help=f"With --profile: the global ranks that profile (default "
                            f"{' '.join(map(str, PROFILE_RANKS))}).")
    add_refused_flags(group, REFUSED_PROFILE_FLAGS, taking_a_value=NSYS_OPTIONS,
                      taking_values=megatron_lm_flags.REFUSED_PROFILE)
    group.add_argument("--nvtx", action="store_true",
                       help="On a CUDA GPU: an NVTX range around each pipeline task, named like the "
                            "task (F3.0, B3.0, W3.0), for nsys or Nsight: around each task the DPP "
                            "runtime runs with --use-dpp, else around each forward and backward step "
                            "of Megatron's own 1F1B or interleaved schedule (pipeline size 2 or "
                            "more); and a range around each iteration's gradient sync and optimizer "
                            "step.")


def validate_profile_args(args: argparse.Namespace) -> None:
    window = {"--profile-step-start": args.profile_step_start,
              "--profile-step-end": args.profile_step_end, "--profile-ranks": args.profile_ranks,
              "--use-pytorch-profiler": args.use_pytorch_profiler or None}
    if not args.profile:
        given = [flag for flag, value in window.items() if value is not None]
        require(not given, f"{' and '.join(given)} need --profile; add it or drop them")
    else:
        require(args.use_pytorch_profiler or cuda_available(),
                "--profile opens an nsys capture range (cudaProfilerStart/Stop), which needs a "
                "CUDA GPU and there is none here; add --use-pytorch-profiler for torch.profiler")
        if args.profile_step_start is None:
            args.profile_step_start = PROFILE_STEP_START
        if args.profile_step_end is None:
            args.profile_step_end = PROFILE_STEP_END
        if args.profile_ranks is None:
            args.profile_ranks = list(PROFILE_RANKS)
        start, end = args.profile_step_start, args.profile_step_end
        require(0 <= start < end, f"--profile-step-start {start} must be >= 0 and below "
                                  f"--profile-step-end {end}")
        require(end <= args.train_iters,
                f"--profile-step-end {end} is past --train-iters {args.train_iters}; lower it (the "
                f"profiled iterations are [--profile-step-start, --profile-step-end))")
        outside = [rank for rank in args.profile_ranks if not 0 <= rank < args.parallel.world_size]
        require(not outside, f"--profile-ranks {' '.join(map(str, outside))}: not a rank of a "
                             f"world of {args.parallel.world_size} (0..{args.parallel.world_size - 1})")
        args.profile_ranks = sorted(set(args.profile_ranks))
        if args.use_pytorch_profiler:  # the nsys capture range writes nothing itself
            check_trace_dir(args.trace_dir)
    if args.nvtx:
        require(cuda_available(),
                "--nvtx annotates CUDA work for nsys and there is no CUDA GPU here; drop --nvtx "
                "(--trace and --profile --use-pytorch-profiler work on CPU)")
        require(args.use_dpp or args.pipeline_model_parallel_size >= 2,
                "--nvtx names pipeline tasks; set --pipeline-model-parallel-size 2 or more (or "
                "--use-dpp), or drop --nvtx")
