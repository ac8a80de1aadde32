"""A training process whose DataLoaders have worker processes (--num-workers, Megatron-LM's default
2) leaves nothing in its temporary directory when it exits: data/iterators.py stops the workers at
exit before multiprocessing's exit handler would SIGTERM them, which left each worker's
/tmp/pymp-* directory (the socket through which it shared its batches' memory) behind."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

PROCESS = textwrap.dedent('''
    import json, os, types
    import torch
    from megatron_dpp.data.iterators import build_data_iterators

    class Samples(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            tokens = torch.arange(8) + i
            return {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(8),
                    "position_ids": torch.arange(8)}

    args = types.SimpleNamespace(micro_batch_size=2, num_workers=2, variable_seq_lengths=False,
                                 dataloader_inter_document_masking=False)
    train, valid, _ = build_data_iterators(args, Samples(), Samples(), None, 0, 0, 0, 1)
    for _ in range(3):
        next(train), next(valid)
    print(json.dumps(sorted(name for name in os.listdir(os.environ["TMPDIR"])
                            if name.startswith("pymp-"))))
''')


def test_loader_workers_leave_no_temporary_directory(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, "-c", PROCESS], capture_output=True, text=True,
                            timeout=120, env=env, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    during = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(during) >= 2, result.stdout  # the workers did share batches through one each
    assert sorted(os.listdir(tmp_path)) == []
