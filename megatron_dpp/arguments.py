"""Megatron-LM style command-line flags and their validation: the composition of every package's.

Each package declares its flag groups beside its config, one `add_<group>_args(parser)` and one
`validate_<group>_args(args)` per group: models/flags.py (model shape), parallel/flags.py
(parallelism), comm/flags.py (multi-node, transport), training/flags.py (training, checkpointing,
logging, tracing, profiling), data/flags.py, runtime/flags.py (DPP); each model's own flags are its
family's (models/families.py).
Validation runs before any process group exists: a bad combination raises `ArgsError`
(flag_errors.py) with one line that says what is wrong and how to fix it; `parse_args` prints that
line and exits with code 2.

Names and semantics follow Megatron-LM (`--help` lists them). The parsed result is a plain
argparse Namespace holding the flags as given, plus `args.parallel`, the frozen layout the
parallelism flags imply (parallel/layout.py's ParallelLayout); `megatron_dpp.training.config` turns
them into config dataclasses.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional, Sequence

from megatron_dpp.comm.flags import (add_multinode_args, add_transport_args,
                                     validate_multinode_args, validate_transport_args)
from megatron_dpp.data import flags as data_flags
from megatron_dpp.exit_codes import BAD_INPUT
from megatron_dpp.flag_errors import ArgsError, check_refused_flags, check_stated_flags, require
from megatron_dpp.kernels import install_warning_filters
from megatron_dpp.mcore.version import installed_version, version_obstacle
from megatron_dpp.models import families
from megatron_dpp.models import megatron_lm_flags as model_megatron_lm_flags
from megatron_dpp.models.flags import (REFUSED_MODEL_FLAGS, add_model_args,
                                       largest_microbatch_activation_bytes,
                                       validate_cuda_graph_args, validate_model_args)
from megatron_dpp.one_line_errors import InputError, OneLineErrorParser
from megatron_dpp.parallel import megatron_lm_flags as parallel_megatron_lm_flags
from megatron_dpp.parallel.flags import (REFUSED_PARALLEL_FLAGS, add_parallel_args,
                                         validate_parallel_args)
from megatron_dpp.rank_failure import fail
from megatron_dpp.runtime import flags as dpp_flags
from megatron_dpp.runtime.flags import add_dpp_args
from megatron_dpp.training.flags import (
    REFUSED_CHECKPOINT_FLAGS, REFUSED_LOGGING_FLAGS, REFUSED_PROFILE_FLAGS, REFUSED_TRAINING_FLAGS,
    add_checkpoint_args, add_logging_args, add_profile_args, add_trace_args,
    add_training_args, validate_checkpoint_args, validate_logging_args, validate_profile_args,
    validate_trace_args, validate_training_args)
from megatron_dpp.training import megatron_lm_flags as training_megatron_lm_flags

# Megatron-LM flags that cannot apply here, each in its group (--help explains it): flag -> why.
REFUSED_FLAGS: dict[str, str] = {**REFUSED_MODEL_FLAGS, **REFUSED_PARALLEL_FLAGS,
                                  **REFUSED_TRAINING_FLAGS, **data_flags.REFUSED_DATA_FLAGS,
                                  **REFUSED_CHECKPOINT_FLAGS, **REFUSED_LOGGING_FLAGS,
                                  **REFUSED_PROFILE_FLAGS}
# Megatron-LM flags that state what always holds here, each in its group (flag_errors.StatedFlag).
STATED_FLAGS = {**model_megatron_lm_flags.STATED_MODEL,
                **parallel_megatron_lm_flags.STATED_PARALLEL,
                **training_megatron_lm_flags.STATED_TRAINING,
                **training_megatron_lm_flags.STATED_CHECKPOINT,
                **training_megatron_lm_flags.STATED_LOGGING, **data_flags.megatron_lm_flags.STATED_DATA}
# The tokenizers some model trains with; each model's own are in models/families.py.
TOKENIZER_TYPES = families.TOKENIZER_TYPES


def validate_megatron_core_version(args: argparse.Namespace) -> None:
    """The version gate, first: an unsupported megatron-core is one line before anything runs."""
    obstacle = version_obstacle(installed_version())
    require(obstacle is None, obstacle)


def validate_refused_args(args: argparse.Namespace) -> None:
    """The first REFUSED_FLAGS flag given: one line with its reason; then a STATED_FLAGS value
    whose meaning does not hold here."""
    check_refused_flags(args, REFUSED_FLAGS)
    check_stated_flags(args, STATED_FLAGS)


def derive_parallel_layout(args: argparse.Namespace) -> None:
    """The parallelism flags' checks; their result, the frozen layout they imply, becomes
    args.parallel: the one value validation adds for the parallel layout, read by the validators
    after it and by everything that runs."""
    args.parallel = validate_parallel_args(args)


def dpp_minimum_budget_bytes(args: argparse.Namespace) -> Optional[int]:
    """The least --dpp-memory-budget byte count the dynamic policies run with on these flags: the
    pipeline's minimum_budget_bytes (one full-length microbatch on each model chunk of a rank) over
    the activation bytes the runtime counts for one (models/flags.py). None while
    --micro-batch-size is invalid. With --dpp-split-backward the runtime adds what each
    microbatch's W keeps, measured on the built chunks: the budget must exceed this by that much."""
    from megatron_dpp.pipeline.budget import minimum_budget_bytes  # (not loaded with this module)

    largest = largest_microbatch_activation_bytes(args)
    return None if largest is None else minimum_budget_bytes(args.parallel.chunks_per_rank, largest)


def validate_shared_gpu_memory(args: argparse.Namespace) -> None:
    """With ranks sharing a GPU (the launcher's --ranks-per-gpu): they must fit its memory."""
    from megatron_dpp.shared_gpu_memory import shared_gpu_memory_error

    problem = shared_gpu_memory_error(args)
    require(problem is None, problem)


def validate_dpp_args(args: argparse.Namespace) -> None:
    """The DPP runtime's flags, an explicit budget against the model's minimum."""
    dpp_flags.validate_dpp_args(args, dpp_minimum_budget_bytes(args))


def add_data_args(parser: argparse.ArgumentParser) -> None:
    data_flags.add_data_args(parser, tokenizer_types=TOKENIZER_TYPES)


def validate_data_args(args: argparse.Namespace) -> None:
    """The data's checks, then the model's: each builds its samples its own way."""
    data_flags.validate_data_args(args, families.model_family(args.model).check_data)


ARG_GROUPS: list[Callable[[argparse.ArgumentParser], None]] = [
    add_model_args,
    add_parallel_args,
    add_multinode_args,
    add_training_args,
    add_checkpoint_args,
    add_logging_args,
    add_data_args,
    add_transport_args,
    add_dpp_args,
    add_trace_args,
    add_profile_args,
]

# Order matters: later validators read values the earlier ones derive (args.parallel, the ffn
# size, the number of micro-batches).
VALIDATORS: list[Callable[[argparse.Namespace], None]] = [
    validate_model_args,
    derive_parallel_layout,
    validate_multinode_args,
    validate_training_args,
    validate_checkpoint_args,
    validate_logging_args,
    validate_data_args,
    validate_transport_args,
    validate_dpp_args,
    validate_shared_gpu_memory,
    validate_trace_args,
    validate_profile_args,
    validate_cuda_graph_args,
]


DEFAULT_DESCRIPTION = "Megatron-Core pretraining with dynamic pipeline parallelism."


def _add_model_choice(parser: argparse.ArgumentParser, model: Optional[str]) -> None:
    """`--model` on the one entry point (megatron_dpp.pretrain); an alias (pretrain_gpt) fixes the
    model instead. model: the value already read from the command line (None: not yet)."""
    parser.add_argument(
        "--model", choices=sorted(families.MODEL_FAMILIES), required=model is None, default=model,
        help="The model to train (its own flags are listed with --model NAME --help): "
             + "; ".join(f.summary for f in families.MODEL_FAMILIES.values()) + ".")


def _model_from_argv(argv: Sequence[str], prog: str) -> Optional[str]:
    """The --model value of the one entry point's command line, read before the full parser is
    built (the model's own flag group depends on it); None when absent."""
    finder = OneLineErrorParser(prog=prog, add_help=False, allow_abbrev=False)
    finder.add_argument("--model", choices=sorted(families.MODEL_FAMILIES))
    known, _ = finder.parse_known_args(argv)
    return known.model


def build_parser(prog: str = "megatron_dpp", description: str = DEFAULT_DESCRIPTION,
                 model: Optional[str] = families.DEFAULT_MODEL, model_flag: bool = False) -> argparse.ArgumentParser:
    """Every shared flag group and the model's own; `prog`, `description` and `model` are the
    entry point's. model_flag: the parser takes --model (the one entry point, megatron_dpp.pretrain;
    model is then the value read from the command line, or None when it has none: no model's own
    flags are listed). args.model is the model's name."""
    if model is not None:
        require(model in families.MODEL_FAMILIES,
                f"unknown model {model!r}; one of {sorted(families.MODEL_FAMILIES)}")
    parser = OneLineErrorParser(prog=prog, allow_abbrev=False, description=description)
    if model_flag:
        _add_model_choice(parser, model)
    for add_group in ARG_GROUPS:
        add_group(parser)
    if model is not None:
        families.MODEL_FAMILIES[model].add_args(parser)
        parser.set_defaults(model=model)
    return parser


def _validate_model_args(args: argparse.Namespace) -> None:
    try:
        families.model_family(args.model).validate(args)
    except InputError as error:
        raise ArgsError(str(error)) from None


def validate_args(args: argparse.Namespace) -> None:
    """Check and complete `args` in place; raises ArgsError. Creates no process group. The model's
    checks run before the shared ones (the data checks need the model's tokenizer default)."""
    for validate in [validate_megatron_core_version, validate_refused_args, _validate_model_args,
                     *VALIDATORS]:
        validate(args)


def parse_args(argv: Optional[Sequence[str]] = None, prog: str = "megatron_dpp",
               description: str = DEFAULT_DESCRIPTION,
               model: Optional[str] = families.DEFAULT_MODEL) -> argparse.Namespace:
    """Parse and validate; on a bad flag print one line to stderr and exit with code 2. model None:
    the command line names it with --model (megatron_dpp.pretrain)."""
    # Megatron-Core warns on import when Transformer Engine and Apex are absent (always on CPU) and
    # falls back to torch; the `kernels:` startup lines say so instead, and the warning would also
    # break the one-line error of a flag checked after the data validator imports Megatron.
    install_warning_filters()
    argv = list(sys.argv[1:] if argv is None else argv)
    model_flag = model is None
    if model_flag:
        model = _model_from_argv(argv, prog)
    parser = build_parser(prog, description, model, model_flag=model_flag)
    args = parser.parse_args(argv)
    try:
        validate_args(args)
    except ArgsError as error:
        fail(f"{parser.prog}: error: {error}", exit_code=BAD_INPUT)
    return args


if __name__ == "__main__":
    # `WORLD_SIZE=N python -m megatron_dpp.arguments [MODEL] <flags>`: validate only (exit 0, or 2
    # with the one-line error), e.g. before a launcher starts N processes. The model (default
    # families.DEFAULT_MODEL) is a bare word: flags start with "--".
    argv = sys.argv[1:]
    model = argv.pop(0) if argv and argv[0] in families.MODEL_FAMILIES else families.DEFAULT_MODEL
    parse_args(argv, model=model)
