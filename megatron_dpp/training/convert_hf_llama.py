"""A Hugging Face Llama model directory (config.json and its weights: Llama 2, Llama 3, Llama 3.1
...) as a checkpoint that `--model llama --load DIR --finetune` trains from, at any tensor,
pipeline or virtual-pipeline layout (Megatron-Core's torch_dist format reshards on load):

    python tools/convert_hf_llama.py --hf-dir Meta-Llama-3-8B --save checkpoints/llama3-8b

It prints the model flags to train with (the shape, grouped-query attention, rotary base and
scaling, norm epsilon), which must be given to the trainer: a checkpoint holds tensors, and a
run's flags build the model they load into. The checkpoint holds the model only (no optimizer,
learning-rate schedule or RNG states), at iteration 0, in the weights' own dtype; a run loads it
with --finetune (or --no-load-optim --no-load-rng). It is written as the trainer writes its
checkpoints (a staging folder, checksums, then published with the tracker file).

One process on the CPU: it holds the model once in the weights' dtype, plus one weight file's
tensor at a time (16 GB and more for an 8B model in bf16). models/llama_hf.py says what maps where.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from typing import Optional, Sequence

from megatron_dpp.data.tokenizer import vocab_size_with_padding
from megatron_dpp.flag_errors import ArgsError, require_output_dir
from megatron_dpp.models import llama_hf
from megatron_dpp.one_line_errors import InputError, OneLineErrorParser

# The seed of the random initialization that the Hugging Face weights then replace.
_BUILD_SEED = 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="convert_hf_llama", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-dir", required=True,
                        help="The Hugging Face model directory: config.json and model.safetensors "
                             "(or its shards and index, or pytorch_model.bin). Local files only.")
    parser.add_argument("--save", required=True,
                        help="The checkpoint directory to write (the trainer's --load); "
                             "iter_0000000 and the tracker file go there.")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1,
                        help="The tensor-parallel size the run will train at (default 1): "
                             "Megatron pads the vocabulary to a multiple of "
                             "--make-vocab-size-divisible-by times it, and the checkpoint's "
                             "embedding and output layer must have the run's padded size.")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                        help="As the trainer's flag (default %(default)s).")
    return parser


def _model_args(flags: list[str], padded_vocab_size: int) -> argparse.Namespace:
    """The trainer's parsed flags for this model (pp = tp = 1, on the CPU)."""
    from megatron_dpp import arguments
    from megatron_dpp.models.flags import validate_model_args

    args = arguments.build_parser(model=llama_hf.FAMILY.name).parse_args(
        [*flags, "--seq-length", flags[flags.index("--max-position-embeddings") + 1],
         "--use-cpu-initialization"])
    llama_hf.FAMILY.validate(args)
    validate_model_args(args)
    args.virtual_pipeline_model_parallel_size = None
    args.padded_vocab_size = padded_vocab_size
    return args


def convert(hf_dir: str, save: str, tensor_parallel_size: int = 1,
            divisible_by: int = 128) -> tuple[str, list[str]]:
    """Write the checkpoint; returns (its iteration directory, the trainer's model flags).
    Raises InputError (one line) for a directory this cannot convert."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from megatron_dpp.models import MODEL_SPECS
    from megatron_dpp.models.transformer_config import transformer_config_from_args
    from megatron_dpp.platform import apply_cpu_patches
    from megatron_dpp.training.checkpointing import TrainState, save_checkpoint

    config = llama_hf.read_config(hf_dir)
    flags = llama_hf.trainer_flags(config)
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    if dtype not in llama_hf.DTYPE_FLAGS:
        raise InputError(f"{hf_dir}/config.json: torch_dtype {dtype!r} is not one of "
                         f"{sorted(llama_hf.DTYPE_FLAGS)}")
    flags += llama_hf.DTYPE_FLAGS[dtype]
    weights = llama_hf.HuggingFaceWeights(hf_dir)
    padded = vocab_size_with_padding(int(config["vocab_size"]), divisible_by,
                                     tensor_parallel_size)
    args = _model_args(flags, padded)
    spec = MODEL_SPECS[llama_hf.FAMILY.name]
    apply_cpu_patches(spec.cpu_patched_modules)
    with tempfile.TemporaryDirectory(prefix="convert_hf_llama_") as directory:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(directory, "store"), 1),
                                rank=0, world_size=1, timeout=datetime.timedelta(minutes=30))
        try:
            parallel_state.initialize_model_parallel(1, 1)
            tensor_parallel.model_parallel_cuda_manual_seed(_BUILD_SEED)
            (model,) = spec.build_chunks(args, transformer_config_from_args(args), _BUILD_SEED)
            state = llama_hf.megatron_state_dict(weights, config, padded)
            missing, unexpected = model.load_state_dict(state, strict=False)
            if missing or unexpected:  # the mapping and Megatron-Core disagree: a bug here
                raise RuntimeError(f"the converted state dict does not fit Megatron-Core's Llama: "
                                   f"missing {missing[:3]}, unexpected {unexpected[:3]}")
            del state
            with torch.no_grad():
                final = save_checkpoint(save, TrainState(), [model], None, None, args=args)
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
    return final, [flag for flag in flags if flag not in ("--bf16", "--fp16")]


def main(argv: Optional[Sequence[str]] = None) -> int:
    from megatron_dpp.kernels import install_warning_filters

    install_warning_filters()  # Megatron-Core's import-time "Apex is not installed" warnings
    args = build_parser().parse_args(argv)
    try:
        if args.tensor_model_parallel_size < 1 or args.make_vocab_size_divisible_by < 1:
            raise InputError("--tensor-model-parallel-size and --make-vocab-size-divisible-by "
                             "must be at least 1")
        if not os.path.isdir(args.hf_dir):
            raise InputError(f"--hf-dir {args.hf_dir!r} is not a directory")
        require_output_dir("--save", args.save)
        final, flags = convert(args.hf_dir, args.save, args.tensor_model_parallel_size,
                               args.make_vocab_size_divisible_by)
    except (InputError, ArgsError) as error:
        print(f"convert_hf_llama: error: {error}", file=sys.stderr)
        return 2
    print(f"convert_hf_llama: wrote {final} (the model only, iteration 0)")
    print(f"convert_hf_llama: train with: --model {llama_hf.FAMILY.name} {' '.join(flags)} "
          f"--load {args.save} "
          f"--finetune --tokenizer-type HuggingFaceTokenizer --tokenizer-model {args.hf_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
