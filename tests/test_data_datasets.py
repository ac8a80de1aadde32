"""Dataset builders (fixed and variable length), the empty-split guard, iterators and resume."""
import pytest
import torch

from _data_util import data_args, sample_data  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(120)


def _build(args):
    from megatron_dpp.data import build_tokenizer, build_train_valid_test_datasets

    tokenizer = build_tokenizer(args)
    return tokenizer, build_train_valid_test_datasets(args, tokenizer)


def _take(iterator, count):
    return [next(iterator) for _ in range(count)]


def test_fixed_length_batches(sample_data, tmp_path):
    from megatron_dpp.data import build_data_iterators

    args = data_args(sample_data, micro_batch_size=2, global_batch_size=4,
                     data_cache_path=str(tmp_path / "cache"))
    tokenizer, (train, valid, test) = _build(args)
    assert args.padded_vocab_size == 4096 and tokenizer.eod == 0
    assert len(train) >= args.train_iters * args.global_batch_size and test is None
    train_iter, valid_iter, test_iter = build_data_iterators(args, train, valid, test)
    assert test_iter is None
    for batch in _take(train_iter, 3) + _take(valid_iter, 2):
        assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids", "attention_mask"}
        assert batch["attention_mask"] is None  # causal: the model makes its own mask
        assert batch["tokens"].shape == (2, 64) and batch["tokens"].dtype == torch.int64
        assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])
        assert torch.equal(batch["position_ids"][0], torch.arange(64))
        assert batch["loss_mask"].sum() == 2 * 64


def test_variable_length_samples_are_their_documents(sample_data):
    args = data_args(sample_data, variable_seq_lengths=True, seq_length=48)
    _, (train, valid, _) = _build(args)
    assert len(train) == args.train_iters * args.global_batch_size
    lengths = set()
    for index in range(len(train)):
        sample = train[index]
        sequence = int(train.sample_to_sequence[index])
        document = train.dataset[sequence].tolist()
        length = min(len(document) - 1, args.seq_length)
        assert sample["tokens"].tolist() == document[:length]
        assert sample["labels"].tolist() == document[1:length + 1]
        assert sample["loss_mask"].sum() == length and sample["attention_mask"] is None
        lengths.add(length)
    assert len(lengths) > 5  # genuinely variable, and some hit the --seq-length cap
    assert max(lengths) == args.seq_length


def test_variable_length_micro_batches_pad_with_zero_loss(sample_data):
    from megatron_dpp.data import build_data_iterators

    args = data_args(sample_data, variable_seq_lengths=True, micro_batch_size=4,
                     global_batch_size=8, seq_length=256)
    _, (train, valid, test) = _build(args)
    train_iter, _, _ = build_data_iterators(args, train, valid, test)
    for step, batch in enumerate(_take(train_iter, 4)):
        samples = [train[i] for i in range(step * 4, step * 4 + 4)]
        real = [s["tokens"].numel() for s in samples]
        assert batch["tokens"].shape == (4, max(real))
        assert batch["loss_mask"].sum(dim=1).tolist() == real
        for row, sample in enumerate(samples):
            n = real[row]
            assert torch.equal(batch["tokens"][row, :n], sample["tokens"])
            assert not batch["loss_mask"][row, n:].any()


def test_micro_batch_size_one_has_document_lengths(sample_data):
    from megatron_dpp.data import build_data_iterators

    args = data_args(sample_data, variable_seq_lengths=True, seq_length=128)
    _, (train, valid, test) = _build(args)
    train_iter, _, _ = build_data_iterators(args, train, valid, test)
    shapes = [batch["tokens"].shape for batch in _take(train_iter, 8)]
    assert shapes == [(1, train[i]["tokens"].numel()) for i in range(8)]
    assert len({s[1] for s in shapes}) > 1


@pytest.mark.parametrize("variable", [False, True])
def test_resume_at_consumed_samples_continues_the_stream(sample_data, tmp_path, variable):
    from megatron_dpp.data import build_data_iterators

    args = data_args(sample_data, variable_seq_lengths=variable, micro_batch_size=2,
                     global_batch_size=4, data_cache_path=str(tmp_path / "cache"))
    _, (train, valid, test) = _build(args)
    full = _take(build_data_iterators(args, train, valid, test)[0], 8)
    resumed = _take(build_data_iterators(args, train, valid, test,
                                         consumed_train_samples=3 * args.global_batch_size)[0], 2)
    for a, b in zip(full[6:], resumed):
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["labels"], b["labels"])

    # Two data-parallel ranks (micro-batch 1 each) split the same stream between them.
    args.micro_batch_size = 1
    single = torch.cat([b["tokens"][:, :8] for b in
                        _take(build_data_iterators(args, train, valid, test, 0, 0, 0, 1)[0], 8)])
    per_rank = [torch.cat([b["tokens"][:, :8] for b in _take(
        build_data_iterators(args, train, valid, test, 0, 0, rank, 2)[0], 4)]) for rank in (0, 1)]
    assert torch.equal(single[0::2], per_rank[0]) and torch.equal(single[1::2], per_rank[1])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("variable", [False, True])
def test_empty_split_is_an_error_not_a_hang(sample_data, variable):
    from megatron_dpp.data import DataInputError

    # 10000:0:1 leaves the test split 0 of ~4700 documents while --eval-iters asks samples of it.
    args = data_args(sample_data, split="10000,0,1", variable_seq_lengths=variable)
    with pytest.raises(DataInputError, match="test split .* has no documents yet 4 samples"):
        _build(args)


@pytest.mark.timeout(60)
def test_guarded_dataset_refuses_empty_split_without_precheck(sample_data, tmp_path):
    """The backstop inside the dataset class, for callers that skip the up-front check."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder)

    from megatron_dpp.data import DataInputError, build_tokenizer
    from megatron_dpp.data.datasets import _guarded_gpt_dataset_class, gpt_dataset_config

    args = data_args(sample_data, split="10000,0,1", data_cache_path=str(tmp_path / "cache"))
    config = gpt_dataset_config(args, build_tokenizer(args))
    builder = BlendedMegatronDatasetBuilder(_guarded_gpt_dataset_class(), [8, 0, 4],
                                            lambda: True, config)
    with pytest.raises(DataInputError, match="test split .* has no tokens"):
        builder.build()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["no_data_path", "missing_prefix", "missing_merges",
                                  "empty_split", "bad_split"])
def test_bad_data_flags_are_one_line_exit_2(sample_data, capsys, monkeypatch, case):
    from megatron_dpp.arguments import parse_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    data = ["--data-path", sample_data["data_prefix"], "--vocab-file", sample_data["vocab_file"],
            "--merge-file", sample_data["merge_file"]]
    expected = {"no_data_path": "--data-path is required", "missing_prefix": ".idx not found",
                "missing_merges": "--merge-file", "empty_split": "has no documents",
                "bad_split": "--split"}[case]
    if case == "no_data_path":
        data = data[2:]
    elif case == "missing_prefix":
        data[1] += "_absent"
    elif case == "missing_merges":
        data[5] += ".absent"
    elif case == "empty_split":
        data += ["--split", "10000,0,1"]
    elif case == "bad_split":
        data += ["--split", "90,x"]
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
            "--seq-length", "64", "--micro-batch-size", "1", "--train-iters", "4", "--lr", "1e-3",
            "--eval-iters", "1", "--eval-interval", "2"] + data
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2
    assert len(err.splitlines()) == 1 and expected in err, err


@pytest.mark.parametrize("prefix_key", ["data_prefix", "bert_data_prefix"])
def test_our_index_reader_agrees_with_megatrons(sample_data, prefix_key):
    """data/index_file.py reads .idx files without importing Megatron-Core (the flag pre-check
    uses it): the same arrays as Megatron-Core's IndexedDataset."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_dpp.data.index_file import read_index

    prefix = sample_data[prefix_key]
    ours = read_index(prefix)
    theirs = IndexedDataset(prefix, multimodal=False, mmap=True)
    assert numpy.array_equal(ours.sequence_lengths, theirs.sequence_lengths)
    assert numpy.array_equal(ours.document_indices, theirs.document_indices)
    assert len(ours.sequence_lengths) > 10


def test_a_damaged_index_is_one_line_naming_it(tmp_path):
    from megatron_dpp.data.errors import DataInputError
    from megatron_dpp.data.index_file import read_index

    (tmp_path / "short.idx").write_bytes(b"MMIDIDX")
    (tmp_path / "other.idx").write_bytes(b"NOTANIDX\x00" + bytes(40))
    for name, says in (("short", "too short"), ("other", "is not a version-1")):
        with pytest.raises(DataInputError, match=says) as raised:
            read_index(str(tmp_path / name))
        assert f"{tmp_path / name}.idx" in str(raised.value)


@pytest.mark.parametrize("weights", [[1.0, 0.0, 0.0], [0.969, 0.03, 0.001], [0.9, 0.1, 0.0],
                                     [0.0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3], [0.7, 0.2, 0.1]])
def test_split_ranges_round_as_megatrons_builder(weights):
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix)

    from megatron_dpp.data.datasets import split_ranges

    for count in (1, 7, 100, 12345):
        expected = [None if bookends is None else
                    range(int(round(bookends[0] * count)), int(round(bookends[1] * count)))
                    for bookends in convert_split_vector_to_split_matrix(weights)]
        assert split_ranges(weights, count) == expected
