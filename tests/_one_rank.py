"""A one-rank Megatron-Core setup for tests that build models in the test process: the platform's
CPU patches, a gloo process group of one, tp = pp = 1, Megatron's seeded RNG tracker.

    @pytest.fixture(scope="module")
    def megatron(tmp_path_factory):
        with one_rank_megatron(tmp_path_factory.mktemp("x"), extra_patched_modules):
            yield
"""
import contextlib
from pathlib import Path
from typing import Iterator, Sequence

import torch.distributed as dist

from megatron_dpp.platform import setup_platform


@contextlib.contextmanager
def one_rank_megatron(directory: Path, patched_modules: Sequence[str] = ()) -> Iterator[None]:
    setup_platform(patched_modules)
    from megatron.core import parallel_state, tensor_parallel

    created = not dist.is_initialized()
    if created:
        store = dist.FileStore(str(directory / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()
