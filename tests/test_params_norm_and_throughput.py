"""--log-throughput and --log-params-norm, Megatron-LM's log fields: the operation count against
the published GPT formula and a hand count for SwiGLU with grouped-query attention; the logged
TFLOP/s against the count, the elapsed time and the ranks; the parameters' norm counting each
parameter once (the last stage's copy of a tied embedding and tensor-parallel duplicates left
out), the same at pp=1, pp=2 and tp=2,
from the sharded fp32 main parameters under --bf16 --use-distributed-optimizer, and in
TensorBoard as in the log line."""
import math
import re

import pytest
import torch

from _one_rank import one_rank_megatron
from _train_util import run_training
from megatron_dpp.training.observe.throughput import ModelShape, floating_point_operations, tflops_per_gpu

PARAMS_NORM_RE = re.compile(r"\| params norm: ([-+0-9.eE]+)")
THROUGHPUT_RE = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+) \| "
                           r"throughput per GPU \(TFLOP/s/GPU\): ([-+0-9.eE]+) \|")
VOCAB_RE = re.compile(r"\(new size: (\d+)\)")


def _gpt_shape(layers, hidden, heads, seq, vocab):
    return ModelShape(num_layers=layers, hidden_size=hidden, ffn_hidden_size=4 * hidden,
                      num_attention_heads=heads, kv_channels=hidden // heads,
                      num_query_groups=heads, gated_linear_unit=False, seq_length=seq,
                      padded_vocab_size=vocab)


def test_gpt_operations_are_the_published_formula_with_causal_attention():
    # Narayanan et al. (2021): 72 B s L h^2 (1 + s/(6h) + V/(12 h L)) with full attention;
    # Megatron-LM counts the causal half of the attention products: s/(12h).
    layers, hidden, seq, vocab, batch = 96, 12288, 2048, 51200, 1536
    shape = _gpt_shape(layers, hidden, 96, seq, vocab)
    expected = 72 * batch * seq * layers * hidden ** 2 * (
        1 + seq / (12 * hidden) + vocab / (12 * hidden * layers))
    assert floating_point_operations(shape, batch) == pytest.approx(expected, rel=1e-12)


def test_swiglu_and_grouped_query_attention_by_hand():
    shape = ModelShape(num_layers=2, hidden_size=8, ffn_hidden_size=16, num_attention_heads=4,
                       kv_channels=2, num_query_groups=2, gated_linear_unit=True, seq_length=4,
                       padded_vocab_size=10)
    # Per token and layer, multiply-adds: q, k, v projections 8 x (8 + 4 + 4) = 128; QK^T and
    # the product with V, causal half, 8 x 4 = 32; output projection 8 x 8 = 64; SwiGLU's three
    # GEMMs 8 x 16 x 3 = 384. Two layers 1216, logits 8 x 10 = 80: 1296 per token, x 6 (three
    # passes, two operations each) x 4 tokens x batch 1.
    assert floating_point_operations(shape, 1) == 6 * 4 * 1296
    assert floating_point_operations(shape, 3) == 3 * 6 * 4 * 1296
    assert tflops_per_gpu(2e12, 0.5, 2) == pytest.approx(2.0)


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    with one_rank_megatron(tmp_path_factory.mktemp("params_norm")):
        yield


def test_each_parameter_counts_once_from_its_main_values(megatron):
    from megatron_dpp.training.observe.params_norm import params_l2_norm

    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.full((3,), 2.0))  # 12
    model.b = torch.nn.Parameter(torch.full((2, 2), 1.0))  # 4
    tied_copy = torch.nn.Parameter(torch.full((5,), 7.0))
    tied_copy.shared = True  # the last stage's copy of a tied embedding: left out
    model.tied = tied_copy
    assert params_l2_norm([model], bf16=False, sharded_main_params=False,
                          device="cpu") == pytest.approx(4.0)
    # --bf16: the fp32 main parameters where the optimizer keeps them.
    half = torch.nn.Module()
    half.w = torch.nn.Parameter(torch.full((4,), 1.0, dtype=torch.bfloat16))
    half.w.main_param = torch.full((4,), 1.5)  # 9
    half.v = torch.nn.Parameter(torch.full((1,), 3.0, dtype=torch.bfloat16))  # 9, no main
    assert params_l2_norm([half], bf16=True, sharded_main_params=False,
                          device="cpu") == pytest.approx(math.sqrt(18.0))
    # The distributed optimizer's shards: a parameter without a part here adds nothing.
    half.w.main_param = torch.full((2,), 2.0)  # 8
    half.v.main_param = None
    assert params_l2_norm([half], bf16=True, sharded_main_params=True,
                          device="cpu") == pytest.approx(math.sqrt(8.0))


def _norms(out):
    return [float(x) for x in PARAMS_NORM_RE.findall(out)]


@pytest.mark.timeout(400)
def test_params_norm_is_the_same_at_pp1_and_pp2_and_throughput_follows_the_count():
    flags = ["--train-iters", "3", "--log-params-norm", "--log-throughput"]
    rc, losses, _norms1, out1 = run_training(flags, nproc=1)
    assert rc == 0 and len(losses) == 3, out1[-3000:]
    rc, losses2, _norms2, out2 = run_training(
        [*flags, "--pipeline-model-parallel-size", "2"], nproc=2)
    assert rc == 0 and len(losses2) == 3, out2[-3000:]
    one, two = _norms(out1), _norms(out2)
    assert len(one) == 3 and len(set(one)) == 3, out1[-2000:]  # the step changes the norm
    # The tied embedding's copy on the last stage is not counted twice (it would add ~40%).
    assert two == pytest.approx(one, rel=1e-5)
    # Nor the norms' and biases' copies on a second tensor-parallel rank.
    rc, _l, _g, tp2 = run_training([*flags, "--tensor-model-parallel-size", "2"], nproc=2)
    assert rc == 0, tp2[-3000:]
    assert _norms(tp2) == pytest.approx(one, rel=1e-5)

    # TINY_GPT_ARGS: 4 layers, hidden 64, 4 heads, sequence 64, global batch 8.
    vocab = int(VOCAB_RE.search(out2).group(1))
    operations = floating_point_operations(_gpt_shape(4, 64, 4, 64, vocab), 8)
    lines = THROUGHPUT_RE.findall(out2)
    assert len(lines) == 3, out2[-2000:]
    for elapsed_ms, tflops in lines:
        # Two ranks count as two GPUs; the figure has three significant digits here.
        assert float(tflops) == pytest.approx(
            tflops_per_gpu(operations, float(elapsed_ms) / 1000.0, 2), rel=1e-2)


@pytest.mark.timeout(400)
def test_params_norm_from_sharded_main_parameters_under_bf16():
    flags = ["--train-iters", "2", "--log-params-norm", "--bf16"]
    rc, _l, _g, plain = run_training(flags, nproc=2)
    assert rc == 0, plain[-3000:]
    rc, _l, _g, sharded = run_training([*flags, "--use-distributed-optimizer"], nproc=2)
    assert rc == 0, sharded[-3000:]
    # fp32 main parameters (sharded, summed over the two data-parallel ranks) against the bf16
    # model's own values: equal but for bf16's rounding.
    assert len(_norms(sharded)) == 2
    assert _norms(sharded) == pytest.approx(_norms(plain), rel=2e-3)


@pytest.mark.timeout(300)
def test_params_norm_in_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from test_tensorboard_log import _scalars

    board = str(tmp_path / "tb")
    rc, _losses, _g, out = run_training(
        ["--train-iters", "4", "--log-params-norm", "--tensorboard-dir", board,
         "--tensorboard-log-interval", "2", "--log-interval", "4"], nproc=1)
    assert rc == 0, out[-3000:]
    scalars = _scalars(board)
    assert [step for step, _ in scalars["params-norm"]] == [2, 4]
    assert scalars["params-norm"][1][1] == pytest.approx(_norms(out)[0], rel=1e-6)
