"""The parallel layout's flags (--help's "parallelism" group) and their checks.

`validate_parallel_args` checks the flags and returns the layout they imply, a frozen
ParallelLayout (parallel/layout.py): the data-parallel size, the virtual stages, the parsed
--pipeline-model-parallel-layout, the interleaved order's group size, whether sequence parallelism
runs, the process groups' backend. It writes nothing onto the flags; megatron_dpp.arguments keeps
the result as `args.parallel`. The layer split's rules are parallel/split.py's.

Torch-free, as the launcher's flag check is: whether there is a CUDA GPU comes from
megatron_dpp.cuda_presence.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Optional

from megatron_dpp.cuda_presence import cuda_available
from megatron_dpp.flag_errors import (ArgsError, add_refused_flags, add_stated_flags, first_given,
                                      require)
from megatron_dpp.kernels import TRANSFORMER_ENGINE, core_attention_from_args
from megatron_dpp.parallel import megatron_lm_flags
from megatron_dpp.parallel.layout import ParallelLayout
from megatron_dpp.parallel.split import (EMBEDDING_FLAG, FIRST_FLAG, LAST_FLAG, LAYOUT_FLAG,
                                         LOSS_FLAG, PipelineSplit, layout_layers)
from megatron_dpp.shared_gpu import ranks_per_gpu, shared_gpu_backend

_TP_COMM_OVERLAP = ("Transformer Engine's userbuffer overlap of tensor-parallel communication with "
                    "GEMMs, which this runtime does not set up (Megatron-LM's initialize_ub step)")
# Megatron-LM's parallelism flags that cannot apply here: flag -> why (flag_errors.py).
REFUSED_PARALLEL_FLAGS: dict[str, str] = {
    "--pipeline-model-parallel-split-rank":
        "splits an encoder-decoder model's pipeline between encoder and decoder ranks; GPT and "
        "BERT are one stack of layers with no such split",
    "--use-ring-exchange-p2p":
        "needs torch.distributed.ring_exchange, which only custom PyTorch builds have (stock "
        "PyTorch, this one included, has none)",
    "--no-async-tensor-model-parallel-allreduce":
        "is ignored by Megatron-Core 0.16 (ModelParallelConfig.async_tensor_model_parallel_allreduce "
        "is deprecated): the tensor-parallel all-reduce always runs asynchronously beside the "
        "weight-gradient GEMM",
    "--use-torch-fsdp2": "(FSDP) is not a layout here: data parallelism is Megatron-Core's DDP, "
                         "with --use-distributed-optimizer to shard the optimizer's state",
    "--num-experts": "(mixture-of-experts layers) is in none of the models here (gpt, bert, llama)",
    "--tp-comm-overlap": f"needs {_TP_COMM_OVERLAP}",
    "--tp-comm-overlap-cfg": f"configures --tp-comm-overlap, {_TP_COMM_OVERLAP}",
    **{flag: f"tunes --tp-comm-overlap, {_TP_COMM_OVERLAP}"
       for flag in ("--disable-tp-comm-split-ag", "--disable-tp-comm-split-rs",
                    "--disable-tp-comm-bulk-dgrad", "--disable-tp-comm-bulk-wgrad")},
    **megatron_lm_flags.REFUSED_PARALLEL,
}



GROUP_SIZE_FLAG = "--microbatch-group-size-per-virtual-pipeline-stage"


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("parallelism")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1,
                       help="Degree of tensor model parallelism.")
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                       help="Degree of pipeline model parallelism.")
    group.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                       help="Layers per virtual pipeline stage (enables the interleaved schedule).")
    group.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                       help="Virtual pipeline stages (model chunks) per pipeline rank; an alternative "
                            "to --num-layers-per-virtual-pipeline-stage.")
    group.add_argument(GROUP_SIZE_FLAG, type=int, default=None, metavar="N",
                       dest="microbatch_group_size_per_vp_stage",
                       help="Interleaved schedule (virtual pipeline stages): each model chunk "
                            "runs N consecutive micro-batches before the rank moves to its next "
                            "chunk, forwards and backwards alike (Megatron-Core's "
                            "microbatch_group_size_per_vp_stage). Default: "
                            "--pipeline-model-parallel-size, the depth-first order. N must be at "
                            "least the pipeline size and at most the micro-batches per step, and "
                            "the last group (micro-batches mod N) empty or at least the pipeline "
                            "size, so a group larger than the pipeline trains micro-batch counts "
                            "that are not a multiple of it. Also sets --use-dpp's interleaved "
                            "order and its default memory budget.")
    group.add_argument(FIRST_FLAG, type=int, default=None, metavar="N",
                       help="Transformer layers on the first pipeline stage (which also runs the "
                            "embedding); the stages without a count given share the other layers "
                            "evenly. Default: an even split. With virtual stages, a multiple of "
                            "--num-virtual-stages-per-pipeline-rank.")
    group.add_argument(LAST_FLAG, type=int, default=None, metavar="N",
                       help="Transformer layers on the last pipeline stage (which also runs the "
                            "output layer and the loss); as " + FIRST_FLAG + ".")
    group.add_argument(EMBEDDING_FLAG, action="store_true",
                       help="Split evenly with the embedding counted as one layer: the first "
                            "stage builds one transformer layer less (--num-layers + 1 must divide "
                            "by the pipeline stages). Not with " + FIRST_FLAG + " / " + LAST_FLAG
                            + ".")
    group.add_argument(LOSS_FLAG, action="store_true",
                       help="Split evenly with the output layer and loss counted as one layer: "
                            "the last stage builds one transformer layer less; as "
                            + EMBEDDING_FLAG + ".")
    group.add_argument(LAYOUT_FLAG, type=str, default=None, metavar="LAYOUT",
                       help="Every pipeline stage's layers spelled out, as Megatron-LM: E the "
                            "embedding, t a transformer layer, L the loss, stages split by |, "
                            "(...)*n and x*n repeat, commas are cosmetic. More stages than "
                            "--pipeline-model-parallel-size make virtual stages, in order: stage "
                            "k goes to pipeline rank k mod PP. E.g. Et|tt|t|tL: 4 layers on 2 "
                            "ranks, 2 virtual stages each. Not with the other split flags or the "
                            "virtual-stage flags.")
    group.add_argument("--sequence-parallel", action="store_true",
                       help="Enable sequence parallelism (only has an effect with tensor parallelism, "
                            "as in Megatron-LM).")
    group.add_argument("--use-distributed-optimizer", action="store_true",
                       help="Shard optimizer state across data-parallel ranks.")
    group.add_argument("--overlap-grad-reduce", action="store_true",
                       help="Overlap the data-parallel gradient reduction with backward.")
    group.add_argument("--ddp-bucket-size", type=int, default=None, metavar="N",
                       help="With --overlap-grad-reduce: gradient elements per bucket, each "
                            "reduced as soon as backward has filled it (default Megatron-Core's: "
                            "max(40M, 1M x data-parallel size)). Without --overlap-grad-reduce "
                            "all gradients are one bucket, so it needs that flag.")
    group.add_argument("--ddp-num-buckets", type=int, default=None, metavar="N",
                       help="--ddp-bucket-size as a number of buckets: this rank's parameters / N "
                            "elements each (Megatron-LM's); not with --ddp-bucket-size.")
    group.add_argument("--ddp-pad-buckets-for-high-nccl-busbw", action="store_true",
                       help="With --use-distributed-optimizer: pad each gradient bucket to a "
                            "multiple of 2**16 elements (and of the data-parallel size) instead "
                            "of 128, so that NCCL's ring collectives keep a high bus bandwidth at "
                            "large data-parallel sizes (Megatron-Core's "
                            "pad_buckets_for_high_nccl_busbw).")
    group.add_argument("--local-rank", type=int, default=None, metavar="N",
                       help="Accepted for Megatron-LM command lines (torch.distributed.launch "
                            "passes it); always so here: each rank's device is the one of its "
                            "LOCAL_RANK (torchrun's), which N must equal.")
    group.add_argument("--distributed-backend", type=str, default=None, choices=["nccl", "gloo"],
                       help="torch.distributed backend (default: nccl with CUDA, gloo without).")
    group.add_argument("--distributed-timeout-minutes", type=int, default=10,
                       help="Timeout for collective operations, in minutes.")
    group.add_argument("--use-cpu-initialization", action="store_true", default=None,
                       help="Initialize parameters on the CPU (then move them to the device).")
    group.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                       help="Call torch.cuda.empty_cache() each iteration: 0 off, 1 after the "
                            "forward-backward, 2 also after the optimizer step. GPU only.")
    group.add_argument("--context-parallel-size", type=int, default=1,
                       help="Degree of context parallelism. Only 1 runs here: context parallelism "
                            "needs Transformer Engine's attention and a data path that gives each "
                            "context-parallel rank its part of every sequence, which this runtime "
                            "does not have.")
    group.add_argument("--no-delay-grad-reduce", "--no-align-grad-reduce", action="store_false",
                       dest="delay_grad_reduce",
                       help="With --overlap-grad-reduce: every pipeline stage's DDP hooks start its "
                            "gradient reductions during its last backward, instead of the schedule "
                            "delaying them in all but the first stage and launching them at aligned "
                            "points (Megatron-Core's grad_sync_func; Megatron-LM's later name is "
                            "--no-align-grad-reduce). Without --overlap-grad-reduce nothing is "
                            "overlapped, so nothing is delayed.")
    group.add_argument("--overlap-param-gather", action="store_true",
                       help="With --use-distributed-optimizer and --overlap-grad-reduce: gather the "
                            "updated parameters during the next forward (DDP forward pre-hooks wait "
                            "for each bucket's all-gather) instead of at the end of the optimizer "
                            "step (Megatron-Core's overlap_param_gather).")
    group.add_argument("--delay-param-gather", action="store_true",
                       help="With --overlap-param-gather and virtual pipeline stages or --use-dpp: "
                            "the schedule launches each model chunk's parameter all-gathers at "
                            "aligned points across pipeline stages instead of the forward pre-hooks "
                            "launching them on demand (Megatron-Core's align_param_gather and "
                            "param_sync_func; Megatron-LM's later name is --align-param-gather).")
    group.add_argument("--no-overlap-p2p-communication", action="store_false",
                       dest="overlap_p2p_comm",
                       help="Interleaved schedule (virtual pipeline stages): wait for each pipeline "
                            "send and receive before computing on, instead of overlapping them with "
                            "the next forward or backward (Megatron-Core's overlap_p2p_comm). "
                            "Megatron's 1F1B schedule never overlaps, as in Megatron-LM; not with "
                            "--use-dpp, whose runtime always overlaps its messages.")
    group.add_argument("--no-scatter-gather-tensors-in-pipeline", action="store_false",
                       dest="scatter_gather_tensors_in_pipeline",
                       help="Accepted for Megatron-LM command lines; always so here: pipeline "
                            "messages are whole tensors (Megatron-Core 0.16 no longer has the scatter/gather split of "
                            "pipeline tensors across tensor-parallel ranks).")
    add_refused_flags(group, REFUSED_PARALLEL_FLAGS,
                      taking_a_value=("--pipeline-model-parallel-split-rank", "--tp-comm-overlap-cfg",
                                      "--num-experts"),
                      taking_values=megatron_lm_flags.REFUSED_PARALLEL)
    add_stated_flags(group, megatron_lm_flags.STATED_PARALLEL)


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _pipeline_split(args: argparse.Namespace, virtual_size: Optional[int],
                    layout: Optional[Any]) -> PipelineSplit:
    return PipelineSplit(num_layers=args.num_layers,
                         pipeline_size=args.pipeline_model_parallel_size,
                         virtual_size=virtual_size,
                         first=args.decoder_first_pipeline_num_layers,
                         last=args.decoder_last_pipeline_num_layers,
                         embedding_is_a_layer=args.account_for_embedding_in_pipeline_split,
                         loss_is_a_layer=args.account_for_loss_in_pipeline_split,
                         layout=layout_layers(layout))


def pipeline_split_from_args(args: argparse.Namespace) -> PipelineSplit:
    """The layer split of the validated flags (parallel/split.py)."""
    return _pipeline_split(args, args.parallel.virtual_pipeline_model_parallel_size,
                           args.parallel.pipeline_layout)


def parse_pipeline_layout(text: str, pipeline_size: int, num_layers: int):
    """Megatron-Core's PipelineParallelLayerLayout of --pipeline-model-parallel-layout, validated
    as its TransformerConfig validates it; ArgsError with one line otherwise. MTP layers ('m')
    are refused: no model here has them."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout)

    flag = f"{LAYOUT_FLAG} {text!r}"

    def megatron_refuses(error: Exception) -> ArgsError:
        reason = " ".join(str(error).split()) or type(error).__name__
        return ArgsError(f"{flag}: {reason} (E the embedding first, t a transformer layer, L the "
                         f"loss last, stages split by |)")

    try:
        stages = PipelineParallelLayerLayout.parse_str_to_list(text)
    except AssertionError as error:
        raise megatron_refuses(error) from None
    require(not any(getattr(layer, "name", "") == "mtp" for stage in stages for layer in stage),
            f"{flag}: 'm' (multi-token prediction layers) is not built here")
    placed = sum(getattr(layer, "name", "") == "decoder" for stage in stages for layer in stage)
    require(placed == num_layers,
            f"{flag} places {placed} transformer layers ('t'), --num-layers is {num_layers}")
    require(len(stages) % pipeline_size == 0,
            f"{flag} has {len(stages)} stages, not a multiple of --pipeline-model-parallel-size "
            f"{pipeline_size}")
    try:
        layout = PipelineParallelLayerLayout(text, pipeline_size)
        layout.validate_layer_layout(num_layers=num_layers, mtp_num_layers=None)
    except AssertionError as error:  # (its encoder-layer refusal cannot come from a string)
        raise megatron_refuses(error) from None
    return layout


def _virtual_stages(args: argparse.Namespace) -> tuple[Optional[int], Optional[Any]]:
    """(virtual pipeline size, parsed layout) from the virtual-stage flags (Megatron-LM's rules),
    the whole split checked (PipelineSplit.check). The size is None for one chunk per rank."""
    pp = args.pipeline_model_parallel_size
    require(args.num_layers_per_virtual_pipeline_stage is None
            or args.num_virtual_stages_per_pipeline_rank is None,
            "give either --num-layers-per-virtual-pipeline-stage or "
            "--num-virtual-stages-per-pipeline-rank, not both")
    virtual_size, layout = None, None
    if args.pipeline_model_parallel_layout is not None:
        virtual = first_given((
            ("--num-layers-per-virtual-pipeline-stage",
             args.num_layers_per_virtual_pipeline_stage is not None),
            ("--num-virtual-stages-per-pipeline-rank",
             args.num_virtual_stages_per_pipeline_rank is not None)))
        require(virtual is None, f"{LAYOUT_FLAG} gives the virtual stages itself (its stages / "
                                 f"--pipeline-model-parallel-size); remove {virtual}")
        layout = parse_pipeline_layout(args.pipeline_model_parallel_layout, pp, args.num_layers)
        virtual_size = layout.virtual_pipeline_model_parallel_size
    elif args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = args.num_layers_per_virtual_pipeline_stage
        uneven = first_given(((FIRST_FLAG, args.decoder_first_pipeline_num_layers is not None),
                              (LAST_FLAG, args.decoder_last_pipeline_num_layers is not None)))
        require(uneven is None,
                f"{uneven} makes the stages uneven; give the virtual stages with "
                f"--num-virtual-stages-per-pipeline-rank instead of "
                f"--num-layers-per-virtual-pipeline-stage (as Megatron-LM asks)")
        slots = (args.num_layers + args.account_for_embedding_in_pipeline_split
                 + args.account_for_loss_in_pipeline_split)
        _pipeline_split(args, None, None).check()  # the layers (and counted slots) divide by pp
        layers_per_rank = slots // pp
        require(per_stage > 0 and layers_per_rank % per_stage == 0,
                f"--num-layers {args.num_layers} is not divisible by pipeline ({pp}) x layers per "
                f"virtual stage ({per_stage}); pick a --num-layers-per-virtual-pipeline-stage that "
                f"divides {layers_per_rank}")
        virtual_size = layers_per_rank // per_stage
    elif args.num_virtual_stages_per_pipeline_rank is not None:
        require(args.num_virtual_stages_per_pipeline_rank > 0,
                "--num-virtual-stages-per-pipeline-rank must be positive")
        virtual_size = args.num_virtual_stages_per_pipeline_rank
    if virtual_size == 1:
        virtual_size = None
    _pipeline_split(args, virtual_size, layout).check()
    return virtual_size, layout


def _microbatch_group_size(args: argparse.Namespace, virtual_size: Optional[int]) -> Optional[int]:
    """--microbatch-group-size-per-virtual-pipeline-stage: only with virtual stages (the 1F1B
    schedule has no groups), at least the pipeline size (Megatron-Core's interleaved schedule
    refuses smaller groups); default the pipeline size, as ModelParallelConfig's. The checks
    against the micro-batch count are the training flags' (training/flags.py)."""
    group, pp = args.microbatch_group_size_per_vp_stage, args.pipeline_model_parallel_size
    if virtual_size is None:
        require(group is None,
                f"{GROUP_SIZE_FLAG} groups the micro-batches of the interleaved schedule, and "
                f"this run has no virtual pipeline stages; add "
                f"--num-virtual-stages-per-pipeline-rank or remove {GROUP_SIZE_FLAG}")
        return None
    if group is None:
        return pp
    require(group >= pp,
            f"{GROUP_SIZE_FLAG} {group} is below --pipeline-model-parallel-size {pp}: the "
            f"interleaved schedule runs groups of at least the pipeline size; give {pp} or more")
    return group


def validate_parallel_args(args: argparse.Namespace) -> ParallelLayout:
    """Check the parallelism flags against each other, the model's shape and the machine; return
    the layout they imply. Writes nothing onto args."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    require(tp >= 1 and pp >= 1, "--tensor-model-parallel-size and --pipeline-model-parallel-size "
                                 "must be at least 1")
    world_size = _world_size()
    require(world_size % (tp * pp) == 0,
            f"world size {world_size} is not a multiple of tensor ({tp}) x pipeline ({pp}) "
            f"parallel sizes; launch a multiple of {tp * pp} processes or change the sizes")

    virtual_size, pipeline_layout = _virtual_stages(args)
    if virtual_size is not None:
        require(pp > 1, "virtual pipeline stages need --pipeline-model-parallel-size > 1")
    group_size = _microbatch_group_size(args, virtual_size)

    require(args.num_attention_heads % tp == 0,
            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}")
    require(args.ffn_hidden_size % tp == 0,
            f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by "
            f"--tensor-model-parallel-size {tp}")
    # Megatron-LM semantics: sequence parallelism is meaningless without tensor parallelism.
    sequence_parallel = bool(args.sequence_parallel) and tp > 1

    cuda = cuda_available()
    te_layers = core_attention_from_args(args).module == TRANSFORMER_ENGINE  # megatron_dpp.kernels
    require(te_layers or not sequence_parallel,
            "--sequence-parallel needs Transformer Engine layers on a GPU (Megatron-Core's local "
            "LayerNorm does not support it); remove it or install transformer-engine")
    per_gpu = ranks_per_gpu()
    require(per_gpu == 1 or args.distributed_backend != "nccl",
            f"--distributed-backend nccl: the launcher puts {per_gpu} ranks on each GPU "
            f"(--ranks-per-gpu), and NCCL refuses two ranks on one device; remove it (gloo runs "
            f"the collectives)")
    require(per_gpu == 1 or not args.use_distributed_optimizer,
            f"--use-distributed-optimizer with {per_gpu} ranks per GPU (--ranks-per-gpu): its "
            f"reduce-scatter and all-gather of CUDA buffers would go over gloo, whose CUDA "
            f"collectives this runtime has not run; remove one")
    backend = shared_gpu_backend(args.distributed_backend, cuda, per_gpu)
    require(cuda or backend != "nccl",
            "--distributed-backend nccl needs CUDA GPUs; use gloo (the default on CPU)")
    require(cuda or args.empty_unused_memory_level == 0,
            "--empty-unused-memory-level is GPU only; remove it on CPU")
    require(args.distributed_timeout_minutes > 0, "--distributed-timeout-minutes must be positive")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    require(args.local_rank is None or args.local_rank == local_rank,
            f"--local-rank {args.local_rank} is not this rank's LOCAL_RANK {local_rank} (its "
            f"device's); remove --local-rank and let the launcher set LOCAL_RANK")
    require(args.use_distributed_optimizer or not args.ddp_pad_buckets_for_high_nccl_busbw,
            "--ddp-pad-buckets-for-high-nccl-busbw pads the distributed optimizer's buckets; add "
            "--use-distributed-optimizer or remove it")
    require(args.context_parallel_size == 1,
            f"--context-parallel-size {args.context_parallel_size}: only 1 runs here (context "
            f"parallelism needs Transformer Engine's attention and data split along the sequence "
            f"per rank, which this runtime does not have)")
    _validate_distribute_saved_activations(args, sequence_parallel, cuda)
    _validate_overlap_args(args, virtual_size)
    return ParallelLayout(world_size=world_size, data_parallel_size=world_size // (tp * pp),
                          virtual_pipeline_model_parallel_size=virtual_size,
                          pipeline_layout=pipeline_layout,
                          microbatch_group_size_per_vp_stage=group_size,
                          sequence_parallel=sequence_parallel, distributed_backend=backend)


def _validate_distribute_saved_activations(args: argparse.Namespace, sequence_parallel: bool,
                                            cuda: bool) -> None:
    """--distribute-saved-activations, with Megatron-LM's conditions and Megatron-Core's."""
    if not args.distribute_saved_activations:
        return
    require(args.recompute_granularity == "full",
            "--distribute-saved-activations splits what full recomputation saves; add "
            "--recompute-granularity full --recompute-method M --recompute-num-layers N")
    require(args.tensor_model_parallel_size > 1,
            "--distribute-saved-activations splits across tensor-parallel ranks; set "
            "--tensor-model-parallel-size 2 or more")
    require(not sequence_parallel,
            "--distribute-saved-activations does not go with --sequence-parallel (Megatron-Core "
            "refuses the pair: sequence parallelism already splits those activations); drop one")
    require(cuda, "--distribute-saved-activations needs CUDA GPUs (Megatron-Core gathers the split "
                  "activations into CUDA buffers); remove it on CPU")


def _validate_overlap_args(args: argparse.Namespace, virtual_size: Optional[int]) -> None:
    """The data-parallel and pipeline overlap flags (Megatron-LM's rules; they reach the DDP
    config in training/config.py and the schedules' sync functions in training/setup.py)."""
    if args.overlap_param_gather:
        require(args.use_distributed_optimizer,
                "--overlap-param-gather overlaps the distributed optimizer's parameter all-gather; "
                "add --use-distributed-optimizer")
        require(args.overlap_grad_reduce,
                "--overlap-param-gather needs --overlap-grad-reduce (as in Megatron-LM); add it")
    given = first_given((("--ddp-bucket-size", args.ddp_bucket_size is not None),
                         ("--ddp-num-buckets", args.ddp_num_buckets is not None)))
    if given is not None:
        require(args.ddp_bucket_size is None or args.ddp_num_buckets is None,
                "give --ddp-bucket-size or --ddp-num-buckets, not both (as in Megatron-LM)")
        require(args.overlap_grad_reduce,
                f"{given} sizes the buckets --overlap-grad-reduce reduces one by one; without it "
                f"the gradients are reduced as one bucket: add --overlap-grad-reduce or remove "
                f"{given}")
        require((args.ddp_bucket_size or args.ddp_num_buckets) > 0, f"{given} must be positive")
    if args.delay_param_gather:
        require(args.overlap_param_gather,
                "--delay-param-gather aligns the all-gathers of --overlap-param-gather; add "
                "--overlap-param-gather or drop --delay-param-gather")
        require(virtual_size is not None or args.use_dpp,
                "--delay-param-gather is launched by the interleaved schedule or the DPP runtime "
                "(Megatron's 1F1B ignores it); add virtual pipeline stages or --use-dpp")
    if args.use_dpp:
        require(args.overlap_p2p_comm,
                "--no-overlap-p2p-communication applies to Megatron's interleaved schedule; the "
                "DPP runtime (--use-dpp) always overlaps its messages; drop one of them")
        require(args.delay_grad_reduce or not (args.overlap_grad_reduce and args.dpp_split_backward),
                "--dpp-split-backward with --overlap-grad-reduce starts each chunk's reductions "
                "in chunk order through the schedule (grad_sync_func), which "
                "--no-delay-grad-reduce turns off; drop --no-delay-grad-reduce")
