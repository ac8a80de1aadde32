"""Megatron-LM's training, checkpointing, logging and profiling flags for what this runtime does
not build (reinforcement learning, in-process restart, NVIDIA's fault-tolerance and logging
services, optimizer CPU offload, non-persistent checkpoints, ...): flag -> why, in one line with
what to use instead. training/flags.py adds them to their --help groups and refuses each in one
line (flag_errors.py); each takes Megatron-LM's values, if any, so that the refusal answers.

Also the flags of those groups that state what always holds here (flag_errors.StatedFlag).
Standard library only, as training/flags.py.
"""
from __future__ import annotations

from megatron_dpp.flag_errors import StatedFlag, each_refused


_RL = ("configures Megatron-LM's reinforcement learning (GRPO rollouts and their inference); "
       "this runtime runs pretraining only")
_INPROCESS = ("configures NVIDIA Resiliency Extension's in-process restart, which this runtime "
              "does not use: a failed rank ends the job in one line (docs/failures.md); restart "
              "it with --load")
_FT = ("configures NVIDIA's fault-tolerance package, which this runtime does not use: lost "
       "ranks are found by --heartbeat-timeout and the job ends in one line")
_CPU_OFFLOAD = ("(the optimizer on the CPU) is not built here: the optimizer runs where the "
                "model is; shard its state with --use-distributed-optimizer")
_MUON = "configures the Muon optimizer, which is not built here (--optimizer adam or sgd)"
_PRECISION_AWARE = ("configures Transformer Engine's precision-aware optimizer, which this "
                    "runtime does not build: the main parameters, gradients and Adam's moments "
                    "are fp32 under --bf16/--fp16")
_RERUN = ("configures Megatron-LM's re-run state machine, which is not built here: a NaN or Inf "
          "in the loss or the gradients stops the run in one line "
          "(--no-check-for-nan-in-loss-and-grad trains on)")
_WEIGHT_DECAY_SCHEDULE = ("(a weight-decay schedule) is not built here: --weight-decay is "
                          "constant over the run")
_WSD = ("configures the warmup-stable-decay learning-rate schedule, which is not built here "
        "(--lr-decay-style constant, linear, cosine or inverse-square-root)")
_NON_PERSISTENT = ("(non-persistent or local checkpoints) is not built here: every save is a "
                   "checksummed checkpoint in --save, every --save-interval iterations")
_ASYNC = ("configures asynchronous saves, which are not built here: a save is one atomic, "
          "checksummed transaction that training waits for")
_CONVERT = ("(converting a checkpoint's format) is not built here: --load reads torch_dist and "
            "torch checkpoints, and --ckpt-format chooses what --save writes")
_FSDP_LOAD = "configures FSDP checkpoints; FSDP is not a layout here (Megatron-Core's DDP is)"
_ONE_LOGGER = ("configures NVIDIA's one_logger (internal E2E tracking), which is not used "
               "here; log with --tensorboard-dir or --wandb-project")
_STRAGGLER = ("configures Megatron-LM's straggler detector, which is not built here; "
              "--timing-log-option all prints every rank's timers")
_GRADS_DUMP = ("(dumping gradients to files) is not built here; --log-num-zeros-in-grad and the "
               "grad norm are logged")
_MEMORY_PROFILE = ("(torch's CUDA memory history) is not built here; --profile "
                   "--use-pytorch-profiler records the memory with its trace")

# ----------------------------------------------------------------------------------------------
# --help's "training" group
# ----------------------------------------------------------------------------------------------
REFUSED_TRAINING: dict[str, str] = {
    **each_refused(_RL, *"""--perform-rl-step --grpo-prompts-per-step --grpo-group-size
        --grpo-iterations --grpo-clamp-eps-lower --grpo-clamp-eps-upper --grpo-kl-beta
        --grpo-entropy-term-weight --grpo-filter-groups-with-same-reward --langrl-env-config
        --langrl-inference-server-type --langrl-inference-server-conversation-template
        --langrl-external-server --no-langrl-external-server --rl-default-temperature
        --rl-default-top-p --rl-default-top-k --rl-offload-optimizer-during-inference
        --rl-offload-kv-cache-during-training --no-rl-offload-kv-cache-during-training
        --rl-remove-kv-cache-during-training --no-rl-remove-kv-cache-during-training
        --rl-reset-cuda-graphs --no-rl-reset-cuda-graphs --rl-partial-rollouts
        --no-rl-partial-rollouts --rl-inference-logprobs-is-correction
        --no-rl-inference-logprobs-is-correction --rl-importance-sampling-truncation-coef
        --rl-use-sequence-packing --no-rl-use-sequence-packing --rl-sequence-packing-algo
        --rl-sequence-packing-max-sequences-per-bin --rl-training-cuda-graphs
        --no-rl-training-cuda-graphs --rl-inference-model-unified-memory-level
        --rl-offload-inference-model-weights-when-idle
        --no-rl-offload-inference-model-weights-when-idle --rl-parallel-generation-tasks
        --rl-prompts-per-eval --rl-verify-model-weights-swap --no-rl-verify-model-weights-swap
        --rl-skip-bos-token --no-rl-skip-bos-token --refit-method""".split()),
    **each_refused("selects Megatron-LM's supervised fine-tuning data (chat conversations), which is "
            "not built here: the data is pretraining documents (--data-path); fine-tune a "
            "checkpoint on them with --load DIR --finetune", "--sft",
            "--sft-tokenizer-prompt-format"),
    **each_refused(_INPROCESS, *"""--inprocess-restart --inprocess-max-iterations
        --inprocess-monitor-thread-interval --inprocess-monitor-process-interval
        --inprocess-progress-watchdog-interval --inprocess-heartbeat-interval
        --inprocess-soft-timeout --inprocess-hard-timeout --inprocess-heartbeat-timeout
        --inprocess-barrier-timeout --inprocess-completion-timeout --inprocess-last-call-wait
        --inprocess-termination-grace-time --inprocess-granularity
        --inprocess-active-world-size --inprocess-empty-cuda-cache""".split()),
    **each_refused(_FT, "--enable-ft-package", "--calc-ft-timeouts", "--ft-num-warmup-iters"),
    **each_refused("configures the ADLR cluster's autoresume service, which is not used here: on "
            "SIGTERM the run saves and exits (--exit-signal-handler), and --load resumes",
            "--adlr-autoresume", "--adlr-autoresume-interval"),
    **each_refused(_CPU_OFFLOAD, "--optimizer-cpu-offload", "--optimizer-offload-fraction",
            "--use-torch-optimizer-for-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d"),
    **each_refused(_MUON, "--muon-momentum", "--muon-use-nesterov", "--muon-no-split-qkv",
            "--muon-scale-mode", "--muon-fp32-matmul-prec", "--muon-num-ns-steps",
            "--muon-tp-mode", "--muon-extra-scale-factor"),
    **each_refused(_PRECISION_AWARE, "--use-precision-aware-optimizer", "--main-grads-dtype",
            "--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype"),
    **each_refused(_RERUN, "--error-injection-rate", "--error-injection-type", "--check-for-spiky-loss",
            "--result-rejected-tracker-filename"),
    "--check-for-large-grads": "(the re-run state machine's check for large gradients) is not "
                               "built here: --clip-grad bounds the gradient norm, and a NaN/Inf "
                               "stops the run",
    "--iterations-to-skip": "(skipping chosen iterations) is not built here: every iteration "
                            "trains",
    "--check-weight-hash-across-dp-replicas-interval":
        "is not built here: data-parallel replicas start equal and apply the same all-reduced "
        "gradients",
    **each_refused(_WEIGHT_DECAY_SCHEDULE, "--start-weight-decay", "--end-weight-decay",
            "--weight-decay-incr-style"),
    **each_refused(_WSD, "--lr-wsd-decay-style", "--lr-wsd-decay-samples", "--lr-wsd-decay-iters"),
    "--lr-warmup-init": "(a warmup that starts above 0) is not built here: the warmup rises "
                        "linearly from 0 to --lr",
    "--head-lr-mult": "(a learning rate of the output head of its own) is not built here: one "
                      "learning-rate schedule covers every parameter",
    "--no-weight-decay-cond-type": "is not built here: weight decay applies to the weights of "
                                   "rank 2 and more, not to biases and norms (Megatron-LM's "
                                   "default)",
    "--apply-wd-to-qk-layernorm": "is not built here: norms get no weight decay (and no model "
                                  "here has query/key norms)",
    "--dump-param-to-param-group-map": "(parameter groups from a file) is not built here: "
                                       "weight decay applies by Megatron-LM's default rule",
    "--batch-size": "is Megatron-LM's old spelling (it refuses it too): use --micro-batch-size",
    "--warmup": "is Megatron-LM's old spelling (it refuses it too): use --lr-warmup-fraction, "
                "--lr-warmup-iters or --lr-warmup-samples",
    "--checkpoint-activations": "is Megatron-LM's old spelling (it refuses it too): use "
                                "--recompute-activations, or --recompute-granularity and "
                                "--recompute-method",
    "--exit-signal": "(another signal to stop on) is not built here: SIGTERM and SIGINT stop "
                     "every rank after the same iteration (training/signals.py)",
    "--exit-signal-handler-for-dataloader": "is not built here: the data loader's workers "
                                            "(--num-workers) end with the training process",
    "--train-sync-interval": "is not built here: the host waits for the device where it reads "
                             "results (the logged iterations, the NaN check)",
    "--disable-gloo-process-groups": "is not built here: the runtime's checkpoint and start-up "
                                     "code use Megatron-Core's gloo process groups",
    "--full-validation": "is not built here: each evaluation runs --eval-iters batches",
    "--multiple-validation-sets": "is not built here: a blend of validation sets is evaluated "
                                  "as one, with one loss",
    "--test-mode": "(Megatron-LM's test hooks) does not apply here",
    "--run-workload-inspector-server": "(NVIDIA's workload inspector) is not built here; use "
                                       "--profile",
    "--logging-level": "is not a setting here: the trainer logs its iteration lines and "
                       "one-line errors only",
}

# ----------------------------------------------------------------------------------------------
# --help's "checkpointing" group
# ----------------------------------------------------------------------------------------------
REFUSED_CHECKPOINT: dict[str, str] = {
    **each_refused(_NON_PERSISTENT, "--non-persistent-save-interval", "--non-persistent-ckpt-type",
            "--non-persistent-global-ckpt-dir", "--non-persistent-local-ckpt-dir",
            "--non-persistent-local-ckpt-algo", "--replication", "--replication-jump",
            "--replication-factor", "--persistent-save-interval"),
    **each_refused(_ASYNC, "--use-persistent-ckpt-worker", "--ckpt-assume-constant-structure"),
    **each_refused(_CONVERT, "--ckpt-convert-format", "--ckpt-convert-save",
            "--ckpt-convert-update-legacy-dist-opt-format"),
    **each_refused(_FSDP_LOAD, "--no-strict-fsdp-dtensor-load", "--disable-strict-fsdp-dtensor-load"),
    **each_refused("is not built here: a torch_dist save splits the writing across data-parallel "
            "replicas (Megatron-LM's default), always", "--no-ckpt-fully-parallel-save",
            "--disable-ckpt-fully-parallel-save"),
    "--ckpt-fully-parallel-load": "is not built here: --load reads with Megatron-Core's default "
                                  "strategy, each rank its own shards",
    "--dist-ckpt-optim-fully-reshardable": "is not built here: the optimizer's state in a "
                                           "torch_dist checkpoint reshards across data-parallel "
                                           "sizes (Megatron-LM's default); the model reshards "
                                           "across tensor and pipeline layouts",
    "--distrib-optim-fully-reshardable-mem-efficient": "tunes "
                                                       "--dist-ckpt-optim-fully-reshardable, "
                                                       "which is not built here",
    "--dist-ckpt-save-pre-mcore-014": "(the checkpoint layout of Megatron-Core before 0.14) is "
                                      "not built here: saves use Megatron-Core 0.16's",
    "--ckpt-step": "(loading a chosen iteration) is not a flag here: point --load at that "
                   "iteration's folder, SAVE/iter_NNNNNNN",
    "--pretrained-checkpoint": "is not built here: fine-tune with --load DIR --finetune",
    "--load-main-params-from-ckpt": "is not built here: with --no-load-optim the fp32 main "
                                    "parameters are taken from the loaded model",
    "--use-mp-args-from-checkpoint-args": "is not built here: give the parallel layout on the "
                                          "command line (a torch_dist checkpoint loads at "
                                          "another one)",
    "--save-retain-interval": "is not built here: every checkpoint saved is kept",
    **each_refused(_GRADS_DUMP, "--save-wgrads-interval", "--save-dgrads-interval"),
}

# ----------------------------------------------------------------------------------------------
# --help's "logging and evaluation" group
# ----------------------------------------------------------------------------------------------
REFUSED_LOGGING: dict[str, str] = {
    **each_refused(_ONE_LOGGER, "--one-logger-project", "--one-logger-run-name", "--one-logger-async",
            "--app-tag-run-name", "--app-tag-run-version"),
    **each_refused(_STRAGGLER, "--log-straggler", "--disable-straggler-on-startup",
            "--straggler-ctrlr-port", "--straggler-minmax-count"),
    "--log-energy": "(energy from NVML) is not built here",
    "--log-device-memory-used": "(nvidia-smi's memory) is not built here; "
                                "--log-memory-to-tensorboard logs the CUDA caching allocator",
    "--log-memory-interval": "is not built here; --log-memory-to-tensorboard logs the CUDA "
                             "caching allocator at every --tensorboard-log-interval",
    "--log-max-attention-logit": "(for --qk-clip) is not built here",
    "--log-progress": "(progress.txt of tokens and FLOPs) is not built here; --log-throughput "
                      "logs the TFLOP/s",
}

# ----------------------------------------------------------------------------------------------
# --help's "profiling" group
# ----------------------------------------------------------------------------------------------
REFUSED_PROFILE: dict[str, str] = {
    **each_refused(_MEMORY_PROFILE, "--record-memory-history", "--memory-snapshot-path"),
}

# ----------------------------------------------------------------------------------------------
# Flags that state what always holds here (flag_errors.StatedFlag)
# ----------------------------------------------------------------------------------------------
STATED_TRAINING: dict[str, StatedFlag] = {
    "--rerun-mode": StatedFlag(
        holds="Megatron-LM's re-run state machine is not used: a NaN or Inf in the loss or "
              "the gradients stops the run in one line",
        values=("disabled",),
        otherwise="(re-running iterations to check results) is not built here: a NaN or Inf "
                  "stops the run"),
    "--no-pin-cpu-grads": StatedFlag(
        holds="no CPU memory is pinned for gradients (there is no optimizer CPU offload)"),
    "--no-pin-cpu-params": StatedFlag(
        holds="no CPU memory is pinned for parameters (there is no optimizer CPU offload)"),
}
STATED_CHECKPOINT: dict[str, StatedFlag] = {
    "--ckpt-fully-parallel-save": StatedFlag(
        holds="a torch_dist save splits the writing across data-parallel replicas (Megatron-LM "
              "0.16's default, where the flag is deprecated)"),
    "--dist-ckpt-strictness": StatedFlag(
        holds="a --load of a torch_dist checkpoint that lacks a tensor of this run stops in one "
              "line before reading, and tensors of the checkpoint this run does not ask for "
              "(the optimizer's under --no-load-optim) are left unread",
        values=("assume_ok_unexpected", "raise_unexpected"),
        otherwise="(logging, returning or ignoring mismatched tensors, or refusing unread ones) "
                  "is not built here: a tensor the checkpoint lacks stops the load"),
    "--no-use-tokenizer-model-from-checkpoint-args": StatedFlag(
        holds="the tokenizer comes from this command line, never from a checkpoint's arguments"),
    "--disable-use-tokenizer-model-from-checkpoint-args": StatedFlag(
        holds="the tokenizer comes from this command line, never from a checkpoint's arguments"),
}
STATED_LOGGING: dict[str, StatedFlag] = {
    "--no-one-logger": StatedFlag(holds="NVIDIA's one_logger is never used"),
}
