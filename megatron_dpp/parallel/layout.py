"""ParallelLayout: what the parallelism flags imply, derived once before anything starts.

parallel/flags.py's validate_parallel_args checks the flags and returns it; it writes nothing onto
the flags. megatron_dpp.arguments keeps it as `args.parallel`, the one derived value of the
parallelism group, and the model's config (models/transformer_config.py), the training flags'
checks, the DPP runtime's checks and the process-group set-up (training/setup.py) read it there.
The flags themselves stay as the user gave them: `args.sequence_parallel` is what the command line
says, `args.parallel.sequence_parallel` what runs.

Standard library only, as the launcher's flag check is.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """The derived parallel layout of one run. The defaults are one process on the CPU without
    virtual stages (tools that build a model at pp=1 start from them)."""

    world_size: int = 1
    """Processes in the job (torchrun's WORLD_SIZE)."""

    data_parallel_size: int = 1
    """world_size / (tensor x pipeline parallel sizes), as Megatron-LM derives it."""

    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Model chunks per pipeline rank; None for one (Megatron-Core's convention). From
    --num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank or
    --pipeline-model-parallel-layout."""

    pipeline_layout: Optional[Any] = None
    """Megatron-Core's PipelineParallelLayerLayout of --pipeline-model-parallel-layout, parsed and
    validated; None without the flag."""

    microbatch_group_size_per_vp_stage: Optional[int] = None
    """Consecutive micro-batches each model chunk runs in the interleaved order
    (--microbatch-group-size-per-virtual-pipeline-stage, default the pipeline size); None without
    virtual stages."""

    sequence_parallel: bool = False
    """--sequence-parallel where it has an effect: off at tensor-parallel size 1, as in
    Megatron-LM."""

    distributed_backend: str = "gloo"
    """torch.distributed's backend: --distributed-backend, or nccl with CUDA and one rank per GPU,
    gloo without CUDA or with ranks sharing a GPU (shared_gpu.shared_gpu_backend)."""

    @property
    def chunks_per_rank(self) -> int:
        """Model chunks per pipeline rank, 1 without virtual stages."""
        return self.virtual_pipeline_model_parallel_size or 1


def flags_and_layout(args: Any) -> dict:
    """The flags with the derived layout's fields beside them under Megatron-LM's names
    (data_parallel_size, virtual_pipeline_model_parallel_size, sequence_parallel as it runs, ...):
    what Megatron-LM's args hold, and so what a checkpoint's saved args and W&B's run config
    keep."""
    values = dict(vars(args))
    layout = values.get("parallel")
    if isinstance(layout, ParallelLayout):
        values.update((field.name, getattr(layout, field.name))
                      for field in dataclasses.fields(layout))
    return values
