"""--log-params-norm: the L2 norm of all the model's parameters, as Megatron-LM logs it
(`calc_params_l2_norm`, megatron/training/utils.py at core_v0.16.1), for the models built here.

Each parameter counts once across the job:
- a tensor-parallel duplicate (a norm's or a bias's copy on tensor-parallel ranks other than the
  first) is left out, as is the last pipeline stage's copy of a tied word embedding (Megatron
  marks it `shared`);
- under --bf16 the values are the fp32 main parameters where the optimizer keeps them; with the
  distributed optimizer they are sharded over the data-parallel ranks, whose parts are summed
  over that group (a 16-bit parameter with no part on a rank adds nothing there). Without main
  parameters (--bf16 without the distributed optimizer, --fp16, fp32) the model's own values;
- squares are summed in fp32 and over the model-parallel group (tensor and pipeline ranks).

Collective over the model-parallel group (and the data-parallel group with sharded main
parameters): every rank calls it at the same iterations.
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

from megatron_dpp.comm import collectives


def _squared_norm(tensors: list, device) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float32, device=device)
    for tensor in tensors:
        total += torch.linalg.vector_norm(tensor, dtype=torch.float32).square()
    return total


def params_l2_norm(model: list, bf16: bool, sharded_main_params: bool, device) -> float:
    """model: the DDP-wrapped chunks of this rank; sharded_main_params: --use-distributed-optimizer
    (its main parameters are sharded over the data-parallel group)."""
    whole, sharded = [], []
    for chunk in model:
        for param in chunk.parameters():
            if not param_is_not_tensor_parallel_duplicate(param) or getattr(param, "shared", False):
                continue
            if bf16 and sharded_main_params and param.dtype != torch.float32:
                main = getattr(param, "main_param", None)
                if main is not None:
                    sharded.append(main)
            elif bf16 and getattr(param, "main_param", None) is not None:
                whole.append(param.main_param)
            else:
                whole.append(param.detach())
    squared = _squared_norm(whole, device)
    if bf16 and sharded_main_params:
        parts = _squared_norm(sharded, device)
        collectives.all_reduce(parts, group=parallel_state.get_data_parallel_group(
            with_context_parallel=True))
        squared += parts
    collectives.all_reduce(squared, group=parallel_state.get_model_parallel_group())
    return float(squared.sqrt())
