"""Which megatron-core this project runs on, and the Megatron-Core internals it relies on.

`version_obstacle()` is the gate: one line when the installed megatron-core is not a supported one,
read from the package's metadata (no import of torch or Megatron-Core), so the flag check says it
before any rank starts. `SEAMS` names every private name, overridden method and patched module
global the code relies on; `FINGERPRINTS` holds the hash of each upstream source the code copies or
overrides, as it was when copied. tests/test_mcore_surface.py checks both against the installed
version, so that an upgrade fails one test that lists what to re-read. Standard library only.
"""
from __future__ import annotations

import hashlib
from importlib import metadata
from typing import Optional

DISTRIBUTION = "megatron-core"
SUPPORTED_VERSIONS = ("0.16.1",)
"""The megatron-core releases the seams below were read against (pyproject.toml pins the first)."""

# (module, qualified name) -> where our code relies on it, and how. Private names, methods we
# override, and module globals we rebind or patch.
SEAMS: dict[tuple[str, str], str] = {
    ("megatron.core.parallel_state", "_MPU_PIPELINE_MODEL_PARALLEL_RANK"):
        "mcore/stage_view.py reads and restores it around building a chunk of another placement, "
        "and around its sharded state dict (a checkpoint's)",
    ("megatron.core.process_groups_config", "ProcessGroupCollection.use_mpu_process_groups"):
        "mcore/stage_view.py rebinds it while a chunk of another placement is built (BertModel's "
        "TransformerBlock takes its groups from it)",
    ("megatron.core.pipeline_parallel.p2p_communication", "P2PCommunicator._communicate"):
        "mcore/p2p.py overrides it: Megatron's schedules over comm/megatron_p2p.py's Transport",
    ("megatron.core.distributed", "DistributedDataParallel._make_backward_post_hook"):
        "mcore/ddp.py overrides it: a hook that only accumulates",
    ("megatron.core.transformer.cuda_graphs", "_CudagraphGlobalRecord.cudagraph_created"):
        "mcore/cudagraphs.py writes it: evaluation runs eagerly under --cuda-graph-impl local",
    ("megatron.core.fusions.fused_bias_dropout", "_bias_dropout_add_func"):
        "mcore/direct_layer.py calls it: bias-dropout-add without the closures",
    ("megatron.core.transformer.attention", "_yarn_get_concentration_factor_from_config"):
        "mcore/direct_layer.py calls it: the RoPE mscale, as SelfAttention computes it",
    ("megatron.core.transformer.attention", "SplitAlongDim"):
        "mcore/direct_layer.py reads it: the QKV split Megatron uses",
    ("megatron.core.tensor_parallel.random", "_MODEL_PARALLEL_RNG_TRACKER_NAME"):
        "mcore/rng.py reads it: the model-parallel stream's name",
    ("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker"):
        "mcore/rng.py reads and writes its _current_state_name and states_",
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"):
        "mcore/cpu_patches.py rebinds it on CPU (CPU generator states)",
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"):
        "mcore/cpu_patches.py rebinds it on CPU (CPU generator states)",
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"):
        "mcore/cpu_patches.py rebinds it on CPU (no torch.cuda.FloatTensor assertion)",
    ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32"):
        "mcore/cpu_patches.py rebinds the optimizer module's by-name import too",
    ("megatron.core.optimizer.clip_grads", "l2_norm_impl"):
        "mcore/optimizer.py rebinds it: foreach ops instead of the per-tensor fallback",
    ("megatron.core.optimizer.clip_grads", "multi_tensor_scale_impl"):
        "mcore/optimizer.py rebinds it: foreach ops instead of the per-tensor fallback",
    ("megatron.core.optimizer.optimizer", "multi_tensor_scale_impl"):
        "mcore/optimizer.py rebinds it: foreach ops instead of the per-tensor fallback",
    ("megatron.core.models.common.language_module.language_module",
     "LanguageModule.setup_embeddings_and_output_layer"):
        "mcore/cpu_patches.py wraps it on CPU (weight.data.cuda())",
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.get_parameter_state_dp_zero"):
        "mcore/cpu_patches.py wraps it on CPU (send_tensor.cuda()); mcore/distributed_optimizer.py "
        "wraps it (buckets counted with their padding)",
    ("megatron.core.optimizer.distrib_optimizer",
     "DistributedOptimizer.load_parameter_state_from_fully_reshardable"):
        "mcore/distributed_optimizer.py rebinds it (torch Adam's state keys)",
    ("megatron.core.optimizer.distrib_optimizer",
     "DistributedOptimizer.load_parameter_state_from_dp_reshardable"):
        "mcore/distributed_optimizer.py relies on its state layout",
    ("megatron.core.optimizer.distrib_optimizer",
     "DistributedOptimizer.get_parameter_state_dp_reshardable"):
        "mcore/distributed_optimizer.py reads its entries' padding",
    ("megatron.core.optimizer.distrib_optimizer", "HAVE_APEX_OR_TE"):
        "mcore/distributed_optimizer.py reads it: the torch-Adam-only fixes",
    ("megatron.core.optimizer.grad_scaler", "DynamicGradScaler.load_state_dict"):
        "mcore/cpu_patches.py wraps it on CPU (.cuda(current_device()))",
    ("megatron.core.models.bert.bert_model",
     "BertModel._sanity_check_attention_and_get_attn_mask_dimension"):
        "mcore/bert_model.py overrides it: models/bert.py's b1ss mask for SdpaCoreAttention",
    ("megatron.core.datasets.gpt_dataset", "GPTDataset._get_num_epochs"):
        "mcore/datasets.py overrides it: data/datasets.py refuses a 0-token split",
    ("megatron.core.datasets.masked_dataset", "MaskedWordPieceDataset._build_sample_index"):
        "mcore/datasets.py overrides it: data/bert_datasets.py's empty-split errors",
    ("megatron.core.tensor_parallel.layers", "ColumnParallelLinear._forward_impl"):
        "mcore/linear_call.py overrides it: the split backward's deferred linears",
    ("megatron.core.tensor_parallel.layers", "RowParallelLinear._forward_impl"):
        "mcore/linear_call.py overrides it: the split backward's deferred linears",
    ("megatron.core.dist_checkpointing.strategies.filesystem_async", "_results_queue"):
        "mcore/checkpoint_writer.py sets it around a synchronous save: an in-process queue "
        "instead of a multiprocessing Manager's",
    ("megatron.core.fusions.fused_layer_norm", "HAVE_PERSIST_LAYER_NORM"):
        "kernels.py reads it: the persistent layer norm's kernel line",
    ("megatron.core.tokenizers.text.libraries.tiktoken_tokenizer", "_PATTERN_TIKTOKEN_V1"):
        "tests read it: TikTokenizer's v1 pattern equals Megatron-Core's",
    ("megatron.core.tokenizers.text.libraries.tiktoken_tokenizer", "_PATTERN_TIKTOKEN_V2"):
        "tests read it: TikTokenizer's v2 pattern equals Megatron-Core's",
}

# (module, qualified name) -> sha1[:12] of its source (inspect.getsource) in megatron-core 0.16.1:
# the upstream code ours copies, near-copies or overrides (docs/mcore_internals.md says which).
FINGERPRINTS: dict[tuple[str, str], str] = {
    # mcore/stage_view.py: where a chunk's builder reads its pipeline rank.
    ("megatron.core.transformer.transformer_layer", "get_transformer_layer_offset"): "6da3d4b93b71",
    ("megatron.core.transformer.transformer_block", "get_num_layers_to_build"): "de04e2e37bd5",
    ("megatron.core.transformer.pipeline_parallel_layer_layout",
     "PipelineParallelLayerLayout.get_layer_offset"): "f6100864cc93",
    ("megatron.core.transformer.pipeline_parallel_layer_layout",
     "PipelineParallelLayerLayout.get_num_layers_to_build"): "3e0adf0ab05f",
    # training/checkpoint/torch_dist.py over mcore/stage_view.py: a chunk's sharded state dict
    # takes its layers' local indices from the offset (the collection's pipeline rank, a layout
    # string's parallel_state rank), and the tied output layer's key and replica id.
    ("megatron.core.transformer.transformer_block", "TransformerBlock.sharded_state_dict"):
        "ce2f6516ee88",
    ("megatron.core.models.common.language_module.language_module",
     "LanguageModule.tie_embeddings_and_output_weights_state_dict"): "0953861f159b",
    ("megatron.core.pipeline_parallel.p2p_communication", "P2PCommunicator._communicate"):
        "fbdfa3f9f80b",
    ("megatron.core.distributed.distributed_data_parallel",
     "DistributedDataParallel._make_backward_post_hook"): "6f1f21ec32a4",
    ("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker.fork"): "043757ad2810",
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"): "b8efb24fab54",
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"): "15a863ab8e24",
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"): "68449e619ada",
    ("megatron.core.utils", "local_multi_tensor_l2_norm"): "6b06d00fafcd",
    ("megatron.core.utils", "local_multi_tensor_scale"): "cad15a4f6f4b",
    ("megatron.core.transformer.transformer_layer", "TransformerLayer._forward_attention"):
        "491b569ea55e",
    ("megatron.core.transformer.transformer_layer", "TransformerLayer._forward_mlp"):
        "dde0dd98dbf1",
    ("megatron.core.transformer.transformer_layer", "TransformerLayer._forward_post_mlp"):
        "ba8da009ab4b",
    ("megatron.core.transformer.attention", "Attention.forward"): "20bd8f2d2b81",
    ("megatron.core.transformer.attention", "SelfAttention.get_query_key_value_tensors"):
        "3998b906f453",
    ("megatron.core.transformer.mlp", "MLP.forward"): "0334c3d4024a",
    ("megatron.core.transformer.module", "GraphableMegatronModule.__call__"): "000bda9933ec",
    ("megatron.core.fusions.fused_bias_dropout", "_bias_dropout_add_func"): "57bc909b8576",
    ("megatron.core.tensor_parallel.layers", "VocabParallelEmbedding.forward"): "0d145da16d19",
    ("megatron.core.tensor_parallel.layers",
     "LinearWithGradAccumulationAndAsyncCommunication.backward"): "1c8adf5625d2",
    ("megatron.core.tensor_parallel.layers", "ColumnParallelLinear._forward_impl"): "f0bc03ba816c",
    ("megatron.core.tensor_parallel.layers", "RowParallelLinear._forward_impl"): "f0bc03ba816c",
    ("megatron.core.tensor_parallel.layers", "ColumnParallelLinear.forward"): "f68b07b89f51",
    ("megatron.core.tensor_parallel.layers", "RowParallelLinear.forward"): "0a619297ca97",
    ("megatron.core.transformer.dot_product_attention", "DotProductAttention.__init__"):
        "ac4f3034e906",
    ("megatron.core.transformer.dot_product_attention", "DotProductAttention.forward"):
        "9842772d06b0",
    ("megatron.core.pipeline_parallel.schedules",
     "forward_backward_pipelining_without_interleaving"): "bd7613ae9e2e",
    ("megatron.core.pipeline_parallel.schedules",
     "forward_backward_pipelining_with_interleaving"): "4fdc6429aa39",
    ("megatron.core.pipeline_parallel.schedules", "get_schedule_table"): "e74d4fd68823",
    ("megatron.core.optimizer.distrib_optimizer",
     "DistributedOptimizer.load_parameter_state_from_fully_reshardable"): "d024c9557054",
    # mcore/distributed_optimizer.py's aligned_state_gather: the gather drops the padding after
    # each bucket, the cut counts it (bucket offsets from _ParamAndGradBuffer.__init__).
    ("megatron.core.optimizer.distrib_optimizer",
     "DistributedOptimizer.get_parameter_state_dp_zero"): "04de4adba4de",
    ("megatron.core.optimizer.distrib_optimizer",
     "DistributedOptimizer.sharded_param_state_fully_reshardable"): "a84c594d68c6",
    ("megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBuffer.__init__"):
        "4e7d59584138",
    ("megatron.core.optimizer.distrib_optimizer",
     "DistributedOptimizer.load_parameter_state_from_dp_reshardable"): "e6892335cf59",
    ("megatron.core.optimizer.distrib_optimizer",
     "DistributedOptimizer.get_parameter_state_dp_reshardable"): "37a76bd1ab01",
    ("megatron.core.optimizer_param_scheduler", "OptimizerParamScheduler.load_state_dict"):
        "fa5a92a1d788",
    ("megatron.core.datasets.gpt_dataset", "GPTDataset._get_num_epochs"): "a5f257e4925a",
    ("megatron.core.datasets.masked_dataset", "MaskedWordPieceDataset._build_sample_index"):
        "fc23752ea60a",
    ("megatron.core.models.bert.bert_model",
     "BertModel._sanity_check_attention_and_get_attn_mask_dimension"): "d60c870eedb7",
    ("megatron.core.transformer.cuda_graphs", "_CudagraphGlobalRecord"): "d46eafe1936b",
    # mcore/checkpoint_writer.py: the global is read when set, and a synchronous save puts its
    # results from the rank's process and takes them with get_nowait.
    ("megatron.core.dist_checkpointing.strategies.filesystem_async", "_get_write_results_queue"):
        "96a44ad1c0b8",
    ("megatron.core.dist_checkpointing.strategies.filesystem_async",
     "FileSystemWriterAsync.write_preloaded_data_multiproc"): "37656807e22a",
    ("megatron.core.dist_checkpointing.strategies.filesystem_async",
     "FileSystemWriterAsync.retrieve_write_results"): "a21f2910259b",
}


def installed_version() -> Optional[str]:
    """The installed megatron-core's version, from its metadata; None when it is not installed."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


def version_obstacle(installed: Optional[str]) -> Optional[str]:
    """The one line that stops a run on an unsupported megatron-core (None: supported)."""
    wanted = " or ".join(SUPPORTED_VERSIONS)
    if installed is None:
        return (f"megatron-core is not installed; megatron-dpp runs on megatron-core {wanted}: "
                f"bash run_scripts/setup_env.sh, or pip install megatron-core=={SUPPORTED_VERSIONS[0]}")
    if installed not in SUPPORTED_VERSIONS:
        return (f"megatron-core {installed} is installed; megatron-dpp runs on megatron-core "
                f"{wanted} only (it relies on internals that change between releases, "
                f"docs/mcore_internals.md): pip install megatron-core=={SUPPORTED_VERSIONS[0]}")
    return None


def source_fingerprint(source: str) -> str:
    """The hash FINGERPRINTS holds for an upstream source text."""
    return hashlib.sha1(source.encode()).hexdigest()[:12]
