"""A Hugging Face Llama model directory (config.json and its weights: Llama 2, Llama 3, Llama 3.1,
Mistral v0.2 and later) as a checkpoint that `--model llama --load DIR --finetune` trains from, at any tensor,
pipeline or virtual-pipeline layout (Megatron-Core's torch_dist format reshards on load); and
the way back (export: tools/export_hf_llama.py), from a checkpoint saved at any layout:

    python tools/convert_hf_llama.py --hf-dir Meta-Llama-3-8B --save checkpoints/llama3-8b
    python tools/export_hf_llama.py --load checkpoints/run --save llama3-trained

It prints the model flags to train with (the shape, grouped-query attention, rotary base and
scaling, norm epsilon), which must be given to the trainer: a checkpoint holds tensors, and a
run's flags build the model they load into. The checkpoint holds the model only (no optimizer,
learning-rate schedule or RNG states), at iteration 0, in the weights' own dtype; a run loads it
with --finetune (or --no-load-optim --no-load-rng). It is written as the trainer writes its
checkpoints (a staging folder, checksums, then published with the tracker file).

One process on the CPU: it holds the model once in the weights' dtype, plus one weight file's
tensor at a time (16 GB and more for an 8B model in bf16). convert/llama_hf.py says what maps where.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import os
import sys
import tempfile
from typing import Optional, Sequence

from megatron_dpp.data.errors import DataInputError
from megatron_dpp.data.tokenizer import (HF_TOKENIZER_FILES, HUGGINGFACE, tiktoken_options,
                                         tokenizer_from_files, vocab_size_with_padding)
from megatron_dpp.flag_errors import ArgsError, require_output_dir
from megatron_dpp.convert import llama_hf
from megatron_dpp.one_line_errors import InputError, OneLineErrorParser
from megatron_dpp.parallel.layout import ParallelLayout

# The seed build_chunks takes (the model is built uninitialized: _build_model).
_BUILD_SEED = 0
# The files of a Hugging Face tokenizer directory that an export copies.
TOKENIZER_FILE_PREFIXES = ("tokenizer", "special_tokens_map", "added_tokens")


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
    args.parallel = ParallelLayout()  # one CPU process, pp = tp = 1
    args.padded_vocab_size = padded_vocab_size
    return args


@contextlib.contextmanager
def _one_cpu_process():
    """A gloo group of one rank with Megatron's parallel state at tp = pp = 1, on the CPU."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from megatron_dpp.models import MODEL_SPECS
    from megatron_dpp.mcore.cpu_patches import apply_cpu_patches

    apply_cpu_patches(MODEL_SPECS[llama_hf.FAMILY.name].cpu_patched_modules)
    with tempfile.TemporaryDirectory(prefix="convert_hf_llama_") as directory:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(directory, "store"), 1),
                                rank=0, world_size=1, timeout=datetime.timedelta(minutes=30))
        try:
            parallel_state.initialize_model_parallel(1, 1)
            tensor_parallel.model_parallel_cuda_manual_seed(_BUILD_SEED)
            yield
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def _build_model(args: argparse.Namespace):
    """The model, uninitialized: every parameter is then loaded (the load is strict), so a random
    initialization would be work thrown away (minutes for 8B on a CPU)."""
    from megatron_dpp.models import MODEL_SPECS
    from megatron_dpp.models.transformer_config import transformer_config_from_args

    spec = MODEL_SPECS[llama_hf.FAMILY.name]
    config = transformer_config_from_args(args)
    config.perform_initialization = False
    (model,) = spec.build_chunks(args, config, _BUILD_SEED)
    return model


def convert(hf_dir: str, save: str, tensor_parallel_size: int = 1,
            divisible_by: int = 128) -> tuple[str, list[str]]:
    """Write the checkpoint; returns (its iteration directory, the trainer's flags: the model's,
    and the tokenizer's where hf_dir has one). Raises InputError (one line) for a directory this
    cannot convert."""
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
    # The checkpoint remembers the tokenizer it came with, if any (export reads its vocabulary).
    has_tokenizer = any(os.path.isfile(os.path.join(hf_dir, name)) for name in HF_TOKENIZER_FILES)
    args.tokenizer_type = HUGGINGFACE if has_tokenizer else None
    args.tokenizer_model = hf_dir if has_tokenizer else None
    import torch

    from megatron_dpp.training.checkpoint.save_load import TrainState, save_checkpoint

    with _one_cpu_process():
        model = _build_model(args)
        state = llama_hf.megatron_state_dict(weights, config, padded)
        # Strict in effect: a parameter left out would stay uninitialized memory.
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:  # the mapping and Megatron-Core disagree: a bug here
            raise RuntimeError(f"the converted state dict does not fit Megatron-Core's Llama: "
                               f"missing {missing[:3]}, unexpected {unexpected[:3]}")
        del state
        with torch.no_grad():
            final = save_checkpoint(save, TrainState(), [model], None, None, args=args)
    model_flags = [flag for flag in flags if flag not in ("--bf16", "--fp16")]
    tokenizer_flags = (["--tokenizer-type", HUGGINGFACE, "--tokenizer-model", hf_dir]
                       if has_tokenizer else [])
    return final, model_flags + tokenizer_flags


def _saved_model_flags(saved: argparse.Namespace) -> list[str]:
    """The model flags of the run that saved a checkpoint (its args, as Megatron-LM keeps them)."""
    flags = ["--num-layers", saved.num_layers, "--hidden-size", saved.hidden_size,
             "--ffn-hidden-size", saved.ffn_hidden_size,
             "--num-attention-heads", saved.num_attention_heads,
             "--num-query-groups", saved.num_query_groups or saved.num_attention_heads,
             "--rotary-base", saved.rotary_base,
             # Absent from checkpoints of runs before the flag: its default then.
             "--norm-epsilon", repr(getattr(saved, "norm_epsilon", 1e-5)),
             "--max-position-embeddings", saved.max_position_embeddings]
    if getattr(saved, "use_rope_scaling", False):
        flags += ["--use-rope-scaling", "--rope-scaling-factor", repr(saved.rope_scaling_factor)]
    for dtype_flag in ("bf16", "fp16"):
        if getattr(saved, dtype_flag, False):
            flags.append(f"--{dtype_flag}")
    return [str(flag) for flag in flags]


def _vocabulary(saved: argparse.Namespace, vocab_size: Optional[int], directory: str):
    """(vocabulary size, bos, eos, the tokenizer directory to copy or None): --vocab-size, else
    the saving run's tokenizer where its files are still there."""
    if vocab_size is not None:
        return vocab_size, None, None, None
    tokenizer_type = getattr(saved, "tokenizer_type", None)
    if tokenizer_type is None:
        raise InputError(f"checkpoint {directory} names no tokenizer (converted from weights "
                         f"without one); pass --vocab-size N, the vocabulary before Megatron's "
                         f"padding")
    try:
        tokenizer = tokenizer_from_files(tokenizer_type, getattr(saved, "vocab_file", None),
                                         getattr(saved, "merge_file", None),
                                         getattr(saved, "tokenizer_model", None),
                                         getattr(saved, "vocab_size", None),
                                         **tiktoken_options(saved))
    except (DataInputError, TypeError) as error:
        raise InputError(f"checkpoint {directory}: its run's tokenizer ({tokenizer_type}) cannot "
                         f"be read here ({error}); pass --vocab-size N, the tokenizer's "
                         f"vocabulary before Megatron's padding") from None
    copy = saved.tokenizer_model if tokenizer_type == HUGGINGFACE else None
    return (tokenizer.vocab_size, getattr(tokenizer, "bos", None), tokenizer.eod, copy)


def export(load: str, save: str, vocab_size: Optional[int] = None) -> tuple[str, str]:
    """Write the Hugging Face directory `save` (config.json, model.safetensors, the tokenizer's
    files where the run had a Hugging Face tokenizer) from the checkpoint `load` names, saved at
    any layout; returns (the iteration folder read, save). Raises InputError (one line)."""
    from megatron.core import dist_checkpointing

    from megatron_dpp.training.checkpoint.save_load import find_checkpoint
    from megatron_dpp.training.checkpoint.torch_dist import CheckpointLoadError, saved_args

    try:
        import safetensors  # noqa: F401  (model.safetensors is written at the end)
    except ImportError:
        raise InputError("writing model.safetensors needs the safetensors package: pip install "
                         "safetensors") from None
    if os.path.exists(save) and (not os.path.isdir(save) or os.listdir(save)):
        raise InputError(f"--save {save!r} exists and is not an empty directory; the export "
                         f"writes a new one")
    with _one_cpu_process():
        try:
            found = find_checkpoint(load)
        except CheckpointLoadError as error:
            raise InputError(str(error)) from None
        directory = found.directory
        saved = saved_args(directory)
        if saved is None:
            raise InputError(f"checkpoint {directory} is not in the torch_dist format (--ckpt-"
                             f"format torch_dist, the default) or keeps no run args; the export "
                             f"reads a torch_dist checkpoint of this trainer")
        if getattr(saved, "model", None) != llama_hf.FAMILY.name:
            raise InputError(f"checkpoint {directory} is of model "
                             f"{getattr(saved, 'model', None)!r}; the export writes "
                             f"{llama_hf.FAMILY.name}'s")
        vocab, bos, eos, tokenizer_dir = _vocabulary(saved, vocab_size, directory)
        if vocab > saved.padded_vocab_size:
            raise InputError(f"--vocab-size {vocab} exceeds the checkpoint's padded vocabulary "
                             f"{saved.padded_vocab_size}")
        args = _model_args(_saved_model_flags(saved), saved.padded_vocab_size)
        model = _build_model(args)
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, directory)
        model.load_state_dict(loaded["model"], strict=True)
        state = {name: value.detach() for name, value in model.state_dict().items()
                 if hasattr(value, "detach")}  # not the layers' empty _extra_state entries
    # One dtype for the file, the embedding's: a bf16 run's (or converted) norms may be fp32.
    dtype = state["embedding.word_embeddings.weight"].dtype
    config = llama_hf.hf_config(args, vocab, dtype, bos, eos)
    tensors = {name: tensor.to(dtype)
               for name, tensor in llama_hf.hf_state_dict(state, config).items()}
    _write_hf_directory(save, config, tensors, tokenizer_dir)
    return directory, save


def _write_hf_directory(save: str, config: dict, tensors: dict, tokenizer_dir: Optional[str]):
    """config.json, model.safetensors and the tokenizer's files, written into a temporary
    sibling directory and renamed, so a failed export leaves no partial model behind."""
    import json
    import shutil

    from safetensors.torch import save_file

    parent = os.path.dirname(os.path.abspath(save))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".export_hf_llama_", dir=parent)
    try:
        with open(os.path.join(staging, "config.json"), "w", encoding="utf-8") as handle:
            json.dump(config, handle, indent=2)
        save_file(tensors, os.path.join(staging, "model.safetensors"), metadata={"format": "pt"})
        if tokenizer_dir is not None:
            for name in os.listdir(tokenizer_dir):
                if name.startswith(TOKENIZER_FILE_PREFIXES):
                    shutil.copy2(os.path.join(tokenizer_dir, name), staging)
        if os.path.isdir(save):
            os.rmdir(save)  # empty (checked before)
        os.replace(staging, save)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _quiet_imports() -> None:
    """Megatron-Core's import-time warnings ("Apex is not installed", ...), and torch's log line
    "No CUDA runtime is found" from torch.utils.cpp_extension, which Megatron-Core imports: a
    CUDA build of torch logs it where it sees no GPU, as in this CPU work (the tools hide the
    GPUs)."""
    from megatron_dpp.kernels import install_warning_filters

    install_warning_filters()
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


def main(argv: Optional[Sequence[str]] = None) -> int:
    _quiet_imports()
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
          f"--load {args.save} --finetune")
    return 0


def build_export_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="export_hf_llama",
        description="A --model llama checkpoint (torch_dist, saved at any layout) as a Hugging "
                    "Face Llama directory: config.json, model.safetensors and, where the run "
                    "read a Hugging Face tokenizer directory, its files.")
    parser.add_argument("--load", required=True,
                        help="The checkpoint: a --save directory (the iteration its tracker "
                             "names) or one of its iter_NNNNNNN folders.")
    parser.add_argument("--save", required=True,
                        help="The Hugging Face directory to write (new, or empty).")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="The vocabulary before Megatron's padding (default: the saving "
                             "run's tokenizer's, read from its files).")
    return parser


def export_main(argv: Optional[Sequence[str]] = None) -> int:
    _quiet_imports()
    args = build_export_parser().parse_args(argv)
    try:
        if args.vocab_size is not None and args.vocab_size < 1:
            raise InputError(f"--vocab-size must be positive, got {args.vocab_size}")
        if not os.path.isdir(args.load):
            raise InputError(f"--load {args.load!r} is not a directory")
        directory, save = export(args.load, args.save, args.vocab_size)
    except (InputError, ArgsError) as error:
        print(f"export_hf_llama: error: {error}", file=sys.stderr)
        return 2
    print(f"export_hf_llama: wrote {save} (config.json, model.safetensors) from {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
