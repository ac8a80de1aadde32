"""--use-sequence-packing: whole documents packed into windows of --seq-length tokens
(megatron_dpp/data/packing.py, packed_dataset.py).

- The packing: first fit over the open windows, by hand; a window's arrays (padding with
  PAD_TOKEN and loss mask 0, the last real token's label masked, position ids restarting at each
  document, cu_seqlens the documents' boundaries and the padding's segment).
- On the sample corpus: every document of a split is in exactly one window per epoch, whole, or
  cut to the window when longer (the build log counts them); no window is longer than
  --seq-length; two builds give the same windows, a third loads the cached index; resuming at
  consumed_samples continues the stream; blends, per-split paths and --mock-data pack too.
- Training: GPT at pp=1, pp=2 (Megatron's 1F1B) and pp=2 --use-dpp gives the same loss per
  iteration (1e-5), Llama at pp=2 --use-dpp that of 1F1B; the flags that cannot go with it stop
  in one line.
"""
import re
import shutil

import numpy
import pytest
import torch

from _data_util import data_args, sample_data  # noqa: F401 (fixture)
from _train_util import TINY_GPT_ARGS, flag_error, run_training
from megatron_dpp.data.packing import PAD_TOKEN, pack_in_order, window_arrays

pytestmark = pytest.mark.timeout(180)

PACKED_LOG = re.compile(r"\[data\] sequence packing, (\w+) split of .*: (\d+) documents in (\d+) "
                        r"windows of (\d+) tokens .* efficiency ([0-9.]+)% .*; (\d+) documents "
                        r"longer than \d+ tokens cut to it")


def test_first_fit_over_the_open_windows():
    # 8-token windows: 5 opens A; 4 opens B; 3 fills A (closed); 2 joins B; 6 opens C.
    assert pack_in_order([5, 4, 3, 2, 6], 8) == [[0, 2], [1, 3], [4]]
    # One open window (next fit): each document that does not fit closes the one before.
    assert pack_in_order([5, 4, 3, 2, 6], 8, open_windows=1) == [[0], [1, 2], [3, 4]]
    # A document of the window's length is a window of its own at once.
    assert pack_in_order([3, 8, 5], 8) == [[1], [0, 2]]


def test_window_arrays_pad_mask_and_restart_positions():
    arrays = window_arrays([numpy.array([11, 12, 13]), numpy.array([21, 22])], 8)
    assert arrays["tokens"].tolist() == [11, 12, 13, 21, 22, PAD_TOKEN, PAD_TOKEN, PAD_TOKEN]
    assert arrays["labels"].tolist() == [12, 13, 21, 22, PAD_TOKEN, PAD_TOKEN, PAD_TOKEN,
                                         PAD_TOKEN]
    # The label crossing into the next document counts (Megatron's SFT packing); the last real
    # token's (padding) and the padding's do not.
    assert arrays["loss_mask"].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    assert arrays["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert arrays["cu_seqlens"].dtype == numpy.int32
    assert arrays["cu_seqlens"].tolist() == [0, 3, 5, 8]
    full = window_arrays([numpy.array([1, 2, 3, 4]), numpy.array([5, 6, 7, 8])], 8, mask_token=4)
    assert full["cu_seqlens"].tolist() == [0, 4, 8]  # no padding: no padding segment
    assert full["loss_mask"].tolist() == [1, 1, 1, 0, 1, 1, 1, 0]  # token 4 (--eod-mask-loss)
    with pytest.raises(ValueError, match="cannot hold"):
        window_arrays([numpy.arange(9)], 8)


def _build(args):
    from megatron_dpp.data import build_tokenizer, build_train_valid_test_datasets

    tokenizer = build_tokenizer(args)
    return build_train_valid_test_datasets(args, tokenizer)


def _packed_args(paths, tmp_path, **overrides):
    values = dict(use_sequence_packing=True, seq_length=128,
                  data_cache_path=str(tmp_path / "cache"))
    values.update(overrides)
    return data_args(paths, **values)


def _check_window(dataset, idx, window):
    """The sample is its documents, whole (or cut to the window), then padding; returns their
    ids."""
    sample = dataset[idx]
    documents = [int(d) for d in dataset.index.window(idx)]
    texts = [dataset.dataset[d].tolist()[:window] for d in documents]
    real = sum(len(text) for text in texts)
    assert 0 < real <= window
    text = [token for part in texts for token in part] + [PAD_TOKEN] * (window + 1 - real)
    assert sample["tokens"].tolist() == text[:window]
    assert sample["labels"].tolist() == text[1:]
    assert sample["loss_mask"][:real - 1].eq(1).all() and not sample["loss_mask"][real - 1:].any()
    segments = [len(t) for t in texts] + ([window - real] if real < window else [])
    bounds = numpy.cumsum([0] + segments).tolist()
    assert sample["cu_seqlens"].dtype == torch.int32 and sample["cu_seqlens"].tolist() == bounds
    positions = torch.cat([torch.arange(n) for n in segments])
    assert torch.equal(sample["position_ids"], positions)
    assert sample["attention_mask"] is None
    return documents


def test_every_document_whole_once_per_epoch(sample_data, tmp_path, capsys):
    # 4000 samples: two epochs of the train split's documents at 128-token windows.
    args = _packed_args(sample_data, tmp_path, train_iters=1000, eval_interval=1000)
    train, valid, test = _build(args)
    logged = {m.group(1): m.groups()[1:] for m in PACKED_LOG.finditer(capsys.readouterr().out)}
    assert set(logged) == {"train", "valid"} and test is None

    epochs = {}
    for dataset in (train, valid):
        name = dataset.index_split.name
        lengths = dataset.dataset.sequence_lengths
        split_documents = sorted(int(d) for d in dataset.indices if lengths[d] > 0)
        longer = sum(1 for d in split_documents if lengths[d] > 128)
        documents, windows, window, efficiency, cut = logged[name]
        assert (int(documents), int(windows), int(window)) == (len(split_documents),
                                                               len(dataset), 128)
        assert int(cut) == longer > 0 and 90.0 < float(efficiency) <= 100.0
        epoch, epochs[name] = [], 0
        for idx in range(len(dataset)):
            epoch += _check_window(dataset, idx, 128)
            assert len(epoch) <= len(split_documents)  # epochs do not share a window
            if len(epoch) == len(split_documents):
                assert sorted(epoch) == split_documents  # each document exactly once
                epoch, epochs[name] = [], epochs[name] + 1
        assert epoch == []  # whole epochs only
    # train: two epochs give the 4000 samples asked; valid: one gives more than its 8.
    assert epochs == {"train": 2, "valid": 1} and len(train) >= 4000 and len(valid) >= 8


def test_builds_are_deterministic_and_cached(sample_data, tmp_path):
    first = _build(_packed_args(sample_data, tmp_path / "a"))[0]
    second = _build(_packed_args(sample_data, tmp_path / "b"))[0]
    assert numpy.array_equal(first.index.documents, second.index.documents)
    assert numpy.array_equal(first.index.window_starts, second.index.window_starts)
    for idx in (0, 7, len(first) - 1):
        assert all(torch.equal(first[idx][k], second[idx][k]) for k in ("tokens", "cu_seqlens"))
    cached = sorted(p.name.split("-", 1)[1] for p in (tmp_path / "a" / "cache").iterdir()
                    if not p.name.startswith("."))  # the index cache lock
    assert cached == [f"PackedDocumentsGPTDataset-{split}-{name}" for split in ("train", "valid")
                      for name in ("description.txt", "document_index.npy", "window_index.npy")]
    loaded = _build(_packed_args(sample_data, tmp_path / "a"))[0]
    assert isinstance(loaded.index.documents, numpy.memmap)  # read from the cache
    assert numpy.array_equal(loaded.index.documents, first.index.documents)
    reseeded = _build(_packed_args(sample_data, tmp_path / "c", seed=4321))[0]
    assert not numpy.array_equal(reseeded.index.documents[:50], first.index.documents[:50])


def test_resume_continues_the_stream_and_batches_drop_cu_seqlens(sample_data, tmp_path):
    from megatron_dpp.data import build_data_iterators

    args = _packed_args(sample_data, tmp_path, micro_batch_size=2, global_batch_size=4)
    train, valid, test = _build(args)
    stream = build_data_iterators(args, train, valid, test)[0]
    full = [next(stream) for _ in range(8)]
    resumed = build_data_iterators(args, train, valid, test,
                                   consumed_train_samples=3 * args.global_batch_size)[0]
    for a, b in zip(full[6:], [next(resumed) for _ in range(2)]):
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["labels"], b["labels"])
    # Without per-document attention the model gets Megatron's batch: no cu_seqlens.
    assert set(full[0]) == {"tokens", "labels", "loss_mask", "position_ids", "attention_mask"}
    assert full[0]["tokens"].shape == (2, 128)
    assert torch.equal(full[3]["tokens"][1], train[7]["tokens"])


def test_blend_and_per_split_paths_pack(sample_data, tmp_path):
    prefix = sample_data["data_prefix"]
    copy = str(tmp_path / "copy_text_document")
    for suffix in (".bin", ".idx"):
        shutil.copy(prefix + suffix, copy + suffix)
    # Megatron-Core's BlendedDataset asks the process group for the rank: one of one process.
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}",
                                         rank=0, world_size=1)
    try:
        blend = _build(_packed_args(sample_data, tmp_path, data_path=["1", prefix, "3", copy]))[0]
    finally:
        torch.distributed.destroy_process_group()
    assert [type(d).__name__ for d in blend.datasets] == ["PackedDocumentsGPTDataset"] * 2
    drawn = [blend[i]["dataset_id"] for i in range(len(blend))]
    assert 0 < drawn.count(0) < drawn.count(1)
    for part in blend.datasets:
        for idx in range(0, len(part), 97):
            _check_window(part, idx, 128)

    per_split = _packed_args(sample_data, tmp_path, data_path=None, split=None,
                             train_data_path=[prefix], valid_data_path=[copy])
    train, valid, test = _build(per_split)
    assert test is None
    for dataset in (train, valid):  # each split packs all of its own documents
        epoch = [d for idx in range(len(dataset)) for d in _check_window(dataset, idx, 128)]
        assert sorted(set(epoch)) == list(range(len(dataset.dataset.sequence_lengths)))


def test_mock_data_packs(sample_data, tmp_path):
    args = data_args(sample_data, use_sequence_packing=True, seq_length=256, mock_data=True,
                     data_path=None, tokenizer_type="NullTokenizer", vocab_size=1000,
                     vocab_file=None, merge_file=None)
    train, valid, _test = _build(args)
    assert len(train) >= 32
    for idx in range(0, 32, 5):
        _check_window(train, idx, 256)


TRAIN = ["--use-sequence-packing", "--seq-length", "256", "--max-position-embeddings", "256",
         "--train-iters", "3"]


@pytest.mark.timeout(600)
def test_training_pp1_pp2_and_dpp_agree():
    runs = {}
    for name, extra, nproc in (("pp1", [], 1),
                               ("pp2", ["--pipeline-model-parallel-size", "2",
                                        "--p2p-transport", "torch"], 2),
                               ("pp2_dpp", ["--pipeline-model-parallel-size", "2", "--use-dpp"],
                                2)):
        rc, losses, _norms, out = run_training([*TRAIN, *extra], nproc=nproc, timeout=280)
        assert rc == 0, out[-3000:]
        assert "[data] sequence packing, train split of" in out, out[-3000:]
        assert len(losses) == 3, out[-3000:]
        runs[name] = losses
    for name in ("pp2", "pp2_dpp"):
        assert runs[name] == pytest.approx(runs["pp1"], rel=1e-5), runs
    assert runs["pp1"][-1] < runs["pp1"][0]


@pytest.mark.timeout(600)
def test_llama_trains_packed_dpp_equal_to_1f1b():
    from test_llama_parity import ENTRY, TINY_LLAMA_ARGS

    runs = {}
    for name, extra in (("pp2", ["--p2p-transport", "torch"]), ("pp2_dpp", ["--use-dpp"])):
        rc, losses, _norms, out = run_training(
            [*TRAIN, "--pipeline-model-parallel-size", "2", *extra], nproc=2, timeout=280,
            base_args=TINY_LLAMA_ARGS, entry=ENTRY)
        assert rc == 0, out[-3000:]
        assert "[data] sequence packing, train split of" in out and len(losses) == 3, out[-3000:]
        runs[name] = losses
    assert runs["pp2_dpp"] == pytest.approx(runs["pp2"], rel=1e-5), runs


@pytest.mark.timeout(600)
def test_packed_and_masked_dpp_equals_1f1b_and_masking_changes_the_loss():
    """Whole documents packed and masked apart (--dataloader-inter-document-masking uses the
    packing's own boundaries): --use-dpp equals Megatron's 1F1B at pp=2; the masking changes what
    is trained (attention no longer crosses the packed documents)."""
    masked = ["--dataloader-inter-document-masking"]
    runs = {}
    for name, extra in (("pp2_masked", [*masked, "--p2p-transport", "torch"]),
                        ("pp2_dpp_masked", [*masked, "--use-dpp"]),
                        ("pp2_dpp", ["--use-dpp"])):
        rc, losses, _norms, out = run_training(
            [*TRAIN, "--pipeline-model-parallel-size", "2", "--micro-batch-size", "2", *extra],
            nproc=2, timeout=280)
        assert rc == 0, out[-3000:]
        assert len(losses) == 3, out[-3000:]
        runs[name] = losses
    assert runs["pp2_dpp_masked"] == pytest.approx(runs["pp2_masked"], rel=1e-5), runs
    assert runs["pp2_dpp_masked"] != pytest.approx(runs["pp2_dpp"], rel=1e-4), runs


@pytest.mark.parametrize("argv, model, message", [
    (["--variable-seq-lengths"], "gpt",
     "--use-sequence-packing packs several documents into each --seq-length sample, "
     "--variable-seq-lengths puts one document in each: give one of the two"),
    (["--reset-position-ids"], "llama",
     "--use-sequence-packing restarts the position ids at each document already"),
    (["--reset-attention-mask"], "gpt",
     "a packed sample carries its documents' boundaries (cu_seqlens) instead and no mask"),
    ([], "bert", "--use-sequence-packing packs GPT and Llama documents"),
])
def test_flags_that_cannot_go_with_it(capsys, monkeypatch, argv, model, message):
    from _train_util import data_args as train_data_args
    from test_bert_parity import TINY_BERT_ARGS, bert_data_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    base = ([*bert_data_args(), *TINY_BERT_ARGS] if model == "bert"
            else [*train_data_args(), *TINY_GPT_ARGS])
    line = flag_error(capsys, [*base, "--use-sequence-packing", *argv], model=model)
    assert message in line
