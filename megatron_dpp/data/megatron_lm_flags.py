"""Megatron-LM's data and tokenizer flags for what this runtime does not build (fill-in-the-middle
data, object storage, phase transitions, ...): flag -> why, in one line with what to use instead.
data/flags.py adds them to --help's "data" group and refuses each in one line (flag_errors.py);
each takes Megatron-LM's values, if any, so that the refusal answers.

Also the data flags that state what always holds here (flag_errors.StatedFlag). Standard library
only, as data/flags.py.
"""
from __future__ import annotations

from megatron_dpp.flag_errors import StatedFlag, each_refused


_FIM = ("configures Megatron-LM's fill-in-the-middle dataset, which is not built here: samples "
        "are Megatron-Core's GPT token windows of the documents")
_CACHE_PATH = ("is not built here: the dataset's index caches are built at start-up where they "
               "are missing (--data-cache-path, default beside the data)")

REFUSED_DATA: dict[str, str] = {
    **each_refused(_FIM, "--fim-data", "--fim-rate", "--fim-spm-rate", "--fim-split-sample",
            "--fim-fragment-rate", "--fim-no-prefix", "--fim-prefix-token", "--fim-middle-token",
            "--fim-suffix-token", "--fim-pad-token", "--fim-eod-token"),
    **each_refused(_CACHE_PATH, "--dataloader-defer-npy-index-mmap", "--dataloader-fast-cache-load",
            "--per-dataset-sequences-path"),
    "--object-storage-cache-path": "(s3 or MSC object storage) is not built here: --data-path "
                                   "names local files",
    "--mid-level-dataset-surplus": "is not a setting here: Megatron-Core's default surplus "
                                   "(0.005) builds the blend's datasets",
    "--phase-transition-iterations": "(a data blend that changes during the run) is not built "
                                     "here: restart with --load and another --data-path",
    "--sample-rate": "(sampling part of the training data) is not built here: --split and the "
                     "blend's weights choose the documents",
    "--allow-ambiguous-pad-tokens": "is not built here: the GPT data has no padding tokens "
                                    "(--variable-seq-lengths pads with a mask)",
    "--no-data-sharding": "applies to --dataloader-type cyclic's sampler, which is not built "
                          "here: the single sampler gives each data-parallel rank its slice",
    "--vocab-extra-ids": "(T5's span-masking tokens) does not apply: no model here is T5",
    "--legacy-tokenizer": "is not a choice here: the tokenizers are this project's "
                          "(megatron_dpp/data/tokenizer.py), chosen by --tokenizer-type",
    "--tokenizer-metadata": "(Megatron-Core's tokenizer metadata file) is not read here: "
                            "--tokenizer-type and its files give the tokenizer",
    "--trust-remote-code": "is not built here: a HuggingFaceTokenizer directory is read as local "
                           "files, and no code from it runs",
    "--tokenizer-hf-include-special-tokens": "is not a choice here: HuggingFaceTokenizer "
                                             "tokenizes documents as Megatron-LM's default, "
                                             "without it",
}

STATED_DATA: dict[str, StatedFlag] = {
    "--disable-msc": StatedFlag(
        holds="Multi-Storage Client is never used: data and checkpoints are local files"),
    "--tokenizer-hf-use-fast": StatedFlag(
        holds="HuggingFaceTokenizer loads the directory's fast tokenizer (tokenizer.json) "
              "through transformers' AutoTokenizer"),
}
