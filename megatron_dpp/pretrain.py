"""The entry point: `torchrun ... -m megatron_dpp.pretrain --model gpt|bert <Megatron-LM flags>`.

`--model` picks the model (models/families.py lists them); `--model NAME --help` lists its own
flags too. Flags are validated before any process group exists (bad input: one line, exit code 2).
megatron_dpp.pretrain_gpt and megatron_dpp.pretrain_bert are this with the model fixed.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

DESCRIPTION = "Megatron-Core pretraining with dynamic pipeline parallelism."


def main(argv: Optional[Sequence[str]] = None, model: Optional[str] = None,
         prog: str = "megatron_dpp.pretrain", description: str = DESCRIPTION) -> int:
    """model None: read from --model; else the model an alias fixes."""
    from megatron_dpp.arguments import parse_args

    args = parse_args(argv, prog=prog, description=description, model=model)
    from megatron_dpp import kernels

    kernels.import_megatron_core()  # without a GPU: without torch's compiler
    from megatron_dpp.models import MODEL_SPECS
    from megatron_dpp.training.loop import pretrain

    returncode = pretrain(args, MODEL_SPECS[args.model])
    # Done: keep the interpreter's last garbage collection from walking every object of torch and
    # Megatron-Core on the way out (it took 2-4 s per rank of a tiny run; nothing left needs it).
    import gc

    gc.freeze()
    return returncode


if __name__ == "__main__":
    sys.exit(main())
