"""Megatron-LM's data and loss flags from its own example scripts: --calculate-per-token-loss,
--cross-entropy-loss-fusion, --no-mmap-bin-files, --no-create-attention-mask-in-dataloader.

--cross-entropy-loss-fusion: Megatron-Core's fused cross entropy gives the unfused one's loss (its
backward rounds the logits' gradient to bf16, so in fp32 the gradients agree to that precision),
the DPP runtime equals Megatron's schedule with it at pp=2 (1e-6), and the `kernels:` line says
which runs.

--calculate-per-token-loss: every loss token of the global batch weighs the same. With variable
lengths (padding masked out of the loss) the first iteration's gradient norm then does not depend
on how the batch is cut into micro-batches, and differs from the per-micro-batch average's; the
DPP runtime equals Megatron's schedule with it at pp=2 (it hands Megatron's finalize the token
count). The flag errors, before launch."""
import types

import pytest

from _train_util import TINY_GPT_ARGS, data_args, flag_error, run_training
from test_bert_parity import TINY_BERT_ARGS, bert_data_args

VARLEN = ["--variable-seq-lengths", "--train-iters", "3"]
PER_TOKEN = ["--calculate-per-token-loss"]
REL_TOL = 1e-5


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= REL_TOL * abs(b)


@pytest.mark.timeout(400)
def test_per_token_loss_weighs_every_token_the_same():
    by_split = {}
    for micro_batch in ("1", "2"):
        rc, losses, norms, out = run_training(
            [*VARLEN, *PER_TOKEN, "--micro-batch-size", micro_batch], nproc=1)
        assert rc == 0, out[-3000:]
        by_split[micro_batch] = (losses, norms)
    (losses_1, norms_1), (losses_2, norms_2) = by_split["1"], by_split["2"]
    assert _close(losses_1[0], losses_2[0]) and _close(norms_1[0], norms_2[0]), by_split
    rc, averaged_losses, averaged_norms, out = run_training([*VARLEN, "--micro-batch-size", "1"],
                                                            nproc=1)
    assert rc == 0, out[-3000:]
    assert _close(averaged_losses[0], losses_1[0])  # the same parameters: the same loss
    assert not _close(averaged_norms[0], norms_1[0])  # weighed per token, not per micro-batch


@pytest.mark.timeout(400)
def test_dpp_matches_megatron_with_per_token_loss():
    flags = [*VARLEN, *PER_TOKEN, "--pipeline-model-parallel-size", "2"]
    rc, megatron_losses, megatron_norms, out = run_training([*flags, "--p2p-transport", "torch"])
    assert rc == 0, out[-3000:]
    rc, dpp_losses, dpp_norms, out = run_training([*flags, "--use-dpp"])
    assert rc == 0, out[-3000:]
    assert len(dpp_losses) == len(megatron_losses) == 3
    assert all(_close(a, b) for a, b in zip(dpp_losses, megatron_losses)), \
        (dpp_losses, megatron_losses)
    assert all(_close(a, b) for a, b in zip(dpp_norms, megatron_norms)), (dpp_norms, megatron_norms)


@pytest.mark.timeout(400)
def test_fused_cross_entropy_is_the_same_loss():
    flags = ["--train-iters", "3", "--pipeline-model-parallel-size", "2"]
    runs = {}
    for name, extra in (("unfused", ["--p2p-transport", "torch"]),
                        ("fused", ["--p2p-transport", "torch", "--cross-entropy-loss-fusion"]),
                        ("fused_dpp", ["--use-dpp", "--cross-entropy-loss-fusion"])):
        rc, losses, norms, out = run_training([*flags, *extra])
        assert rc == 0, out[-3000:]
        fused = ("kernels: cross-entropy fusion on: --cross-entropy-loss-fusion: Megatron-Core's "
                 "native fused cross entropy, plain torch on the CPU")
        assert (fused in out) == name.startswith("fused"), out[-3000:]
        runs[name] = losses + norms
    unfused, fused, fused_dpp = runs["unfused"], runs["fused"], runs["fused_dpp"]
    assert len(unfused) == 6
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(fused_dpp, fused)), runs
    assert fused[0] == unfused[0]  # the same loss of the same parameters
    # Megatron-Core's fused backward rounds the logits' gradient to bf16 (it is meant for
    # --bf16); in this fp32 run the gradients differ from the unfused one's at that precision.
    assert all(abs(a - b) <= 2e-3 * abs(b) for a, b in zip(fused, unfused)), runs


def test_no_mmap_bin_files_reaches_megatrons_dataset_config(monkeypatch):
    from megatron_dpp.arguments import parse_args
    from megatron_dpp.data.datasets import gpt_dataset_config

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    tokenizer = types.SimpleNamespace(eod=0, vocab_size=4096)
    for extra, mapped in (([], True), (["--no-mmap-bin-files"], False)):
        args = parse_args([*data_args(), *TINY_GPT_ARGS, *extra,
                           "--no-create-attention-mask-in-dataloader"])
        config = gpt_dataset_config(args, tokenizer)
        assert config.mmap_bin_files is mapped and not config.create_attention_mask


@pytest.mark.parametrize("argv, model, message", [
    (["--calculate-per-token-loss"], "bert",
     "--calculate-per-token-loss scales a loss by its token count"),
    (["--no-mmap-bin-files"], "bert", "--no-mmap-bin-files is a GPT data flag"),
    (["--no-create-attention-mask-in-dataloader"], "bert",
     "--no-create-attention-mask-in-dataloader is a GPT data flag"),
    (["--no-create-attention-mask-in-dataloader", "--reset-attention-mask"], "gpt",
     "--reset-attention-mask needs the attention mask the data loader builds"),
    (["--cross-entropy-fusion-impl", "te"], "gpt",
     "--cross-entropy-fusion-impl te needs --cross-entropy-loss-fusion"),
    (["--cross-entropy-fusion-impl", "te", "--cross-entropy-loss-fusion"], "gpt",
     "--cross-entropy-fusion-impl te needs Transformer Engine on a GPU (this machine has no "
     "CUDA GPU)"),
])
def test_flag_errors(capsys, monkeypatch, argv, model, message):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    base = ([*bert_data_args(), *TINY_BERT_ARGS] if model == "bert"
            else [*data_args(), *TINY_GPT_ARGS])
    assert message in flag_error(capsys, [*base, *argv], model=model)
