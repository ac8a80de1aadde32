"""Megatron-LM-compatible entry point: tokenize JSONL into indexed datasets.

Thin wrapper over megatron_dpp.data.preprocess_data (see `--help`).
"""
import sys

from megatron_dpp.data.preprocess_data import main

if __name__ == "__main__":
    sys.exit(main())
