"""--microbatch-group-size-per-virtual-pipeline-stage (Megatron-Core's
microbatch_group_size_per_vp_stage): the flag and its one-line refusals, the micro-batch counts it
lets the interleaved schedule train (the same as Megatron-Core 0.16.1's own check, run in this
process), the static interleaved order of the DPP runtime against Megatron-Core's table and warmup
counts, and a pp=2 x vpp=2 run of 5 micro-batches in groups of 3 (not a multiple of the pipeline
size) under Megatron's schedule and under --use-dpp, with equal losses."""
from types import SimpleNamespace

import pytest
import torch

from _train_util import assert_losses_close, data_args, flag_error, run_training

FLAG = "--microbatch-group-size-per-virtual-pipeline-stage"
TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--micro-batch-size", "1", "--lr", "1e-3"]
PP2_VPP2 = ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"]


@pytest.fixture
def two_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")


def _command_line(argv):
    """The tiny GPT's flags, then argv; 5 iterations unless argv counts samples."""
    length = [] if "--train-samples" in argv else ["--train-iters", "5"]
    return [*data_args(), *TINY, *length, *argv]


def _parse(argv):
    from megatron_dpp.arguments import parse_args

    return parse_args(_command_line(argv), prog="megatron_dpp.pretrain_gpt", model="gpt")


def _batch(global_batch_size, *group):
    return [*PP2_VPP2, "--global-batch-size", str(global_batch_size),
            *([FLAG, str(group[0])] if group else [])]


def test_default_is_the_pipeline_size_and_reaches_the_config(two_ranks):
    from megatron_dpp.models.transformer_config import transformer_config_from_args

    args = _parse(_batch(4))
    assert args.parallel.microbatch_group_size_per_vp_stage == 2
    assert transformer_config_from_args(args).microbatch_group_size_per_vp_stage == 2
    args = _parse(_batch(6, 3))
    assert (args.num_microbatches, args.parallel.microbatch_group_size_per_vp_stage) == (6, 3)
    assert transformer_config_from_args(args).microbatch_group_size_per_vp_stage == 3


@pytest.mark.parametrize("global_batch_size,group", [(3, 3), (5, 3), (5, 5), (7, 4), (9, 5)])
def test_a_larger_group_trains_counts_that_are_not_a_multiple_of_the_pipeline(
        two_ranks, global_batch_size, group):
    args = _parse(_batch(global_batch_size, group))
    assert args.num_microbatches == global_batch_size
    assert args.num_microbatches % 2 == 1


REFUSALS = [
    # (flags, what the one line says)
    (_batch(5), "the interleaved schedule runs the 5 micro-batches per step in groups of 2 "
                "micro-batches (the default: --pipeline-model-parallel-size), and the last group "
                "would have 1, fewer than --pipeline-model-parallel-size 2"),
    (_batch(4, 3), "in groups of 3 micro-batches (" + FLAG + "), and the last group would have 1"),
    (_batch(2, 3), "runs groups of 3 micro-batches (" + FLAG + "), more than the 2 micro-batches "
                   "per step; adjust --global-batch-size or " + FLAG),
    (_batch(4, 1), FLAG + " 1 is below --pipeline-model-parallel-size 2"),
    (_batch(4, 0), FLAG + " 0 is below --pipeline-model-parallel-size 2"),
    (["--pipeline-model-parallel-size", "2", "--global-batch-size", "4", FLAG, "2"],
     "this run has no virtual pipeline stages; add --num-virtual-stages-per-pipeline-rank or "
     "remove " + FLAG),
    # Every batch of a ramp-up runs the schedule: 2 micro-batches do not hold a group of 3.
    ([*_batch(6, 3), "--train-samples", "30", "--rampup-batch-size", "2", "2", "8"],
     "--rampup-batch-size reaches a global batch of 2, and the interleaved schedule "
                 "runs groups of 3 micro-batches"),
]


@pytest.mark.parametrize("argv,message", REFUSALS)
def test_refusals_are_one_line(two_ranks, capsys, argv, message):
    line = flag_error(capsys, _command_line(argv))
    assert message in line, line


def test_a_ramp_up_whose_batches_all_hold_the_groups_runs(two_ranks):
    args = _parse([*_batch(6, 3), "--train-samples", "30", "--rampup-batch-size", "3", "3", "6"])
    assert args.parallel.microbatch_group_size_per_vp_stage == 3


class _Group:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


class _PastTheCheck(Exception):
    """Megatron-Core's interleaved schedule got past its group-size checks."""


def megatron_accepts(monkeypatch, P, V, M, group) -> bool:
    """Whether Megatron-Core 0.16.1's forward_backward_pipelining_with_interleaving accepts M
    micro-batches with this group size: its own code, stopped right after its checks."""
    from megatron.core import ModelParallelConfig
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import schedules

    class Config(ModelParallelConfig):
        @property
        def hidden_size(self):  # a TransformerConfig field, first read after the checks
            raise _PastTheCheck

    config = Config(pipeline_model_parallel_size=P, pipeline_dtype=torch.float32,
                                 virtual_pipeline_model_parallel_size=V,
                                 microbatch_group_size_per_vp_stage=group)
    chunks = []
    for _ in range(V):
        chunk = torch.nn.Linear(1, 1)
        chunk.config, chunk.model_type = config, ModelType.encoder_or_decoder
        chunks.append(chunk)
    pp = _Group(P, 0)
    communicator = SimpleNamespace(pp_group=pp, config=config, virtual_pipeline_model_parallel_size=V)
    groups = SimpleNamespace(tp=None, cp=_Group(1, 0), embd=None, pos_embd=None, pp=pp,
                             dp_cp=None)
    zeros = torch.zeros
    # Its token counter is allocated on a GPU before the checks.
    monkeypatch.setattr(torch, "zeros", lambda *a, device=None, **k: zeros(*a, **k))
    try:
        schedules.forward_backward_pipelining_with_interleaving(
            forward_step_func=None, data_iterator=[iter(())] * V, model=chunks,
            num_microbatches=M, seq_length=1, micro_batch_size=1, p2p_communicator=communicator,
            pg_collection=groups)
    except _PastTheCheck:
        return True
    except (ValueError, RuntimeError) as error:
        assert "micro-batch" in str(error) or "M (the total" in str(error), error
        return False
    finally:
        monkeypatch.setattr(torch, "zeros", zeros)
    raise AssertionError("the schedule ran on without reading the hidden size")


@pytest.mark.parametrize("P", [2, 3, 4])
def test_the_accepted_counts_are_megatron_cores(monkeypatch, P):
    from megatron_dpp.parallel.layout import ParallelLayout
    from megatron_dpp.training.flags import interleaved_microbatches_refusal

    seen = {True: 0, False: 0}
    for M in range(1, 14):
        for group in [None, *range(P, M + 2)]:
            layout = ParallelLayout(virtual_pipeline_model_parallel_size=2,
                                    microbatch_group_size_per_vp_stage=group)
            args = SimpleNamespace(pipeline_model_parallel_size=P, parallel=layout)
            ours = interleaved_microbatches_refusal(args, M) is None
            theirs = megatron_accepts(monkeypatch, P, 2, M, group)
            assert ours == theirs, (P, M, group)
            seen[ours] += 1
    assert seen[True] and seen[False]


def megatron_order(P, V, M, group, rank):
    """Megatron-Core's interleaved 1F1B on `rank` from its own schedule table and warmup count:
    warmup forwards, then one forward and one backward per step, then the remaining backwards; a
    backward runs the chunks in reverse."""
    from megatron.core.pipeline_parallel import schedules

    from megatron_dpp.pipeline import Phase, Task

    communicator = SimpleNamespace(pp_group=_Group(P, rank), virtual_pipeline_model_parallel_size=V)
    _total, _all_warmup, warmup, remaining = schedules.get_pp_rank_microbatches(
        M, V, group, p2p_communicator=communicator)
    table = schedules.get_schedule_table(M, V, group)
    forwards = [Task(Phase.F, m, c) for m, c in table]
    backwards = [Task(Phase.B, m, V - 1 - c) for m, c in table]
    order = forwards[:warmup]
    for k in range(remaining):
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[remaining:]


# (P, V, M, group): groups other than P, micro-batch counts that are not multiples of P.
ORDERS = [(2, 2, 5, 3), (2, 2, 3, 3), (2, 3, 7, 4), (2, 2, 8, 4), (3, 2, 7, 4), (4, 2, 9, 5),
          (4, 3, 10, 5), (3, 2, 6, 3), (2, 2, 6, 2)]


@pytest.mark.parametrize("P,V,M,group", ORDERS)
def test_the_dpp_interleaved_order_is_megatron_cores(P, V, M, group):
    from megatron_dpp.pipeline import TaskGraph, make_scheduler
    from megatron_dpp.sim import simulate

    graph = TaskGraph(P, V, M)
    for rank in range(P):
        scheduler = make_scheduler("interleaved-1f1b", graph, rank,
                                   microbatch_group_size_per_vp_stage=group)
        assert scheduler.order == megatron_order(P, V, M, group, rank), (P, V, M, group, rank)
    # And it runs: every rank's order completes in the simulator, and so does dpp:adaptive's with
    # this group as its spine.
    for policy in ("interleaved-1f1b", "dpp:adaptive"):
        result = simulate(graph, policy, microbatch_group_size_per_vp_stage=group)
        assert len(result.timeline) == P * V * M * 2, policy


def test_the_group_changes_the_order():
    from megatron_dpp.pipeline import TaskGraph, make_scheduler

    graph = TaskGraph(2, 2, 6)
    default = make_scheduler("interleaved-1f1b", graph, 0).order
    assert default == megatron_order(2, 2, 6, 2, 0)
    assert make_scheduler("interleaved-1f1b", graph, 0,
                          microbatch_group_size_per_vp_stage=3).order != default


ITERATIONS = 3
REL_TOL = 1e-5
# pp=2 x vpp=2, 5 micro-batches of one sample in groups of 3 (3, then 2): Megatron-Core runs it;
# with the default group (2) the flag check refuses it.
GROUPED = [*PP2_VPP2, "--global-batch-size", "5", FLAG, "3", "--train-iters", str(ITERATIONS)]
_reference = {}


def _megatron_losses():
    if not _reference:
        rc, losses, _norms, out = run_training(GROUPED + ["--p2p-transport", "torch"], nproc=2,
                                               timeout=300)
        assert rc == 0, out[-3000:]
        assert len(losses) == ITERATIONS, out[-3000:]
        _reference["losses"] = losses
    return _reference["losses"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("policy", ["interleaved-1f1b", "dpp:adaptive"])
def test_dpp_matches_megatron_with_a_group_of_3(policy):
    want = _megatron_losses()
    rc, losses, _norms, out = run_training(
        GROUPED + ["--use-dpp", "--dpp-policy", policy, "--dpp-timeout", "60",
                   "--p2p-transport", "shm"], nproc=2, timeout=300)
    assert rc == 0, out[-3000:]
    assert_losses_close(losses, want, REL_TOL)
