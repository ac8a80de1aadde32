"""Entry point: `torchrun ... -m megatron_dpp.pretrain_bert <Megatron-LM flags>`.

BERT with the masked-LM loss and, unless --bert-no-binary-head, the sentence-order loss, on
Megatron-Core's BertModel. Flags are validated before any process group exists (bad input: one
line, exit code 2).
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    from megatron_dpp.arguments import parse_args

    args = parse_args(argv, prog="megatron_dpp.pretrain_bert", model="bert",
                      description="Megatron-Core BERT pretraining with dynamic pipeline parallelism.")
    from megatron_dpp.models import MODEL_SPECS
    from megatron_dpp.training.loop import pretrain

    return pretrain(args, MODEL_SPECS["bert"])


if __name__ == "__main__":
    sys.exit(main())
