"""Entry point: `torchrun ... -m megatron_dpp.pretrain_gpt <Megatron-LM flags>`.

Flags are validated before any process group exists (bad input: one line, exit code 2).
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    from megatron_dpp.arguments import parse_args

    args = parse_args(argv, prog="megatron_dpp.pretrain_gpt",
                      description="Megatron-Core GPT pretraining with dynamic pipeline parallelism.")
    from megatron_dpp.models import MODEL_SPECS
    from megatron_dpp.training.loop import pretrain

    return pretrain(args, MODEL_SPECS["gpt"])


if __name__ == "__main__":
    sys.exit(main())
