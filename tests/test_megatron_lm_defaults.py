"""A flag the user does not give has Megatron-LM's default (core_v0.16.1's parser, the release of
Megatron-Core 0.16.1): tests/data/megatron_lm_core_v0.16.1_defaults.json, written by
`python tools/megatron_lm_flags.py GIT_DIR core_v0.16.1 --defaults`, holds the value of each
destination of Megatron-LM's parser on an empty command line.

For every Megatron-LM flag that works here (not one of megatron_dpp.arguments.REFUSED_FLAGS, nor
an accepted "always so here" flag: the last test checks those), our GPT parser's default of the
destination the flag sets equals Megatron-LM's default of its own, except:

- FILLED_IN: our parser's None marks "not given" (a flag that configures nothing in this run is
  then refused in one line), and the value the run uses is Megatron-LM's default: validate_args
  fills it in, or the code that reads it uses a constant; the test checks that value;
- DIFFERENCES: a documented difference, each with its reason;
- ELSEWHERE: the GPT architecture flags, whose defaults another piece of work is building.

Values Megatron-LM's validate_args (or its training.py) derives from other flags when a flag is
not given are not parser defaults (the JSON holds its parser's None for them); reading
core_v0.16.1's validate_args, ours derives the same (DERIVED, checked on a validated command
line): global_batch_size = micro-batch x data-parallel size; ffn_hidden_size = 4 x hidden (with
--swiglu 2/3 of it rounded down to a multiple of 64, an architecture flag); kv_channels = hidden /
heads (ours keeps None and uses families.head_size, the same number); dataloader_type 'single';
split '969, 30, 1' with --data-path and no --split; lr_decay_iters = train_iters (training.py's
get_optimizer_param_scheduler). One differs: max_position_embeddings (None in both parsers),
which Megatron-LM requires (validate_args' required_args stops without it) and ours derives as
--seq-length, the smallest that runs; and distributed_backend (DIFFERENCES) is gloo on CPU ranks.
"""
import argparse
import enum
import json
from pathlib import Path

import pytest

from _train_util import TINY_GPT_ARGS, data_args, run_training, without_flags
from megatron_dpp.arguments import REFUSED_FLAGS, STATED_FLAGS, build_parser, validate_args
from megatron_dpp.data.flags import DEFAULT_SPLIT
from megatron_dpp.data.tokenizer import DEFAULT_TIKTOKEN_NUM_SPECIAL_TOKENS
from megatron_dpp.models.families import head_size
from megatron_dpp.training.flags import PROFILE_RANKS, PROFILE_STEP_END, PROFILE_STEP_START

DEFAULTS_FILE = Path(__file__).parent / "data" / "megatron_lm_core_v0.16.1_defaults.json"
_DOCUMENT = json.loads(DEFAULTS_FILE.read_text())
FLAG_DESTS: dict[str, str] = _DOCUMENT["_flag_dests"]
MEGATRON_LM: dict[str, object] = {dest: value for dest, value in _DOCUMENT.items()
                                  if not dest.startswith("_")}

MINIMAL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
           "--seq-length", "64", "--micro-batch-size", "1", "--train-iters", "5", "--lr", "1e-3"]
WORLD_SIZE = 2

_NOT_GIVEN = ("our parser's None marks the flag not given (it is refused in one line where it "
              "configures nothing in this run); ")
# dest -> (reason, the value the run uses: a function of the validated minimal command line).
FILLED_IN = {
    **{dest: (_NOT_GIVEN + "validate_args fills in Megatron-LM's value (OPTIMIZER_DEFAULTS)",
              lambda args, dest=dest: getattr(args, dest))
       for dest in ("adam_beta1", "adam_beta2", "adam_eps", "sgd_momentum")},
    **{dest: (_NOT_GIVEN + "validate_args fills in Megatron-LM's value "
                           "(DYNAMIC_LOSS_SCALE_DEFAULTS)",
              lambda args, dest=dest: getattr(args, dest))
       for dest in ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")},
    "profile_step_start": (_NOT_GIVEN + "with --profile, validate_args fills in "
                                        "PROFILE_STEP_START", lambda args: PROFILE_STEP_START),
    "profile_step_end": (_NOT_GIVEN + "with --profile, validate_args fills in PROFILE_STEP_END",
                         lambda args: PROFILE_STEP_END),
    "profile_ranks": (_NOT_GIVEN + "with --profile, validate_args fills in PROFILE_RANKS",
                      lambda args: PROFILE_RANKS),
    "tiktoken_num_special_tokens": (
        _NOT_GIVEN + "TikTokenizer is built with DEFAULT_TIKTOKEN_NUM_SPECIAL_TOKENS",
        lambda args: DEFAULT_TIKTOKEN_NUM_SPECIAL_TOKENS),
}

# dest -> why our default differs from Megatron-LM's.
DIFFERENCES = {
    "eval_interval": "Megatron-LM's None cannot train: its training.py "
                     "(get_train_valid_test_num_samples) computes train_iters // eval_interval "
                     "and stops with a TypeError unless --skip-train or --full-validation; 1000 "
                     "is its default up to core_v0.15.3",
    "distributed_backend": "Megatron-LM's nccl cannot start on CPU ranks; not given, "
                           "validate_args picks nccl with CUDA (Megatron-LM's) and gloo without",
    "local_rank": "Megatron-LM's default is $LOCAL_RANK read when its parser is built (0 unset); "
                  "here each rank's device is its LOCAL_RANK's itself, the same value, and a "
                  "given --local-rank must equal it",
    "transformer_impl": "Megatron-LM's transformer_engine cannot run without Transformer Engine "
                        "(its layer specs need it); not given, Transformer Engine's layers are "
                        "used where it is installed on a GPU (Megatron-LM's), else the local ones",
}

# The GPT architecture flags' destinations whose defaults differ (None: not given; each model family
# fills in its own), being built elsewhere (models/families.py); not checked here.
ELSEWHERE = {"add_bias_linear", "add_position_embedding", "add_qkv_bias",
             "apply_query_key_layer_scaling", "rope_scaling_factor", "use_rope_scaling",
             "group_query_attention", "normalization", "num_query_groups",
             "position_embedding_type", "qk_layernorm", "rotary_base", "rotary_percent",
             "squared_relu", "swiglu", "use_rotary_position_embeddings"}

# An accepted flag whose Megatron-LM default is a value it does not accept: flag -> why.
STATED_DIFFERENCES = {
    "--rerun-mode": "Megatron-LM's validate_results re-runs an iteration whose loss is NaN, Inf "
                    "or spiky to tell a transient fault from a reproducible one, and then stops; "
                    "its re-run state machine is not built here, and a NaN or Inf in the loss or "
                    "the gradients stops the run in one line at once",
}


def _json_form(value):
    """A default as the JSON file writes one (tools/megatron_lm_flags.py's _json_value)."""
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        return [_json_form(item) for item in value]
    return value


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_parser(model="gpt")


@pytest.fixture(scope="module")
def ours(parser) -> dict:
    return {dest: _json_form(value) for dest, value in vars(parser.parse_args([])).items()}


@pytest.fixture()
def validated(parser, monkeypatch) -> argparse.Namespace:
    """The minimal GPT command line with the sample data, validated at world size 2."""
    monkeypatch.setenv("WORLD_SIZE", str(WORLD_SIZE))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    args = parser.parse_args([*data_args(), *MINIMAL])
    validate_args(args)
    return args


def _compared(parser) -> dict[str, tuple[str, str]]:
    """Megatron-LM's destination -> (one of its flags that works here, our destination)."""
    option_dests = {option: action.dest for action in parser._actions
                    for option in action.option_strings}
    pairs = {}
    for flag, dest in FLAG_DESTS.items():
        if flag in REFUSED_FLAGS or flag in STATED_FLAGS or flag not in option_dests:
            continue
        pairs.setdefault(dest, (flag, option_dests[flag]))
    return pairs


def test_the_defaults_file_is_megatron_lms_parser():
    assert "tools/megatron_lm_flags.py" in _DOCUMENT["_made_by"]
    assert MEGATRON_LM["lr_decay_style"] == "linear" and MEGATRON_LM["eval_iters"] == 100
    assert len(FLAG_DESTS) > 600 and set(FLAG_DESTS.values()) <= set(MEGATRON_LM)


def test_every_default_is_megatron_lms(parser, ours):
    wrong, compared = [], 0
    for dest, (flag, our_dest) in sorted(_compared(parser).items()):
        if dest in ELSEWHERE or dest in DIFFERENCES or dest in FILLED_IN:
            continue
        compared += 1
        if ours[our_dest] != MEGATRON_LM[dest]:
            wrong.append(f"{flag}: ours {ours[our_dest]!r}, Megatron-LM's {MEGATRON_LM[dest]!r}")
    assert not wrong, "defaults that differ from Megatron-LM's:\n" + "\n".join(wrong)
    assert compared > 130


def test_each_documented_difference_is_one(parser, ours):
    """A table entry whose default now equals Megatron-LM's (or whose flag is gone) is stale."""
    compared = _compared(parser)
    for dest in [*DIFFERENCES, *FILLED_IN]:
        assert dest in compared, f"{dest}: no flag of ours sets it"
        flag, our_dest = compared[dest]
        assert ours[our_dest] != MEGATRON_LM[dest], (
            f"{flag}: ours is now Megatron-LM's {MEGATRON_LM[dest]!r}; drop it from the table")
    for dest in FILLED_IN:
        assert ours[compared[dest][1]] is None, f"{dest}: FILLED_IN is for None defaults"


def test_a_default_filled_in_is_megatron_lms(validated):
    wrong = [f"{dest}: the run uses {use(validated)!r}, Megatron-LM's default is "
             f"{MEGATRON_LM[dest]!r}" for dest, (_reason, use) in FILLED_IN.items()
             if _json_form(use(validated)) != MEGATRON_LM[dest]]
    assert not wrong, "\n".join(wrong)


def test_values_derived_when_not_given_are_megatron_lms(validated):
    args = validated
    # Megatron-LM's validate_args / training.py rules, as read in core_v0.16.1.
    assert args.global_batch_size == args.micro_batch_size * WORLD_SIZE
    assert args.ffn_hidden_size == 4 * args.hidden_size
    assert head_size(args) == args.hidden_size // args.num_attention_heads
    assert args.dataloader_type == "single"
    assert DEFAULT_SPLIT == "969, 30, 1"
    assert args.lr_decay_iters == args.train_iters
    assert args.max_position_embeddings == args.seq_length  # Megatron-LM requires it
    assert args.parallel.distributed_backend == "gloo"  # DIFFERENCES: CPU ranks


def test_accepted_flags_default_to_what_holds_here():
    """An accepted flag that takes values: Megatron-LM's default is one it accepts (so a command
    line without it means what holds here), or STATED_DIFFERENCES says why not."""
    wrong = []
    for flag, spec in STATED_FLAGS.items():
        if not spec.values:
            continue
        default = MEGATRON_LM[FLAG_DESTS[flag]]
        if (default in spec.values) == (flag in STATED_DIFFERENCES):
            wrong.append(f"{flag}: Megatron-LM's default {default!r}, accepted here "
                         f"{spec.values}, in STATED_DIFFERENCES: {flag in STATED_DIFFERENCES}")
    assert not wrong, "\n".join(wrong)


def test_megatron_lms_two_loader_workers_train_as_none():
    """--num-workers' default, 2 (Megatron-LM's): the same losses as batches built in the rank."""
    base = without_flags(TINY_GPT_ARGS, "--num-workers", "--eval-iters")
    evaluated = ["--eval-iters", "1", "--eval-interval", "2", "--train-iters", "4"]
    rc, with_workers, _norms, out = run_training(evaluated, nproc=1, base_args=base)
    assert rc == 0, out[-3000:]
    rc, in_rank, _norms, out = run_training([*evaluated, "--num-workers", "0"], nproc=1,
                                            base_args=base)
    assert rc == 0, out[-3000:]
    assert len(with_workers) == 4 and with_workers == in_rank
