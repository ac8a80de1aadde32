"""Convert a Hugging Face Llama model directory into a checkpoint that
`--model llama --load DIR --finetune` trains from (see `--help`).

Thin wrapper over megatron_dpp.convert.convert_hf_llama; the conversion runs on the CPU.
"""
import os
import sys

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported: the conversion is CPU work

from megatron_dpp.convert.convert_hf_llama import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
