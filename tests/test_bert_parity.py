"""BERT through `python -m megatron_dpp.pretrain_bert` on the sample corpus made into a BERT dataset
(WordPiece, sentence-split, Megatron-Core's masking): --use-dpp equals Megatron's own schedule
(1F1B, interleaved 1F1B with virtual stages) within 1e-5 relative in lm loss, sop loss and grad
norm at every iteration, at pp=2, pp=2 x vpp=2, pp=4 with variable lengths, tp=2 x pp=2 and pp=2 x dp=2, and
with the split backward (--dpp-split-backward) at pp=2 x vpp=2 and tp=2 x pp=2; the
masked-LM loss alone without the binary head; bad BERT flags are refused with one line before
anything starts."""
import os
import re
import subprocess

import pytest

from _train_util import PYTHON, REPO_ROOT, _env, ensure_sample_data, run_training

ITERATIONS = 5
REL_TOL = 1e-5
SOP_LOSS_RE = re.compile(r"\| sop loss: ([-+0-9.eE]+)")
TINY_BERT_ARGS = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "1", "--global-batch-size", "8",
    "--train-iters", str(ITERATIONS), "--lr", "1e-3", "--lr-warmup-iters", "1", "--min-lr", "1e-4",
    "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.01",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234",
    "--log-interval", "1", "--eval-iters", "0",
]
DPP = ["--use-dpp", "--dpp-timeout", "60", "--p2p-transport", "shm"]
PP2 = ["--pipeline-model-parallel-size", "2"]
VPP2 = ["--num-virtual-stages-per-pipeline-rank", "2"]
SPLIT = ["--dpp-split-backward"]
# Layout -> (flags, processes, flags of the DPP run only). Variable lengths: short samples are
# common (--short-seq-prob), so micro-batches cut to their longest sample differ in length, which
# dpp:adaptive orders by. Split backward: W tasks (deferred weight gradients) against Megatron's
# fused backward.
LAYOUTS = {
    "pp2": (PP2, 2, []),
    "pp2_vpp2": (PP2 + VPP2, 2, []),
    "pp4_varlen": (["--pipeline-model-parallel-size", "4", "--variable-seq-lengths",
                    "--short-seq-prob", "0.5"], 4, []),
    "tp2_pp2": (PP2 + ["--tensor-model-parallel-size", "2"], 4, []),
    "pp2_dp2": (PP2, 4, []),  # 4 processes / pp 2: two data-parallel pipelines
    "pp2_vpp2_split": (PP2 + VPP2, 2, SPLIT),
    "tp2_pp2_split": (PP2 + ["--tensor-model-parallel-size", "2"], 4, SPLIT),
    # The v placement (rank 0: embedding, pooler, both heads and the tied copies' sum) against
    # Megatron's interleaved run of the same stages.
    "pp2_v": (PP2 + VPP2, 2, ["--dpp-stage-placement", "v"]),
    "pp2_v_split": (PP2 + VPP2, 2, ["--dpp-stage-placement", "v"] + SPLIT),
}


def bert_data_args() -> list[str]:
    sample = ensure_sample_data()
    return ["--data-path", str(sample / "sample_bert_text_sentence"),
            "--vocab-file", str(sample / "bert-vocab.txt"), "--split", "98,2,0"]


def train_bert(flags: list[str], nproc: int = 2, iterations: int = ITERATIONS,
               expect_in_log: str = "") -> tuple[list[float], list[float], list[float]]:
    """lm losses, sop losses and grad norms of a run, one per iteration."""
    rc, losses, grad_norms, out = run_training(flags, nproc=nproc, timeout=300, with_data=False,
                                               base_args=[*bert_data_args(), *TINY_BERT_ARGS],
                                               entry="megatron_dpp.pretrain_bert")
    assert rc == 0, out[-3000:]
    sop_losses = [float(m.group(1)) for m in SOP_LOSS_RE.finditer(out)]
    assert len(losses) == len(grad_norms) == iterations, out[-3000:]
    assert expect_in_log in out, out[-3000:]
    return losses, sop_losses, grad_norms


_reference_cache = {}


def megatron_reference(flags: list[str], nproc: int):
    """Megatron's own schedule and P2P; run once per layout (a split-backward layout compares with
    the same Megatron run as its fused one)."""
    key = (tuple(flags), nproc)
    if key not in _reference_cache:
        _reference_cache[key] = train_bert(flags + ["--p2p-transport", "torch"], nproc)
    return _reference_cache[key]


@pytest.mark.slow
@pytest.mark.timeout(660)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_dpp_matches_megatron_on_bert(layout):
    flags, nproc, dpp_only = LAYOUTS[layout]
    reference = megatron_reference(flags, nproc)
    mine = train_bert(flags + DPP + dpp_only, nproc)
    assert len(reference[1]) == ITERATIONS  # the binary head is on by default
    for name, ours, theirs in zip(("lm loss", "sop loss", "grad norm"), mine, reference):
        assert ours == pytest.approx(theirs, rel=REL_TOL), (layout, name, ours, theirs)
    assert mine[0][-1] < mine[0][0]  # the masked-LM loss falls


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checkpoint_resume_reproduces_the_uninterrupted_run(tmp_path):
    # --lr-decay-iters fixed, so the shorter first run has the same learning-rate schedule.
    flags = PP2 + DPP + ["--lr-decay-iters", "6"]
    full = train_bert(flags + ["--train-iters", "6"], iterations=6)
    save = str(tmp_path / "ckpt")
    first = train_bert(flags + ["--train-iters", "3", "--save", save], iterations=3)
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as handle:
        assert handle.read().strip() == "3"
    resumed = train_bert(flags + ["--train-iters", "6", "--load", save], iterations=3,
                         expect_in_log="loaded checkpoint")
    for name, whole, before, after in zip(("lm loss", "sop loss", "grad norm"), full, first,
                                          resumed):
        assert before == whole[:3] and after == whole[3:], name  # exact: same bits


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_without_the_binary_head_only_the_lm_loss():
    losses, sop_losses, _ = train_bert(PP2 + DPP + ["--bert-no-binary-head"])
    assert sop_losses == [] and len(losses) == ITERATIONS


@pytest.mark.parametrize("flags, message", [
    (["--tokenizer-type", "GPT2BPETokenizer"], "is not BERT's; BERT trains with"),
    (["--mask-prob", "1.5"], "--mask-prob"),
    (["--eod-mask-loss"], "is a GPT data flag"),
    (["--dpp-split-backward"], "add --use-dpp"),
])
def test_bad_bert_flags_are_one_line_exit_2(flags, message):
    command = [PYTHON, "-m", "megatron_dpp.pretrain_bert", *bert_data_args(), *TINY_BERT_ARGS, *flags]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=_env(),
                            cwd=REPO_ROOT)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr[-2000:]
