"""--cuda-graph-impl local (Megatron-Core's CUDA graphs of each transformer layer): the flag's
checks, the config and `kernels:` line it gives, the evaluation's eager layers, the graph-safe RNG
tracker's states in checkpoints, and the seed call. On CPU; the run itself is a GPU test
(tests/test_gpu.py: test_gpt_cuda_graphs_train_as_eager_on_one_gpu)."""
from __future__ import annotations

import argparse
import random

import numpy as np
import pytest
import torch

from megatron_dpp import kernels
from test_attention_kernels import _parse_errors, _recipe_flags
from _train_util import data_args


@pytest.mark.parametrize("argv,cuda,error", [
    ([], False, None),
    (["--cuda-graph-impl", "none"], False, None),
    (["--cuda-graph-impl", "local"], True, None),
    (["--cuda-graph-impl", "local"], False, "--cuda-graph-impl local captures CUDA graphs and "
                                            "needs a CUDA GPU"),
    (["--cuda-graph-impl", "transformer_engine"], True, "invalid choice: 'transformer_engine'"),
    (["--cuda-graph-impl", "local", "--recompute-activations"], True,
     "--cuda-graph-impl local does not graph recomputed layers"),
    (["--cuda-graph-impl", "local", "--variable-seq-lengths"], True,
     "--variable-seq-lengths changes the shape every micro-batch"),
])
def test_cuda_graph_flag_checks(argv, cuda, error, monkeypatch, capsys):
    got = _parse_errors(argv, monkeypatch, capsys, cuda)
    if error is None:
        assert got is None
    else:
        assert got is not None and error in got, got


def test_cuda_graphs_are_refused_with_the_dpp_runtime(monkeypatch, capsys):
    from megatron_dpp.arguments import parse_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    flags = [*data_args(), *_recipe_flags("examples/gpt3/gpt3_tiny.sh"),
             "--pipeline-model-parallel-size", "2", "--cuda-graph-impl", "local"]
    parse_args(flags, prog="megatron_dpp.pretrain_gpt")  # Megatron's 1F1B: accepted
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        parse_args([*flags, "--use-dpp"], prog="megatron_dpp.pretrain_gpt")
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip()
    assert "runs under Megatron's schedules" in error and "--use-dpp" in error, error


@pytest.mark.parametrize("flags,on", [([], False), (["--cuda-graph-impl", "local"], True)])
def test_cuda_graph_flag_sets_the_config_and_says_so(flags, on, monkeypatch):
    from megatron_dpp.arguments import parse_args
    from megatron_dpp.training.config import transformer_config_from_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = parse_args([*data_args(), *_recipe_flags("examples/gpt3/gpt3_tiny.sh"), *flags],
                      prog="megatron_dpp.pretrain_gpt")
    args.padded_vocab_size = 128
    choice = kernels.kernel_choices(args).cuda_graphs
    config = transformer_config_from_args(args)
    assert config.cuda_graph_impl == ("local" if on else "none")
    assert choice.on is on
    assert choice.line().startswith(f"kernels: CUDA graphs {'on' if on else 'off'}: "
                                    f"--cuda-graph-impl {'local' if on else 'none'}")
    assert config.cuda_graph_scope == []  # whole layers
    # off on a GPU where nothing else stands in their way: the line says what they would give
    assert ("--cuda-graph-impl local launches each layer as one graph" in choice.reason) is not on


@pytest.mark.parametrize("flags", [["--use-dpp", "--pipeline-model-parallel-size", "2"],
                                   ["--recompute-activations"], ["--variable-seq-lengths"], None])
def test_graphs_off_are_suggested_only_where_they_could_run(flags, monkeypatch):
    from megatron_dpp.arguments import parse_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: flags is not None)  # None: on CPU
    args = parse_args([*data_args(), *_recipe_flags("examples/gpt3/gpt3_tiny.sh"), *(flags or [])],
                      prog="megatron_dpp.pretrain_gpt")
    choice = kernels.kernel_choices(args).cuda_graphs
    assert not choice.on
    assert choice.reason == ("--cuda-graph-impl none (Megatron-LM's default): every kernel is "
                             "launched from Python")


# ----------------------------------------------------------------------------------------------
# evaluation runs the layers eagerly
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["local", "none"])
def test_evaluation_lowers_the_graphs_created_flag_and_restores_it(impl, monkeypatch):
    from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord

    from megatron_dpp.mcore.cudagraphs import eager_layers

    monkeypatch.setattr(_CudagraphGlobalRecord, "cudagraph_created", True)
    config = argparse.Namespace(cuda_graph_impl=impl)
    with pytest.raises(RuntimeError, match="inside"):
        with eager_layers(config):
            # Megatron-Core's CudaGraphManager runs eval-mode layers eagerly while this is False.
            assert _CudagraphGlobalRecord.cudagraph_created is (impl == "none")
            raise RuntimeError("inside")
    assert _CudagraphGlobalRecord.cudagraph_created is True


# ----------------------------------------------------------------------------------------------
# the graph-safe RNG tracker in checkpoints
# ----------------------------------------------------------------------------------------------
class _Tracker:
    def __init__(self, states: dict):
        self.states_ = states
        self.set_calls: list[dict] = []

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self.set_calls.append(states)
        self.states_ = states


def _generator(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def test_graph_safe_tracker_states_are_saved_as_bytes_and_loaded_into_the_same_generators(
        monkeypatch):
    from megatron.core import tensor_parallel

    from megatron_dpp.training.checkpoint.torch_dist import (CheckpointLoadError, set_tracker_states,
                                                       tracker_states)

    generators = {"model-parallel-rng": _generator(1), "data-parallel-rng": _generator(2)}
    tracker = _Tracker(generators)
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda: tracker)

    saved = tracker_states()
    assert all(isinstance(state, torch.Tensor) for state in saved.values())
    torch.save(saved, "/dev/null")  # what a checkpoint holds can be written
    expected = {name: torch.rand(3, generator=g) for name, g in generators.items()}
    set_tracker_states(saved)  # back to the saved states, in the same objects
    assert tracker.set_calls == [] and tracker.get_states() == generators
    for name, generator in generators.items():
        torch.testing.assert_close(torch.rand(3, generator=generator), expected[name])

    with pytest.raises(CheckpointLoadError, match="'expert-parallel-rng'"):
        set_tracker_states({**saved, "expert-parallel-rng": saved["model-parallel-rng"]})


def test_plain_tracker_states_round_trip_as_before(monkeypatch):
    from megatron.core import tensor_parallel

    from megatron_dpp.training.checkpoint.torch_dist import set_tracker_states, tracker_states

    states = {"model-parallel-rng": torch.get_rng_state()}
    tracker = _Tracker(states)
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda: tracker)
    saved = tracker_states()
    assert saved["model-parallel-rng"] is states["model-parallel-rng"]
    set_tracker_states(saved)
    assert tracker.set_calls == [saved]


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_seeds_ask_for_a_graph_safe_tracker_with_graphs(cuda_graphs, monkeypatch):
    from megatron.core import parallel_state, tensor_parallel

    from megatron_dpp.training import setup

    calls = []
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: 1)
    monkeypatch.setattr(tensor_parallel, "model_parallel_cuda_manual_seed",
                        lambda seed, **kwargs: calls.append((seed, kwargs)))
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        setup.set_seeds(1234, cuda_graphs=cuda_graphs)
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
    assert calls == [(1334, {"use_cudagraphable_rng": cuda_graphs})]
