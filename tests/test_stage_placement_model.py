"""The model chunks each placement builds (models/init.py over mcore/stage_view.py): two real
ranks, pp=2 with two chunks each, Megatron-Core's builders. Every chunk holds the layers of the
stage its placement puts there (global layer numbers), the embedding where that stage is the
first and the output layer where it is the last; uneven splits count stages the same way."""
import os
import queue
import time

import pytest
import torch.multiprocessing as mp

LAYOUT = "Et|tt|t|L"  # Megatron-Core's stages 0..3: 1, 2, 1 and 0 layers


def _rank(rank, store_path, placement, layout, results):
    import torch
    import torch.distributed as dist

    from megatron_dpp.platform import setup_platform

    setup_platform(())
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer import TransformerConfig

    from megatron_dpp.models.gpt import GPTShape, build_gpt_chunks
    from megatron_dpp.stage_placement import embedding_ranks_for

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(
        1, 2, virtual_pipeline_model_parallel_size=2,
        get_embedding_ranks=embedding_ranks_for(placement, 2, tied=True))
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    fields = {}
    if layout:
        from megatron.core.transformer.pipeline_parallel_layer_layout import (
            PipelineParallelLayerLayout)

        fields["pipeline_model_parallel_layout"] = PipelineParallelLayerLayout(layout, 2)
    config = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4,
                               pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                               virtual_pipeline_model_parallel_size=None if layout else 2,
                               use_cpu_initialization=True, hidden_dropout=0.0,
                               attention_dropout=0.0, bias_activation_fusion=False,
                               bias_dropout_fusion=False, masked_softmax_fusion=False,
                               gradient_accumulation_fusion=False, **fields)
    chunks = build_gpt_chunks(config, GPTShape(128, 16, False), seed=3, placement=placement)
    # After building, Megatron-Core's pipeline rank and default groups are the real ones again.
    from megatron.core.process_groups_config import ProcessGroupCollection

    restored = (parallel_state.get_pipeline_model_parallel_rank() == rank
                and ProcessGroupCollection.use_mpu_process_groups().pp.rank() == rank)
    results.put((rank, [{"pre": chunk.pre_process, "post": chunk.post_process,
                         "layers": [layer.layer_number for layer in chunk.decoder.layers],
                         "restored": restored}
                        for chunk in chunks]))
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _build(tmp_path, placement, layout=None):
    context = mp.get_context("spawn")
    results = context.Queue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    processes = [context.Process(target=_rank, args=(rank, str(tmp_path / "store"), placement,
                                                     layout, results)) for rank in range(2)]
    for process in processes:
        process.start()
    got = {}
    try:
        deadline = time.monotonic() + 180
        while len(got) < len(processes):  # a rank that fails ends the wait at once
            assert time.monotonic() < deadline, f"ranks reported {sorted(got)} within 180 s"
            assert not any(process.exitcode not in (None, 0) for process in processes), \
                [process.exitcode for process in processes]
            try:
                rank, chunks = results.get(timeout=1)
                got[rank] = chunks
            except queue.Empty:
                pass
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    assert all(process.exitcode == 0 for process in processes)
    return got


def _chunk(pre, post, layers):
    return {"pre": pre, "post": post, "layers": layers, "restored": True}


@pytest.mark.timeout(300)
def test_the_v_placement_builds_stage_2p_minus_1_minus_r_as_chunk_1(tmp_path):
    # Stages 0, 1 on ranks 0, 1 (chunk 0); stages 2, 3 on ranks 1, 0 (chunk 1): rank 0 holds the
    # embedding and the output layer, rank 1 the two middle stages.
    assert _build(tmp_path, "v") == {
        0: [_chunk(True, False, [1]), _chunk(False, True, [4])],
        1: [_chunk(False, False, [2]), _chunk(False, False, [3])],
    }


@pytest.mark.timeout(300)
def test_the_interleaved_placement_is_megatrons(tmp_path):
    assert _build(tmp_path, "interleaved") == {
        0: [_chunk(True, False, [1]), _chunk(False, False, [3])],
        1: [_chunk(False, False, [2]), _chunk(False, True, [4])],
    }


@pytest.mark.timeout(300)
def test_a_layout_string_gives_each_stage_its_layers_on_the_v(tmp_path):
    # Et|tt|t|L: stage 0 layer 1, stage 1 layers 2-3, stage 2 layer 4, stage 3 the loss alone.
    assert _build(tmp_path, "v", LAYOUT) == {
        0: [_chunk(True, False, [1]), _chunk(False, True, [])],
        1: [_chunk(False, False, [2, 3]), _chunk(False, False, [4])],
    }

