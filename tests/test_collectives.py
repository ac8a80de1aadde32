"""megatron_dpp/comm/collectives.py on CPU ranks over gloo: the device a collective takes, the
all-reduce and all-gather across two processes, and no collective at all in a group of one.
(Staging a CUDA tensor through the host needs a GPU: tests/test_gpu.py's runs go through it.)"""
from __future__ import annotations

import subprocess
import sys

import pytest

from _train_util import REPO_ROOT, _env

_RANK = """
import sys, torch, torch.distributed as dist
from megatron_dpp.comm import collectives
rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
assert collectives.collective_device(None, torch.device("cpu")) == torch.device("cpu")
value = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
if world == 1:
    dist.all_reduce = None  # a group of one runs no collective
collectives.all_reduce(value, op=dist.ReduceOp.MAX)
gathered = collectives.all_gather(torch.tensor([rank], dtype=torch.int64))
print(value.tolist(), [int(row) for row in gathered])
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,expected", [
    (1, "[1.0, 10.0] [0]"), (2, "[2.0, 20.0] [0, 1]")])
def test_all_reduce_and_all_gather_over_gloo(tmp_path, world, expected):
    store = str(tmp_path / "store")
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK, str(rank), str(world), store],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env(), cwd=REPO_ROOT) for rank in range(world)]
    for process in ranks:
        out, err = process.communicate(timeout=100)
        assert process.returncode == 0, err
        assert out.strip() == expected
