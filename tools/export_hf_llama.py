"""Export a --model llama checkpoint as a Hugging Face Llama directory (see `--help`).

Thin wrapper over megatron_dpp.convert.convert_hf_llama; the export runs on the CPU.
"""
import os
import sys

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported: the export is CPU work

from megatron_dpp.convert.convert_hf_llama import export_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(export_main())
