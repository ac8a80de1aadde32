"""--mock-data (Megatron-Core's generated documents) and Megatron-LM's NullTokenizer
(--tokenizer-type NullTokenizer --vocab-size N), the pair Megatron-LM's examples run without a
dataset: the tokenizer's ids, the flags' one-line errors, training on them (fixed and variable
lengths, --use-dpp against Megatron's schedule), and the launcher leaving out the sample data."""
import re
import shlex

import pytest

from _train_util import TINY_GPT_ARGS, flag_error, run_training
from megatron_dpp.data.tokenizer import NullTokenizer
from test_launch_paths import SCRIPTS, _run

MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]


def test_null_tokenizer_is_megatron_lms():
    tokenizer = NullTokenizer(1000)
    assert tokenizer.vocab_size == 1001 and tokenizer.eod == 1000
    assert tokenizer.tokenize("3 14 159") == [3, 14, 159]
    assert tokenizer.detokenize([3, 14, 159]) == "3 14 159"


def _error(monkeypatch, capsys, *flags, model="gpt"):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    return flag_error(capsys, [*TINY_GPT_ARGS, *flags], model=model)


def test_flag_errors(monkeypatch, capsys):
    from _train_util import data_args

    assert "--mock-data generates the documents, --data-path reads them: give one of the two" \
        in _error(monkeypatch, capsys, *MOCK, *data_args())
    assert ("--data-path is required (or --mock-data for generated documents, or "
            "--train-data-path ... for each split's own)") in \
        _error(monkeypatch, capsys)
    assert "--tokenizer-type NullTokenizer needs --vocab-size N > 0" in \
        _error(monkeypatch, capsys, "--mock-data", "--tokenizer-type", "NullTokenizer")
    assert "--vocab-size is read by --tokenizer-type NullTokenizer and TikTokenizer only" in \
        _error(monkeypatch, capsys, *data_args(), "--vocab-size", "1000")
    assert "--vocab-file is not read by --tokenizer-type NullTokenizer (it reads no file)" in \
        _error(monkeypatch, capsys, *MOCK, "--vocab-file", "vocab.json")
    assert "--mock-data is for GPT and Llama" in \
        _error(monkeypatch, capsys, "--mock-data", model="bert")


@pytest.mark.timeout(400)
def test_training_on_generated_documents():
    rc, losses, _norms, out = run_training(["--train-iters", "4", *MOCK], nproc=1,
                                           with_data=False)
    assert rc == 0 and len(losses) == 4, out[-3000:]
    assert "(new size: 1024)" in out  # 1001 ids padded to a multiple of 128
    assert losses[-1] < losses[0]
    # The dynamic schedule trains the same numbers as Megatron's on them.
    pipeline = ["--train-iters", "3", *MOCK, "--pipeline-model-parallel-size", "2"]
    rc, megatron, _n, out = run_training(pipeline, nproc=2, with_data=False)
    assert rc == 0 and len(megatron) == 3, out[-3000:]
    rc, dpp, _n, out = run_training([*pipeline, "--use-dpp"], nproc=2, with_data=False)
    assert rc == 0, out[-3000:]
    assert dpp == pytest.approx(megatron, rel=1e-6)
    # One generated document per sample, cut to --seq-length.
    rc, variable, _n, out = run_training(["--train-iters", "2", *MOCK, "--variable-seq-lengths"],
                                         nproc=1, with_data=False)
    assert rc == 0 and len(variable) == 2, out[-3000:]


def _dry_run_argv(tmp_path, *flags):
    result = _run(["bash", str(SCRIPTS / "run_single_gpt.sh"), "--dry-run", *flags], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    line, = [line for line in result.stdout.splitlines() if line.startswith("node 0: ")]
    return shlex.split(line[len("node 0: "):])


def test_the_launcher_leaves_the_sample_data_out(tmp_path):
    argv = _dry_run_argv(tmp_path, "--mock-data")
    assert "--data-path" not in argv and "--mock-data" in argv
    assert re.search(r"vocab\.json$", argv[argv.index("--vocab-file") + 1])  # the sample tokenizer
    argv = _dry_run_argv(tmp_path, *MOCK)
    assert "--data-path" not in argv and "--vocab-file" not in argv and "--merge-file" not in argv
