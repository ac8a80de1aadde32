"""Megatron-LM's data and loss flags from its own example scripts: --calculate-per-token-loss,
--no-mmap-bin-files, --no-create-attention-mask-in-dataloader.

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
])
def test_flag_errors(capsys, monkeypatch, argv, model, message):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    base = ([*bert_data_args(), *TINY_BERT_ARGS] if model == "bert"
            else [*data_args(), *TINY_GPT_ARGS])
    assert message in flag_error(capsys, [*base, *argv], model=model)
