"""--train-data-path / --valid-data-path / --test-data-path: each split reads its own documents, as
in Megatron-LM (Megatron-Core's blend_per_split), instead of a --split share of --data-path.

- Two datasets A (300 documents of the sample corpus) and B (the next 200), and C = A then B: a
  run with --train-data-path A --valid-data-path B trains and evaluates exactly as one with
  --data-path C --split 300,200,0 (train on A's documents, evaluate on B's): the same training
  and validation losses, bit for bit. Without --valid-data-path evaluation is off, said in one line.
- BERT: --train-data-path P trains as --data-path P --split 100,0,0.
- Flag errors: one line each, before anything starts.
"""
import json
import re
from types import SimpleNamespace

import pytest

from _train_util import TINY_GPT_ARGS, ensure_sample_data, flag_error, run_training, without_flags

VALID_RE = re.compile(r" validation loss at iteration\s+(\d+) \| lm loss value: ([-+0-9.eE]+)")
EVALUATE = ["--eval-iters", "2", "--eval-interval", "5"]
SAMPLE = "<the sample data's prefix>"  # in flags: replaced by gpt_prefix() when a test runs


def gpt_tokenizer_args():
    sample = ensure_sample_data()
    return ["--vocab-file", str(sample / "vocab.json"), "--merge-file", str(sample / "merges.txt")]


def gpt_prefix():
    return str(ensure_sample_data() / "sample_text_document")


@pytest.fixture(scope="module")
def a_b_and_c(tmp_path_factory):
    """Prefixes of A (documents 0-299 of the sample corpus), B (300-499) and C (A then B)."""
    from megatron_dpp.data.preprocess_data import output_prefix_for, preprocess_jsonl

    sample = ensure_sample_data()
    with open(sample / "sample_corpus.jsonl") as corpus:
        lines = [next(corpus) for _ in range(500)]
    assert all(json.loads(line)["text"].strip() for line in lines)
    directory = tmp_path_factory.mktemp("per_split")
    prefixes = []
    for name, chosen in (("a", lines[:300]), ("b", lines[300:]), ("c", lines)):
        (directory / f"{name}.jsonl").write_text("".join(chosen))
        preprocess_jsonl(str(directory / f"{name}.jsonl"), str(directory / name),
                         str(sample / "vocab.json"), str(sample / "merges.txt"),
                         append_eod=True, show_progress=False)
        prefixes.append(output_prefix_for(str(directory / name), "text"))
    return prefixes


def train(data_flags, extra=(), entry="megatron_dpp.pretrain_gpt", base=TINY_GPT_ARGS,
          timeout=240):
    rc, losses, _norms, out = run_training([*data_flags, *extra], nproc=1, timeout=timeout,
                                           with_data=False, base_args=base, entry=entry)
    assert rc == 0, out[-3000:]
    return losses, out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_each_split_reads_its_own_path(a_b_and_c):
    a, b, c = a_b_and_c
    shared, shared_out = train(["--data-path", c, "--split", "300,200,0",
                                *gpt_tokenizer_args()], EVALUATE)
    own, own_out = train(["--train-data-path", a, "--valid-data-path", b,
                          *gpt_tokenizer_args()], EVALUATE)
    assert len(shared) == 5 and own == shared
    validation = VALID_RE.findall(shared_out)
    assert len(validation) == 1 and VALID_RE.findall(own_out) == validation, own_out[-2000:]
    # Evaluating A instead of B: another loss, so the check above does tell the paths apart.
    _, on_a = train(["--train-data-path", a, "--valid-data-path", a, *gpt_tokenizer_args()],
                    EVALUATE)
    assert VALID_RE.findall(on_a) != validation
    _, without = train(["--train-data-path", a, *gpt_tokenizer_args()], EVALUATE)
    assert not VALID_RE.findall(without)
    assert without.count(" evaluation off: no --valid-data-path") == 1, without[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bert_reads_its_train_path():
    from test_bert_parity import TINY_BERT_ARGS

    sample = ensure_sample_data()
    prefix, vocab = str(sample / "sample_bert_text_sentence"), str(sample / "bert-vocab.txt")
    base = without_flags(TINY_BERT_ARGS, "--train-iters")
    extra = ["--train-iters", "3", "--vocab-file", vocab]
    whole, _ = train(["--data-path", prefix, "--split", "100,0,0"], extra,
                     entry="megatron_dpp.pretrain_bert", base=base)
    own, _ = train(["--train-data-path", prefix], extra, entry="megatron_dpp.pretrain_bert",
                   base=base)
    assert len(whole) == 3 and own == whole


@pytest.mark.parametrize("flags, words", [
    (["--train-data-path", "P", "--data-path", "P"],
     "--data-path (split by --split) and --train-data-path (a split's own documents) are two "
     "sources of data: give one of the two"),
    (["--train-data-path", "P", "--split", "98,2,0"],
     "--split shares --data-path's documents out; with --train-data-path each split reads its "
     "own: remove --split"),
    (["--valid-data-path", "P"], "--valid-data-path needs --train-data-path: the documents to "
                                 "train on"),
    (["--train-data-path"], "--train-data-path needs PREFIX or a blend `W1 PREFIX1 W2 PREFIX2 ...`"),
    (["--mock-data", "--test-data-path", "P"],
     "--mock-data generates the documents, --test-data-path reads them: give one of the two"),
    (["--train-data-path", "/nonexistent/train"],
     "--train-data-path /nonexistent/train: /nonexistent/train.bin and /nonexistent/train.idx "
     "not found"),
    (["--train-data-path", SAMPLE, "--valid-data-path", "x", SAMPLE],
     "--valid-data-path weight 'x' is not a number"),
    (["--data-path", SAMPLE, "--num-dataset-builder-threads", "0"],
     "--num-dataset-builder-threads must be at least 1"),
])
def test_flag_errors(monkeypatch, capsys, flags, words):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    flags = [gpt_prefix() if flag == SAMPLE else flag for flag in flags]
    line = flag_error(capsys, [*TINY_GPT_ARGS, *gpt_tokenizer_args(), *flags])
    assert words in line, line


def test_the_launcher_passes_each_splits_path_and_leaves_the_sample_data_out(tmp_path, a_b_and_c):
    """run_single_gpt.sh with per-split paths relative to the caller's directory: made absolute,
    blends' prefixes too, and no sample --data-path beside them (the flag check would refuse the
    pair)."""
    import os
    import shlex
    import subprocess

    from _train_util import REPO_ROOT, _env

    a, b, _c = a_b_and_c
    os.symlink(os.path.dirname(a), tmp_path / "data")
    a_rel, b_rel = (os.path.join("data", os.path.basename(p)) for p in (a, b))
    result = subprocess.run(
        ["bash", str(REPO_ROOT / "run_scripts" / "run_single_gpt.sh"), "--dry-run",
         "--train-data-path", "0.5", a_rel, "0.5", b_rel, "--valid-data-path", b_rel],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    line, = [line for line in result.stdout.splitlines() if line.startswith("node 0: ")]
    argv = shlex.split(line[len("node 0: "):])
    assert "--data-path" not in argv
    at = argv.index("--train-data-path")
    data = str(tmp_path / "data")
    assert argv[at + 1:at + 5] == ["0.5", os.path.join(data, os.path.basename(a)), "0.5",
                                   os.path.join(data, os.path.basename(b))]
    assert argv[argv.index("--valid-data-path") + 1] == os.path.join(data, os.path.basename(b))


@pytest.mark.timeout(120)
def test_a_blend_whose_dataset_has_no_document_in_a_split_builds(a_b_and_c):
    """--split 969,30,1 gives B's 200 documents none in the test split, from which nothing is
    drawn (--eval-iters 0): Megatron-Core's GPTDataset asked for 0 samples of 0 tokens looped
    forever (the guard in data/datasets.py ends it)."""
    a, b, _c = a_b_and_c
    losses, _ = train(["--data-path", "0.7", a, "0.3", b, *gpt_tokenizer_args()], timeout=90)
    assert len(losses) == 5


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_blend_built_by_two_threads_is_the_same(a_b_and_c):
    """--num-dataset-builder-threads 2 builds the blend's datasets in two threads (Megatron-Core's
    builder): the same samples, so the same losses."""
    from megatron_dpp.arguments import build_parser
    from megatron_dpp.data.datasets import gpt_dataset_config

    a, b, _c = a_b_and_c
    blend = ["--data-path", "0.7", a, "0.3", b, *gpt_tokenizer_args()]
    one, _ = train(blend, timeout=90)
    two, _ = train(blend, ["--num-dataset-builder-threads", "2"], timeout=90)
    assert len(one) == 5 and two == one
    args = build_parser(model="gpt").parse_args([*blend, "--num-dataset-builder-threads", "2",
                                                 "--split", "98,2,0", "--seq-length", "64"])
    args.seed = 1
    stand_in_tokenizer = SimpleNamespace(vocab_size=4096)  # the config reads only this
    assert gpt_dataset_config(args, stand_in_tokenizer).num_dataset_builder_threads == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_data_args_files_are_their_flags(tmp_path, a_b_and_c):
    """--data-args-path FILE trains as --data-path with FILE's words, and
    --per-split-data-args-path JSON as the per-split flags with its values."""
    a, b, c = a_b_and_c
    (tmp_path / "data_args.txt").write_text(f"0.7 {a}\n0.3\n{b}\n")
    blend, _ = train(["--data-path", "0.7", a, "0.3", b, *gpt_tokenizer_args()])
    from_file, _ = train(["--data-args-path", str(tmp_path / "data_args.txt"),
                          *gpt_tokenizer_args()])
    assert len(blend) == 5 and from_file == blend
    (tmp_path / "per_split.json").write_text(json.dumps({"train": [a], "valid": f"1.0 {b}"}))
    flags, flags_out = train(["--train-data-path", a, "--valid-data-path", "1.0", b,
                              *gpt_tokenizer_args()], EVALUATE)
    from_json, json_out = train(["--per-split-data-args-path", str(tmp_path / "per_split.json"),
                                 *gpt_tokenizer_args()], EVALUATE)
    assert from_json == flags and VALID_RE.findall(json_out) == VALID_RE.findall(flags_out)
    assert VALID_RE.findall(flags_out)


def _write(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


@pytest.mark.parametrize("case", ["both", "empty", "missing", "not_json", "no_train", "unknown_key",
                                  "not_a_list", "with_flag", "missing_prefix", "with_mock_data",
                                  "with_per_split_file"])
def test_data_args_file_errors(monkeypatch, capsys, tmp_path, case):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    words = {"--data-args-path": _write(tmp_path, "ok.txt", gpt_prefix())}
    # Every case's file is written (the table is built whole): one name per content.
    json_file = lambda content: _write(tmp_path, f"split{abs(hash(content))}.json", content)  # noqa: E731
    flags, expected = {
        "both": (["--data-args-path", words["--data-args-path"], "--data-path", gpt_prefix()],
                 "--data-args-path holds --data-path's values: give one of the two"),
        "empty": (["--data-args-path", _write(tmp_path, "empty.txt", " \n")],
                  "is empty; write PREFIX or W1 PREFIX1 W2 PREFIX2 ... in it"),
        "missing": (["--data-args-path", str(tmp_path / "nowhere.txt")],
                    f"--data-args-path {tmp_path / 'nowhere.txt'}: No such file or directory"),
        "not_json": (["--per-split-data-args-path", json_file("{train: x")], "is not JSON"),
        "no_train": (["--per-split-data-args-path", json_file('{"valid": "x"}')],
                     "must hold a JSON object with a \"train\" key"),
        "unknown_key": (["--per-split-data-args-path",
                         json_file(json.dumps({"train": gpt_prefix(), "validation": "x"}))],
                        "unknown key 'validation'; the keys are train, valid and test"),
        "not_a_list": (["--per-split-data-args-path", json_file('{"train": 3}')],
                       "train must be a string or a list, like --train-data-path's values"),
        "with_flag": (["--per-split-data-args-path", json_file(json.dumps({"train": gpt_prefix()})),
                       "--valid-data-path", gpt_prefix()],
                      "holds --valid-data-path's values: give one of the two"),
        "missing_prefix": (["--data-args-path", _write(tmp_path, "gone.txt", "/nonexistent/x")],
                           f"--data-args-path {tmp_path / 'gone.txt'}: /nonexistent/x: "
                           f"/nonexistent/x.bin and /nonexistent/x.idx not found"),
        # A conflict names the file that gave the values, not a flag the user did not type.
        "with_mock_data": (["--data-args-path", words["--data-args-path"], "--mock-data"],
                           f"--mock-data generates the documents, --data-args-path "
                           f"{words['--data-args-path']} reads them: give one of the two"),
        "with_per_split_file": (["--data-args-path", words["--data-args-path"],
                                 "--per-split-data-args-path",
                                 json_file(json.dumps({"train": gpt_prefix()}))],
                                f"--data-args-path {words['--data-args-path']} (split by --split) "
                                f"and --per-split-data-args-path"),
    }[case]
    line = flag_error(capsys, [*TINY_GPT_ARGS, *gpt_tokenizer_args(), *flags])
    assert expected in line, line
