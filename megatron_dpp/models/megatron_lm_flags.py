"""Megatron-LM's model flags for what this runtime does not build (mixture of experts,
multi-latent attention, Mamba, FP8/FP4, inference, vision and retrieval models, ...): flag -> why,
in one line with what to use instead. models/flags.py adds them to --help's "model" group and
refuses each in one line (flag_errors.py); each takes Megatron-LM's values, if any, so that the
refusal, not argparse, answers. The parallelism group's are parallel/megatron_lm_flags.py's.

Also the flags of that group that state what always holds here (flag_errors.StatedFlag).
Standard library only, as models/flags.py.
"""
from __future__ import annotations

from megatron_dpp.flag_errors import StatedFlag, each_refused


_MODELS = "the models here are gpt, bert and llama (--model)"
_DENSE = "train a dense model (gpt, bert or llama)"
_MOE = f"(mixture-of-experts layers) is not supported by this runtime: {_MODELS}, whose MLPs " \
       f"are dense; drop the MoE flags and {_DENSE}"
_MLA = ("(multi-latent attention, DeepSeek's) is not built here: attention is Megatron-Core's "
        "multi-head or grouped-query self-attention (llama: --num-query-groups)")
_FP8 = ("needs Transformer Engine's FP8 layers, which this runtime does not build (train with "
        "--bf16 or --fp16)")
_FP4 = ("needs Transformer Engine's FP4 layers, which this runtime does not build (train with "
        "--bf16 or --fp16)")
_KITCHEN = ("configures NVIDIA Kitchen's quantized layers, which this runtime does not build "
            "(train with --bf16 or --fp16; attention: --attention-backend)")
_INFERENCE = ("configures Megatron-LM's inference (text generation) engine; this runtime trains "
              "only (evaluation: --eval-interval, --eval-iters)")
_VISION = f"configures Megatron-LM's vision models (ViT, DINO, Swin); {_MODELS}"
_RETRIEVAL = f"configures Megatron-LM's retrieval models (ICT, the REALM biencoder); {_MODELS}"
_ENCODER_DECODER = (f"configures an encoder-decoder model (T5); {_MODELS}, one stack of layers: "
                    f"give its depth with --num-layers and its length with --seq-length")
_MAMBA = (f"(Mamba and hybrid state-space layers) is not built here: every layer is a transformer "
          f"layer; {_MODELS}")
_ATTENTION_VARIANT = ("(experimental attention variants: gated delta net, DeepSeek sparse "
                      "attention and its indexer) is not built here: attention is full softmax "
                      "self-attention")
_MTP = "(multi-token prediction layers) is not built here: the models predict the next token only"
_HETEROGENEOUS = ("(a shape of its own for each layer) is not built here: every layer has the "
                  "shape of --hidden-size, --ffn-hidden-size and --num-attention-heads")
_ACTIVATION = ("(another MLP activation) is not built here: the MLP is GeLU (gpt, bert) or "
               "SwiGLU (llama)")
_ROTARY_VARIANT = ("(a variant of rotary position embeddings) is not built here: rotary "
                   "embeddings rotate the two halves of every head, in every layer, without "
                   "interpolation (--rotary-base, --use-rope-scaling for Llama 3.1's scaling)")
_OFFLOAD = ("(activation offloading to the CPU) is not built here: save activation memory with "
            "--recompute-activations or --recompute-granularity full")
_CUDA_GRAPH_TE = ("configures Transformer Engine's or whole-iteration CUDA graphs; the graphs here "
                  "are --cuda-graph-impl local's, one per transformer layer")
# ----------------------------------------------------------------------------------------------
# --help's "model" group
# ----------------------------------------------------------------------------------------------
REFUSED_MODEL: dict[str, str] = {
    **each_refused(_MOE, *"""--moe-apply-probs-on-input --moe-aux-loss-coeff --moe-deepep-num-sms
        --moe-enable-deepep --moe-enable-routing-replay --moe-expert-capacity-factor
        --moe-extended-tp --moe-ffn-hidden-size --moe-flex-dispatcher-backend --moe-grouped-gemm
        --moe-hybridep-num-sms --moe-input-jitter-eps --moe-latent-size --moe-layer-freq
        --moe-layer-recompute --moe-pad-expert-input-to-capacity
        --moe-pad-experts-for-cuda-graph-inference --moe-per-layer-logging --moe-permute-fusion
        --moe-router-bias-update-rate --moe-router-dtype --moe-router-enable-expert-bias
        --moe-router-force-load-balancing --moe-router-fusion --moe-router-group-topk
        --moe-router-load-balancing-type --moe-router-num-groups --moe-router-padding-for-fp8
        --moe-router-padding-for-quantization --moe-router-pre-softmax
        --moe-router-score-function --moe-router-topk --moe-router-topk-scaling-factor
        --moe-shared-expert-gate --moe-shared-expert-intermediate-size --moe-shared-expert-overlap
        --moe-token-dispatcher-type --moe-token-drop-policy --moe-upcycling-granularity
        --moe-use-legacy-grouped-gemm --moe-use-upcycling --moe-z-loss-coeff
        --use-fused-weighted-squared-relu""".split()),
    **each_refused(_MLA, *"""--multi-latent-attention --q-lora-rank --kv-lora-rank --qk-head-dim
        --qk-pos-emb-head-dim --v-head-dim --mscale --mscale-all-dim --rotary-scaling-factor
        --cache-mla-latents""".split()),
    "--rope-type": "chooses between rotary embeddings (rope) and YaRN (multi-latent attention's "
                   "default); YaRN is not built here and rotary embeddings need no flag (llama "
                   "has them): remove it",
    **each_refused(_FP8, *"""--fp8-recipe --fp8-margin --fp8-interval --fp8-quantizer-factory
        --first-last-layers-bf16 --num-layers-at-start-in-bf16 --num-layers-at-end-in-bf16
        --disable-fp8-wgrad --no-fp8-wgrad --reuse-grad-buf-for-mxfp8-param-ag""".split()),
    **each_refused(_FP4, "--fp4-format", "--fp4-recipe", "--fp4-param-gather", "--fp4-quantizer-factory"),
    **each_refused(_KITCHEN, "--use-kitchen-attention", "--kitchen-attention-backend",
            "--kitchen-config-file", "--kitchen-recipe-number"),
    "--te-precision-config-file": "chooses Transformer Engine's precision per module, and this "
                                  "runtime builds no Transformer Engine FP8/FP4 layers (train "
                                  "with --bf16 or --fp16)",
    "--use-te-activation-func": "needs Transformer Engine's MLP activations; the MLP here is "
                                "Megatron-Core's (its bias-activation fusion: "
                                "--bias-gelu-fusion, --bias-swiglu-fusion)",
    "--te-rng-tracker": "is Transformer Engine's RNG tracker, which Transformer Engine's CUDA "
                        "graphs need; the RNG here is Megatron-Core's tracker (--seed), and "
                        "--cuda-graph-impl local needs no other",
    **each_refused(_INFERENCE, *"""--inference-batch-times-seqlen-threshold --inference-coordinator-port
        --inference-dynamic-batching --inference-dynamic-batching-block-size
        --inference-dynamic-batching-buffer-size-gb
        --inference-dynamic-batching-cuda-graph-max-tokens
        --inference-dynamic-batching-cuda-graph-mixed-prefill-count
        --inference-dynamic-batching-max-requests --inference-dynamic-batching-max-tokens
        --inference-dynamic-batching-num-cuda-graphs
        --inference-dynamic-batching-paused-buffer-size-gb
        --inference-dynamic-batching-track-paused-request-events
        --inference-dynamic-batching-unified-memory-level --inference-fuse-tp-communication
        --inference-logging-step-interval --inference-max-batch-size --inference-max-requests
        --inference-max-seq-length --inference-rng-tracker --inference-wandb-logging
        --no-inference-wandb-logging --flash-decode --enable-chunked-prefill
        --disable-chunked-prefill --mlp-chunks-for-prefill --nccl-all-reduce-for-prefill
        --decode-only-cuda-graphs --use-legacy-static-engine --max-tokens-to-oom""".split()),
    **each_refused(_VISION, *"""--img-h --img-w --num-channels --patch-dim --num-classes
        --classes-fraction --data-per-class-fraction --vision-pretraining
        --vision-pretraining-type --vision-backbone-type --swin-backbone-type --mask-type
        --mask-factor --iter-per-epoch --dino-local-img-size --dino-local-crops-number
        --dino-head-hidden-size --dino-bottleneck-size --dino-freeze-last-layer
        --dino-norm-last-layer --dino-warmup-teacher-temp --dino-teacher-temp
        --dino-warmup-teacher-temp-epochs""".split()),
    **each_refused(_RETRIEVAL, *"""--ict-head-size --biencoder-projection-dim
        --biencoder-shared-query-context-model --ict-load --bert-load --titles-data-path
        --query-in-block-prob --use-one-sent-docs --evidence-data-path
        --retriever-report-topk-accuracies --retriever-score-scaling --block-data-path
        --embedding-path --indexer-batch-size --indexer-log-interval --bert-embedder-type
        --output-bert-embeddings""".split()),
    **each_refused(_ENCODER_DECODER, "--encoder-num-layers", "--decoder-num-layers",
            "--encoder-seq-length", "--decoder-seq-length", "--relative-attention-num-buckets",
            "--relative-attention-max-distance"),
    **each_refused(_MAMBA, "--is-hybrid-model", "--hybrid-attention-ratio", "--hybrid-mlp-ratio",
            "--hybrid-override-pattern", "--mamba-state-dim", "--mamba-head-dim",
            "--mamba-num-groups", "--mamba-num-heads", "--disable-mamba-mem-eff-path"),
    **each_refused(_ATTENTION_VARIANT, *"""--experimental-attention-variant --linear-attention-freq
        --linear-conv-kernel-dim --linear-key-head-dim --linear-num-key-heads
        --linear-num-value-heads --linear-value-head-dim --dsa-indexer-head-dim
        --dsa-indexer-loss-coeff --dsa-indexer-n-heads --dsa-indexer-topk
        --dsa-indexer-use-sparse-loss""".split()),
    **each_refused(_MTP, "--mtp-num-layers", "--mtp-loss-scaling-factor", "--mtp-standalone"),
    **each_refused(_HETEROGENEOUS, "--heterogeneous-layers-config-path",
            "--heterogeneous-layers-config-encoded-json"),
    **each_refused(_ACTIVATION, "--openai-gelu", "--quick-geglu", "--activation-func-clamp-value",
            "--glu-linear-offset"),
    **each_refused(_ROTARY_VARIANT, "--rotary-interleaved", "--rotary-seq-len-interpolation-factor",
            "--no-rope-freq", "--mrope-section"),
    **each_refused("(sliding-window attention) is not built here: attention is full (causal for gpt "
            "and llama) over --seq-length", "--window-size", "--window-attn-skip-freq"),
    "--attention-output-gate": "(a gate on the attention output) is not built here: attention "
                               "is Megatron-Core's standard self-attention",
    "--qk-l2-norm": "(Llama 4's L2 norm of queries and keys) is not built here",
    **each_refused("(clipping the query and key weights, for Muon-trained models) is not built here",
            "--qk-clip", "--qk-clip-alpha", "--qk-clip-threshold"),
    "--apply-residual-connection-post-layernorm":
        "(the original BERT's residual order) is not built here: every model is pre-LayerNorm "
        "(Megatron-Core's default), bert included",
    "--fp32-residual-connection": "(an fp32 residual stream under --bf16/--fp16) is not built "
                                  "here: the residual stream is in the model's precision",
    "--fp16-lm-cross-entropy": "(the loss computed from fp16 logits) is not built here: the "
                               "cross entropy runs in fp32 (--cross-entropy-loss-fusion fuses it)",
    "--embedding-init-method-std": "(an initialization of the embeddings of its own) is not "
                                   "built here: --init-method-std initializes every weight",
    "--init-method-xavier-uniform": "(Xavier-uniform initialization) is not built here: weights "
                                    "are initialized from a normal of --init-method-std",
    "--no-initialization": "is not built here: the parameters are always initialized, and --load "
                           "then overwrites them",
    "--init-model-with-meta-device": "(building the model without memory, for FSDP) is not "
                                     "built here: the model is built on its device, or on the "
                                     "CPU with --use-cpu-initialization",
    "--data-parallel-random-init": "is not built here: every data-parallel replica starts from "
                                   "the same parameters (the seed is shared)",
    "--onnx-safe": "(workarounds for the ONNX exporter) does not apply: this runtime does not "
                   "export models",
    "--batch-invariant-mode": "(Megatron-Core's batch-invariant kernels) needs Triton's kernels, "
                              "which this runtime does not build; remove it",
    "--disable-bf16-reduced-precision-matmul":
        "is not built here: torch's default for bf16 matmuls (reduced-precision reductions "
        "allowed) holds",
    **each_refused(_OFFLOAD, "--cpu-offloading-num-layers", "--fine-grained-activation-offloading",
            "--offload-modules", "--min-offloaded-tensor-size"),
    "--recompute-modules": "(recomputing chosen submodules) is not built here: "
                           "--recompute-granularity selective recomputes core attention, full "
                           "whole layers",
    **each_refused(_CUDA_GRAPH_TE, "--cuda-graph-scope", "--cuda-graph-warmup-steps",
            "--external-cuda-graph"),
    "--enable-cuda-graph": "is Megatron-LM's deprecated spelling: use --cuda-graph-impl local",
    "--spec": "(a layer spec from a Python function of its own) is not built here: each --model "
              "builds its own Megatron-Core layer spec (local or Transformer Engine layers: "
              "--transformer-impl)",
    "--use-legacy-models": "is not built here: the models are always Megatron-Core's "
                           "(--use-mcore-models states it)",
    "--config-logger-dir": "(dumping the entry point's config objects) is not built here: the "
                           "startup lines print the run's settings",
    "--disable-jit-fuser": "is not a switch here: the torch.compile'd fusions are chosen by "
                           "--no-bias-gelu-fusion, --no-bias-swiglu-fusion and "
                           "--no-bias-dropout-fusion (off on CPU)",
    "--yaml-cfg": "(a YAML file of arguments) is not read here: give the flags on the command "
                  "line",
    "--enable-experimental": "(Megatron-Core's experimental features) is not built here",
}

# ----------------------------------------------------------------------------------------------
# Flags that state what always holds here (flag_errors.StatedFlag)
# ----------------------------------------------------------------------------------------------
STATED_MODEL: dict[str, StatedFlag] = {
    "--softmax-type": StatedFlag(
        holds="attention's softmax is the standard one (Megatron-LM's vanilla)",
        values=("vanilla",),
        otherwise="(off-by-one or learnable softmax) needs Transformer Engine's fused "
                  "attention, which this runtime does not build for it"),
}
