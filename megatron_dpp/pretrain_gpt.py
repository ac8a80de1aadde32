"""`torchrun ... -m megatron_dpp.pretrain_gpt <Megatron-LM flags>`: megatron_dpp.pretrain with
--model gpt (Megatron-LM's pretrain_gpt.py, by name)."""
import sys

from megatron_dpp.pretrain import main as pretrain_main


def main(argv=None) -> int:
    return pretrain_main(argv, model="gpt", prog="megatron_dpp.pretrain_gpt",
                         description="Megatron-Core GPT pretraining with dynamic pipeline parallelism.")


if __name__ == "__main__":
    sys.exit(main())
