"""parallel/split.py against Megatron-Core: the splits it accepts are the ones Megatron-Core's
TransformerConfig and get_num_layers_to_build accept, with the same layers per model chunk, and each
refusal is one line naming the flags."""
import itertools

import pytest
import torch

from megatron_dpp.flag_errors import ArgsError
from megatron_dpp.parallel.split import PipelineSplit


def megatron_chunk_layers(split: PipelineSplit):
    """Megatron-Core's layers per [pipeline rank][virtual stage], or None where it refuses."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    try:
        config = TransformerConfig(
            num_layers=split.num_layers, hidden_size=8, num_attention_heads=2,
            pipeline_dtype=torch.float32,
            pipeline_model_parallel_size=split.pipeline_size,
            virtual_pipeline_model_parallel_size=split.virtual_size,
            num_layers_in_first_pipeline_stage=split.first,
            num_layers_in_last_pipeline_stage=split.last,
            account_for_embedding_in_pipeline_split=split.embedding_is_a_layer,
            account_for_loss_in_pipeline_split=split.loss_is_a_layer)
        vpp = split.virtual_size
        counts = [[get_num_layers_to_build(config, vp_stage=stage if vpp else None, pp_rank=rank)
                   for stage in range(vpp or 1)] for rank in range(split.pipeline_size)]
    except (AssertionError, ValueError):
        return None
    # A first/last count above --num-layers passes Megatron-Core's checks and leaves another
    # stage a negative count, which fails later, when its block is built: a refusal too.
    return None if min(min(rank) for rank in counts) < 0 else counts


def ours(split: PipelineSplit):
    try:
        split.check()
    except ArgsError as error:
        assert "\n" not in str(error)
        return None
    return split.chunk_layers()


def grid():
    for layers, pp, vpp, first, last, embedding, loss in itertools.product(
            (1, 2, 3, 4, 5, 6, 8), (1, 2, 3, 4), (None, 2), (None, 0, 1, 2, 3, 4),
            (None, 1, 2, 4), (False, True), (False, True)):
        if vpp and pp == 1:
            continue  # virtual stages need pp > 1 (validate_parallel_args refuses it first)
        yield PipelineSplit(layers, pp, vpp, first, last, embedding, loss)


def test_accepts_and_counts_as_megatron_core():
    checked = refused = 0
    for split in grid():
        expected = megatron_chunk_layers(split)
        if split.pipeline_size == 1 and split.uneven:
            # Megatron-Core takes a first/last count with one stage when it is every layer; that
            # is no split at all, so ours asks to remove the flag.
            assert ours(split) is None, split
            continue
        assert ours(split) == expected, split
        checked += 1
        refused += expected is None
    assert checked > 1000 and 0 < refused < checked  # both sides of the rules were exercised


@pytest.mark.parametrize("split, words", [
    (PipelineSplit(4, 3), "--num-layers 4 is not divisible by --pipeline-model-parallel-size 3; "
                          "change --num-layers, or split unevenly with "
                          "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers"),
    (PipelineSplit(4, 2, embedding_is_a_layer=True),
     "--num-layers 4 + 1 (--account-for-embedding-in-pipeline-split) = 5 layers is not divisible "
     "by --pipeline-model-parallel-size 2"),
    (PipelineSplit(4, 2, first=4), "--decoder-first-pipeline-num-layers 4 leaves 0 of --num-layers "
                                   "4 for the other pipeline stage; each needs at least one layer"),
    (PipelineSplit(8, 4, first=1, last=2), "--decoder-first-pipeline-num-layers 1 + "
                                           "--decoder-last-pipeline-num-layers 2 leave 5 of "
                                           "--num-layers 8 for the other 2 pipeline stages, which "
                                           "do not split them evenly"),
    (PipelineSplit(4, 2, first=1, last=2), "leave 1 of --num-layers 4 for no other stage"),
    (PipelineSplit(4, 2, 2, first=1), "--decoder-first-pipeline-num-layers 1 is not divisible by "
                                      "the 2 virtual stages per pipeline rank"),
    (PipelineSplit(4, 2, last=0), "--decoder-last-pipeline-num-layers 0: a stage needs at least "
                                  "one layer"),
    (PipelineSplit(4, 1, last=4), "--decoder-last-pipeline-num-layers splits layers over pipeline "
                                  "stages; set --pipeline-model-parallel-size 2 or more"),
    (PipelineSplit(4, 2, last=3, loss_is_a_layer=True), "do not go with"),
])
def test_refusals_say_which_flags(split, words):
    with pytest.raises(ArgsError, match=None) as error:
        split.check()
    assert words in str(error.value)


LAYOUT_ERRORS = {
    # flags -> words of the one-line error
    ("Et|tttL", "--num-virtual-stages-per-pipeline-rank", "2"):
        "--pipeline-model-parallel-layout gives the virtual stages itself (its stages / "
        "--pipeline-model-parallel-size); remove --num-virtual-stages-per-pipeline-rank",
    ("Et|tttL", "--decoder-first-pipeline-num-layers", "1"):
        "--pipeline-model-parallel-layout places every layer itself; remove "
        "--decoder-first-pipeline-num-layers",
    ("Et|t|ttL",): "--pipeline-model-parallel-layout 'Et|t|ttL' has 3 stages, not a multiple of "
                   "--pipeline-model-parallel-size 2",
    ("Et|tL",): "--pipeline-model-parallel-layout 'Et|tL' places 2 transformer layers ('t'), "
                "--num-layers is 4",
    ("tE|tttL",): "The first layer must be embedding",
    ("Et|tttx",): "Invalid layer character: x",
    ("Et|tttmL",): "'m' (multi-token prediction layers) is not built here",
}


@pytest.mark.parametrize("flags", list(LAYOUT_ERRORS))
def test_layout_refusals_are_one_line(monkeypatch, capsys, flags):
    from _train_util import TINY_GPT_ARGS, data_args, flag_error

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    layout, *others = flags
    line = flag_error(capsys, [*data_args(), *TINY_GPT_ARGS, "--pipeline-model-parallel-size", "2",
                               "--pipeline-model-parallel-layout", layout, *others])
    assert LAYOUT_ERRORS[flags] in line, line


def test_layout_gives_each_chunk_its_layers(monkeypatch):
    """Megatron-Core's parse of the layout, counted per chunk; its stages beyond the pipeline's
    size are virtual stages, in Megatron's order (stage k on rank k mod PP)."""
    from _train_util import TINY_GPT_ARGS, data_args
    from megatron_dpp.arguments import parse_args
    from megatron_dpp.parallel.flags import pipeline_split_from_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    args = parse_args([*data_args(), *TINY_GPT_ARGS, "--pipeline-model-parallel-size", "2",
                       "--pipeline-model-parallel-layout", "E,t*2|t|t|L"], model="gpt")
    assert args.parallel.virtual_pipeline_model_parallel_size == 2
    split = pipeline_split_from_args(args)
    assert split.chunk_layers() == [[2, 1], [1, 0]] and split.describe() == "2+1 | 1+0"


@pytest.mark.parametrize("layout, pp", [("Et|tttL", 2), ("Ett|t|t|L", 2), ("Et|(tt|)*2,tL", 2),
                                         ("Et*3|t*3|t*2,L", 3)])
def test_layout_counts_are_megatron_cores(layout, pp):
    """layout_layers over Megatron-Core's parsed layout against its count, every (rank, virtual
    stage); and PipelineSplit.from_config reads them off the TransformerConfig."""
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    from megatron_dpp.parallel.split import layout_layers

    num_layers = {"Et|tttL": 4, "Ett|t|t|L": 4, "Et|(tt|)*2,tL": 6, "Et*3|t*3|t*2,L": 8}[layout]
    config = TransformerConfig(num_layers=num_layers, hidden_size=8, num_attention_heads=2,
                               pipeline_dtype=torch.float32, pipeline_model_parallel_size=pp,
                               pipeline_model_parallel_layout=layout)
    vpp = config.virtual_pipeline_model_parallel_size
    parallel_state.set_virtual_pipeline_model_parallel_world_size(vpp)
    try:
        # Its get_num_layers_to_build (transformer_block's hands it no rank) asks the layout.
        expected = [[config.pipeline_model_parallel_layout.get_num_layers_to_build(
                        vp_stage=stage, pp_rank=rank) for stage in range(vpp or 1)]
                    for rank in range(pp)]
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)
    assert [list(rank) for rank in layout_layers(config.pipeline_model_parallel_layout)] == expected
    assert PipelineSplit.from_config(config).chunk_layers() == expected


def test_describe_and_largest_chunk():
    uneven = PipelineSplit(8, 3, first=1, last=3)
    assert uneven.chunk_layers() == [[1], [4], [3]]
    assert uneven.describe() == "1 | 4 | 3" and uneven.largest_chunk() == 4
    counted = PipelineSplit(6, 2, 2, embedding_is_a_layer=True, loss_is_a_layer=True)
    assert counted.describe() == "1+2 | 2+1" and counted.largest_chunk() == 2
    assert PipelineSplit(4, 2).is_default and not counted.is_default


# The tiny GPT's parameters (tests/_train_util.py: hidden 64, vocabulary 4096, 64 positions).
LAYER = 4 * 64 * 64 + 4 * 64 + 2 * 64 * 256 + 256 + 64 + 4 * 64  # attention, MLP, two norms
EMBEDDING = 4096 * 64 + 64 * 64  # words and positions
OUTPUT = 4096 * 64 + 2 * 64  # the last stage's copy of the word embedding, the final norm


SPLIT_RUNS = {
    # Megatron's schedule, the embedding and the loss counted as layers: 4 layers as 1 | 2 | 1.
    "pp3_counted": (["--pipeline-model-parallel-size", "3",
                     "--account-for-embedding-in-pipeline-split",
                     "--account-for-loss-in-pipeline-split"], 3, "1 | 2 | 1",
                    (EMBEDDING + LAYER, 2 * LAYER, LAYER + OUTPUT)),
    # Megatron's interleaved schedule, a layout string: 2+1 | 1+0.
    "pp2_layout": (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout",
                    "Ett|t|t|L"], 2, "2+1 | 1+0", (EMBEDDING + 3 * LAYER, LAYER + OUTPUT)),
    # The DPP runtime, the first stage's count given: 1 | 3.
    "pp2_first_dpp": (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers",
                       "1", "--use-dpp", "--dpp-timeout", "60"], 2, "1 | 3",
                      (EMBEDDING + LAYER, 3 * LAYER + OUTPUT)),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("run", list(SPLIT_RUNS))
def test_run_prints_the_split_and_each_stages_parameters(run):
    """The split is said once, on rank 0, and Megatron-LM's parameter count line from each stage
    shows its layers were built."""
    from _train_util import run_training

    flags, nproc, split, counts = SPLIT_RUNS[run]
    rc, losses, _norms, out = run_training([*flags, "--train-iters", "2"], nproc=nproc,
                                           timeout=240)
    assert rc == 0 and len(losses) == 2, out[-3000:]
    assert out.count(f" pipeline split: transformer layers per pipeline rank {split}\n") == 1, out
    for stage, count in enumerate(counts):
        line = (f" > number of parameters on (tensor, pipeline) model parallel rank "
                f"(0, {stage}): {count}\n")
        assert out.count(line) == 1, (line, out[-3000:])
