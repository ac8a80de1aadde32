"""Megatron-LM's parallelism flags for what this runtime does not build (expert parallelism,
FSDP, context parallelism, Transformer Engine's communication overlap, NCCL tuning, ...): flag ->
why, in one line with what to use instead. parallel/flags.py adds them to --help's "parallelism"
group and refuses each in one line (flag_errors.py); each takes Megatron-LM's values, if any, so that
the refusal, not argparse, answers.

Also the flags of that group that state what always holds here (flag_errors.StatedFlag). Standard
library only, as parallel/flags.py.
"""
from __future__ import annotations

from megatron_dpp.flag_errors import StatedFlag, each_refused


_TP_OVERLAP = ("tunes --tp-comm-overlap, Transformer Engine's userbuffer overlap of "
               "tensor-parallel communication with GEMMs, which this runtime does not set up")
_FSDP = ("(FSDP) is not a layout here: data parallelism is Megatron-Core's DDP, with "
         "--use-distributed-optimizer to shard the optimizer's state")
_CONTEXT_PARALLEL = ("configures context parallelism, which this runtime does not support (only "
                     "--context-parallel-size 1 runs: it needs Transformer Engine's attention and "
                     "a data split along the sequence)")
_EXPERT_PARALLEL = ("(expert parallelism) needs mixture-of-experts layers: (mixture-of-experts "
                    "layers) is not supported by this runtime: the models here are gpt, bert and "
                    "llama (--model), whose MLPs are dense; drop the MoE flags and train a dense "
                    "model (gpt, bert or llama)")
_NCCL_TUNING = ("tunes NCCL communicators and buffers that this runtime creates with "
                "torch.distributed's defaults (NCCL's environment variables still apply)")


# ----------------------------------------------------------------------------------------------
# --help's "parallelism" group
# ----------------------------------------------------------------------------------------------
REFUSED_PARALLEL: dict[str, str] = {
    **each_refused(_EXPERT_PARALLEL, "--expert-model-parallel-size", "--expert-tensor-parallel-size",
            "--overlap-moe-expert-parallel-comm", "--ep-overlap-early-attn-memory-release",
            "--rl-inference-expert-model-parallel-size"),
    **each_refused(_FSDP, *"""--use-megatron-fsdp
        --outer-dp-sharding-strategy --enable-full-sharding-in-hsdp --fsdp-double-buffer
        --fsdp-manual-registration --suggested-communication-unit-size --keep-fp8-transpose-cache
        --torch-fsdp2-no-reshard-after-forward""".split()),
    **each_refused(_CONTEXT_PARALLEL, "--cp-comm-type", "--hierarchical-context-parallel-sizes",
            "--hybrid-context-parallel", "--max-seqlen-per-dp-cp-rank"),
    **each_refused(_TP_OVERLAP, "--no-tp-comm-overlap-ag", "--disable-tp-comm-overlap-ag",
            "--no-tp-comm-overlap-rs", "--disable-tp-comm-overlap-rs", "--tp-comm-overlap-rs-dgrad",
            "--no-tp-comm-split-ag", "--no-tp-comm-split-rs", "--no-tp-comm-bulk-dgrad",
            "--no-tp-comm-bulk-wgrad", "--tp-comm-bootstrap-backend"),
    "--disable-async-tensor-model-parallel-allreduce":
        "is ignored by Megatron-Core 0.16 (deprecated): the tensor-parallel all-reduce always "
        "runs asynchronously beside the weight-gradient GEMM",
    **each_refused(_NCCL_TUNING, "--nccl-communicator-config-path", "--high-priority-stream-groups",
            "--use-sharp", "--sharp-enabled-group", "--use-nccl-ub",
            "--disable-symmetric-registration", "--symmetric-ar-type",
            "--create-all-gather-group"),
    "--pipeline-model-parallel-comm-backend": "is not a choice here: pipeline messages go over "
                                              "--p2p-transport (shm, torch, rdma, auto)",
    "--use-tp-pp-dp-mapping": "(another rank order) is not built here: ranks are ordered as "
                              "Megatron-Core's default, tensor-parallel first, then data, then "
                              "pipeline",
    "--num-distributed-optimizer-instances": "(several distributed-optimizer copies across the "
                                             "data-parallel ranks) is not built here: "
                                             "--use-distributed-optimizer shards over all of them",
    "--overlap-param-gather-with-optimizer-step":
        "is not built here (Megatron-LM allows it with the interleaved schedule and Megatron-"
        "Core's distributed optimizer on GPUs only): --overlap-param-gather overlaps the "
        "all-gather with the next forward",
    "--defer-embedding-wgrad-compute": "(deferring the output layer's weight gradients into the "
                                       "pipeline flush) is not built here; --use-dpp "
                                       "--dpp-split-backward defers every weight gradient",
    "--wgrad-deferral-limit": "tunes --defer-embedding-wgrad-compute, which is not built here; "
                              "--use-dpp --dpp-split-backward defers every weight gradient",
    "--delay-wgrad-compute": "(Transformer Engine's delayed weight gradients, for expert-parallel "
                             "overlap) is not built here; --use-dpp --dpp-split-backward defers "
                             "every weight gradient",
    "--overlap-p2p-communication-warmup-flush":
        "is not built here: Megatron's interleaved schedule overlaps its sends in the steady "
        "phase (--no-overlap-p2p-communication turns that off); --use-dpp overlaps all of them",
    "--distributed-timeout-seconds-after-init":
        "is not built here: --distributed-timeout-minutes is the timeout of every process group, "
        "during initialization and after",
    "--fake-process-group": "(skipping all communication) is not built here: every rank "
                            "communicates; run one rank (WORLD_SIZE=1) to train alone",
    "--lazy-mpu-init": "is Megatron-LM's hook for an external launcher; the ranks here initialize "
                       "their process groups themselves",
    "--model-parallel-size": "is Megatron-LM's old spelling (it refuses it too): use "
                             "--tensor-model-parallel-size",
    "--rl-inference-tensor-model-parallel-size":
        "configures Megatron-LM's reinforcement-learning inference; this runtime trains only",
    "--rl-inference-pipeline-model-parallel-size":
        "configures Megatron-LM's reinforcement-learning inference; this runtime trains only",
    "--rl-inference-expert-tensor-model-parallel-size":
        "configures Megatron-LM's reinforcement-learning inference; this runtime trains only",
    "--ddp-reduce-scatter-with-fp32-accumulation":
        "(a reduce-scatter that sends 16-bit values and accumulates in fp32) is not built here: "
        "under --bf16/--fp16 the gradients are reduced in fp32",
    "--ddp-average-in-collective": "(averaging inside the collective, ReduceOp.AVG) is not built "
                                   "here: the gradients are scaled by 1/data-parallel size and "
                                   "summed (gloo has no AVG)",
    "--no-gradient-reduce-div-fusion": "is not built here: the gradients are scaled by "
                                       "1/data-parallel size before they are summed, as "
                                       "Megatron-Core does by default",
}

STATED_PARALLEL: dict[str, StatedFlag] = {
    "--data-parallel-sharding-strategy": StatedFlag(
        holds="data parallelism replicates the parameters and gradients on every data-parallel "
              "rank (Megatron-Core's DDP; --use-distributed-optimizer shards the optimizer's "
              "state), Megatron-LM's default",
        values=("no_shard",),
        otherwise=_FSDP),
    "--no-align-param-gather": StatedFlag(
        holds="without --delay-param-gather, the forward pre-hooks launch each bucket's "
              "parameter all-gather when its chunk needs it, not at aligned points across "
              "pipeline stages"),
}
