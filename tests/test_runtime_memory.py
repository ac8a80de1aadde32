"""The DPP runtime's memory budget against the bytes autograd really keeps.

The runtime admits forwards against ModelSpec.activation_bytes (the search's analytical model,
models/memory_model.py), given the TransformerConfig the layers were built from and each
micro-batch's own length. Here a pipeline stage's layers (a TransformerBlock of two layers, what
a middle stage runs) do one forward per micro-batch under the search's saved-tensor count
(search/model_measurement.py: torch.autograd.graph.saved_tensors_hooks, each storage once,
parameters excluded, only what is still held when the forward returns), and the runtime's
estimate for that micro-batch must match it. tp=2 runs on two gloo processes through the same
harness the model profiler measures tensor parallelism with.

Tolerance 0.1%: the model is term-by-term what Megatron-Core's local layers save on CPU; here it
is off by at most 8 bytes (0.002%, a scalar selective recompute keeps), while its smallest real
term, the layer norms' fp32 statistics, is about 0.2% of a layer, and a config read wrong (dtype,
TP, recompute mode) is off by 25% or more: so any missing term or misread setting fails.
"""
from __future__ import annotations

import copy

import pytest

from megatron_dpp.models import memory_model as mm

REL = 1e-3
VOCAB = 1024
HIDDEN, HEADS, MICRO_BATCH = 64, 4, 2
LENGTHS = (48, 64, 128)  # one batch of variable-length micro-batches


@pytest.fixture(scope="module")
def profiling():
    from megatron_dpp.search import model_measurement

    with model_measurement.single_process_megatron("gpt"):
        yield model_measurement


def _shape(model: str, dtype: str, length: int) -> mm.ModelShape:
    return mm.model_shape(model, 2, HIDDEN, HEADS, length, VOCAB, dtype=dtype)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model, dtype", [("gpt", "fp32"), ("gpt", "bf16"), ("bert", "fp32")])
@pytest.mark.parametrize("recompute", mm.RECOMPUTE_MODES)
def test_runtime_estimate_matches_saved_tensors_per_microbatch(profiling, model, dtype,
                                                               recompute):
    from megatron_dpp.models import MODEL_SPECS

    stage = profiling.build_layer(_shape(model, dtype, LENGTHS[0]), recompute, num_layers=2)
    sizes = [MICRO_BATCH * length for length in LENGTHS]  # tokens, as microbatch_work counts
    # The stage's own config; one chunk on one stage holds both layers.
    estimates = MODEL_SPECS[model].activation_bytes(stage.config, sizes, MICRO_BATCH, 1, 1)
    for length, estimate in zip(LENGTHS, estimates):
        measured = profiling.measured_layer_activation_bytes(stage, _shape(model, dtype, length),
                                                             MICRO_BATCH)
        assert estimate == pytest.approx(measured, rel=REL), (length, estimate, measured)


@pytest.mark.timeout(400)
def test_runtime_estimate_matches_saved_tensors_at_tp2(profiling):
    """One tensor-parallel rank of two (gloo processes) keeps what the estimate says, with every
    recompute mode, at each length."""
    from megatron_dpp.models import MODEL_SPECS

    options = profiling.ProfilingOptions(
        model="gpt", hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=4 * HIDDEN,
        seq_lengths=(64, 128), micro_batch_sizes=(MICRO_BATCH,), dtype="fp32",
        padded_vocab_size=VOCAB, max_position_embeddings=128, hidden_dropout=0.1,
        attention_dropout=0.1, tp_sizes=(1, 2), measured_tp_size=2,
        warmup=0, repeats=1)
    activations, _times = profiling.measure_tensor_parallel(options, 2)
    for recompute in mm.RECOMPUTE_MODES:
        # The config those ranks built their layer from: the same builder, at tp=2.
        config = copy.copy(profiling.build_layer(options.shape(64), recompute).config)
        config.tensor_model_parallel_size = 2
        sizes = [MICRO_BATCH * length for length in options.seq_lengths]
        estimates = MODEL_SPECS["gpt"].activation_bytes(config, sizes, MICRO_BATCH, 1, 1)
        for length, estimate in zip(options.seq_lengths, estimates):
            measured = activations[(length, recompute)]
            assert estimate == pytest.approx(measured, rel=REL), (recompute, length, estimate,
                                                                  measured)
