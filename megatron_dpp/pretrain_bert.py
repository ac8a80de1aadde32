"""`torchrun ... -m megatron_dpp.pretrain_bert <Megatron-LM flags>`: megatron_dpp.pretrain with
--model bert (Megatron-LM's pretrain_bert.py, by name): the masked-LM loss and, unless
--bert-no-binary-head, the sentence-order loss, on Megatron-Core's BertModel."""
import sys

from megatron_dpp.pretrain import main as pretrain_main


def main(argv=None) -> int:
    return pretrain_main(argv, model="bert", prog="megatron_dpp.pretrain_bert",
                         description="Megatron-Core BERT pretraining with dynamic pipeline parallelism.")


if __name__ == "__main__":
    sys.exit(main())
