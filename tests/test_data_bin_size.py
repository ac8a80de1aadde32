"""Each data prefix's .bin against its .idx, before anything starts (issue 61): a .bin shorter
than the end of the last sequence the .idx points to (a copy cut short), or empty, is one line that
names both files and the sizes, exit 2, from the flag check (`python -m megatron_dpp.arguments`,
the launchers' pre-check, and parse_args in every rank); a .bin with bytes past that end is
accepted. Without the check, Megatron-Core's IndexedDataset failed in the first training step on
every rank ("offset must be non-negative and no greater than buffer length", "cannot mmap an empty
file").

The sample data is copied into tmp_path before it is damaged; the shared sample is only read.
"""
import os
import shutil
import subprocess

import pytest

from _train_util import PYTHON, REPO_ROOT, TINY_GPT_ARGS, _env, ensure_sample_data

GPT, BERT = "sample_text_document", "sample_bert_text_sentence"
TINY_BERT = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
    "--global-batch-size", "8", "--train-iters", "5", "--lr", "1e-3", "--eval-iters", "0",
]
TINY_LLAMA = [*TINY_GPT_ARGS, "--num-query-groups", "2", "--ffn-hidden-size", "128"]


def copy_prefix(tmp_path, name, damage=None, as_name=None):
    """A copy of the sample's `name`.bin/.idx in tmp_path (as `as_name`), its .bin then `damage`d:
    "half" (cut to half its bytes), "empty", "extra" (1000 bytes more) or None."""
    sample = ensure_sample_data()
    prefix = str(tmp_path / (as_name or name))
    shutil.copyfile(sample / f"{name}.idx", prefix + ".idx")
    shutil.copyfile(sample / f"{name}.bin", prefix + ".bin")
    size = os.path.getsize(prefix + ".bin")
    if damage == "half":
        os.truncate(prefix + ".bin", size // 2)
    elif damage == "empty":
        os.truncate(prefix + ".bin", 0)
    elif damage == "extra":
        with open(prefix + ".bin", "ab") as file:
            file.write(bytes(1000))
    return prefix, size


def short_line(prefix, needed, found):
    return (f"{prefix}.bin is shorter than {prefix}.idx says: expected at least {needed} bytes "
            f"(the end of its last sequence), found {found}")


def empty_line(prefix, needed):
    return f"{prefix}.bin is empty: expected at least {needed} bytes, as {prefix}.idx says"


def gpt_flags(data):
    sample = ensure_sample_data()
    return [*TINY_GPT_ARGS, *data, "--vocab-file", str(sample / "vocab.json"),
            "--merge-file", str(sample / "merges.txt")]


def bert_flags(data):
    return [*TINY_BERT, *data, "--vocab-file", str(ensure_sample_data() / "bert-vocab.txt")]


def _gpt_half(tmp_path):
    prefix, size = copy_prefix(tmp_path, GPT, "half")
    return "gpt", gpt_flags(["--data-path", prefix]), \
        f"--data-path {prefix}: " + short_line(prefix, size, size // 2)


def _gpt_empty(tmp_path):
    prefix, size = copy_prefix(tmp_path, GPT, "empty")
    return "gpt", gpt_flags(["--data-path", prefix]), \
        f"--data-path {prefix}: " + empty_line(prefix, size)


def _gpt_extra(tmp_path):
    prefix, _size = copy_prefix(tmp_path, GPT, "extra")
    return "gpt", gpt_flags(["--data-path", prefix]), None


def _bert_half(tmp_path):
    prefix, size = copy_prefix(tmp_path, BERT, "half")
    return "bert", bert_flags(["--data-path", prefix]), \
        f"--data-path {prefix}: " + short_line(prefix, size, size // 2)


def _bert_empty(tmp_path):
    prefix, size = copy_prefix(tmp_path, BERT, "empty")
    return "bert", bert_flags(["--data-path", prefix]), \
        f"--data-path {prefix}: " + empty_line(prefix, size)


def _bert_extra(tmp_path):
    prefix, _size = copy_prefix(tmp_path, BERT, "extra")
    return "bert", bert_flags(["--data-path", prefix]), None


def _llama_half(tmp_path):
    prefix, size = copy_prefix(tmp_path, GPT, "half")
    return "llama", gpt_flags(["--data-path", prefix]), \
        f"--data-path {prefix}: " + short_line(prefix, size, size // 2)


def _blend_one_bad(tmp_path):
    good, _ = copy_prefix(tmp_path, GPT, None, as_name="good")
    bad, size = copy_prefix(tmp_path, GPT, "half", as_name="bad")
    return "gpt", gpt_flags(["--data-path", "0.7", good, "0.3", bad]), \
        f"--data-path {bad}: " + short_line(bad, size, size // 2)


def _blend_all_good(tmp_path):
    good, _ = copy_prefix(tmp_path, GPT, None, as_name="good")
    longer, _ = copy_prefix(tmp_path, GPT, "extra", as_name="longer")
    return "gpt", gpt_flags(["--data-path", "0.7", good, "0.3", longer]), None


def _valid_path_empty(tmp_path):
    good, _ = copy_prefix(tmp_path, GPT, None, as_name="train")
    bad, size = copy_prefix(tmp_path, GPT, "empty", as_name="valid")
    return "gpt", gpt_flags(["--train-data-path", good, "--valid-data-path", bad]), \
        f"--valid-data-path {bad}: " + empty_line(bad, size)


def _data_args_path_half(tmp_path):
    good, _ = copy_prefix(tmp_path, GPT, None, as_name="good")
    bad, size = copy_prefix(tmp_path, GPT, "half", as_name="bad")
    (tmp_path / "blend.txt").write_text(f"0.5 {good}\n0.5 {bad}\n")
    return "gpt", gpt_flags(["--data-args-path", str(tmp_path / "blend.txt")]), \
        f"--data-args-path {tmp_path / 'blend.txt'}: {bad}: " + short_line(bad, size, size // 2)


# case -> tmp_path -> (model, flags, the error line's text, or None: accepted)
DAMAGE = {
    "gpt_half": _gpt_half,
    "gpt_empty": _gpt_empty,
    "gpt_extra_bytes": _gpt_extra,
    "bert_half": _bert_half,
    "bert_empty": _bert_empty,
    "bert_extra_bytes": _bert_extra,
    "llama_half": _llama_half,
    "blend_one_member_half": _blend_one_bad,
    "blend_members_whole_and_longer": _blend_all_good,
    "valid_data_path_empty": _valid_path_empty,
    "data_args_path_member_half": _data_args_path_half,
}


def parse_in_process(model, flags, monkeypatch, capsys):
    """(exit code, stderr's non-blank lines) of parse_args as each rank runs it (rank 0 of 1)."""
    from megatron_dpp.arguments import parse_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    argv = [*flags, "--model", model] if model == "llama" else flags
    try:
        parse_args(argv, prog=f"megatron_dpp.pretrain_{model}",
                   model=None if model == "llama" else model)
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, [line for line in captured.err.splitlines() if line.strip()]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_bin_shorter_than_its_index_is_one_line_exit_2(case, tmp_path, monkeypatch, capsys):
    model, flags, expected = DAMAGE[case](tmp_path)
    code, lines = parse_in_process(model, flags, monkeypatch, capsys)
    if expected is None:
        assert code == 0, lines
        return
    assert code == 2, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"megatron_dpp.pretrain_{model}: error: "), lines[0]
    assert expected in lines[0], lines[0]


IN_A_PROCESS = ("gpt_half", "bert_empty", "gpt_extra_bytes")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", IN_A_PROCESS)
def test_the_launchers_precheck_refuses_it(case, tmp_path):
    """`python -m megatron_dpp.arguments MODEL`, as the launchers run it before torchrun: the
    line and nothing else on stderr."""
    model, flags, expected = DAMAGE[case](tmp_path)
    result = subprocess.run([PYTHON, "-m", "megatron_dpp.arguments", model, *flags],
                            env=dict(_env(), WORLD_SIZE="1", RANK="0"), cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=80)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    if expected is None:
        assert result.returncode == 0, result.stderr[-2000:]
        return
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1 and expected in lines[0], lines
    assert result.stdout == ""


@pytest.mark.timeout(150)
def test_run_single_gpt_stops_before_torchrun(tmp_path):
    """The launcher with a .bin cut to half: exit 2 with the line, and no rank started."""
    model, flags, expected = _gpt_half(tmp_path)
    sample = ensure_sample_data()
    prefix = flags[flags.index("--data-path") + 1]
    data_args = (f"--data-path {prefix} --vocab-file {sample / 'vocab.json'} "
                 f"--merge-file {sample / 'merges.txt'}")
    result = subprocess.run(["bash", str(REPO_ROOT / "run_scripts" / "run_single_gpt.sh"),
                             "--train-iters", "2"],
                            env=dict(_env(), DATA_ARGS=data_args, NPROC="2"), cwd=tmp_path,
                            capture_output=True, text=True, timeout=140)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert expected in output, output[-3000:]
    assert "Traceback" not in output and "iteration" not in output, output[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines


@pytest.mark.parametrize("name", [GPT, BERT])
def test_the_bytes_needed_are_megatrons_last_sequence_end(name):
    """bin_bytes_needed (the standard library, header and two numbers read) against Megatron-Core's
    IndexedDataset on the sample data: the end of its last sequence, which is the .bin's size."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_dpp.data.index_file import bin_bytes_needed

    prefix = str(ensure_sample_data() / name)
    index = IndexedDataset(prefix).index
    end = int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * index.dtype_size
    assert bin_bytes_needed(prefix) == (end, len(index))
    assert end == os.path.getsize(prefix + ".bin")


def test_an_empty_bin_of_an_index_without_sequences_is_refused_too(tmp_path):
    """An .idx of no sequence and its empty .bin (Megatron-Core cannot memory-map it): one line."""
    import struct

    from megatron_dpp.data.index_file import INDEX_MAGIC, bin_file_problem

    prefix = str(tmp_path / "nothing")
    with open(prefix + ".idx", "wb") as file:  # one document of no sequence: indices 0, 0
        file.write(struct.pack("<9sQBQQ", INDEX_MAGIC, 1, 8, 0, 2) + struct.pack("<2q", 0, 0))
    open(prefix + ".bin", "wb").close()
    assert bin_file_problem(prefix) == (
        f"{prefix}.bin is empty (0 bytes), and {prefix}.idx indexes no sequence: no tokens to "
        f"read; remake both with tools/preprocess_data.py from documents with text")


def test_the_size_check_needs_no_numpy_and_reads_no_bin_byte(tmp_path):
    """bin_file_problem in a process where numpy cannot be imported and opening any .bin fails:
    the standard library, the .idx's header and two numbers, the .bin's size."""
    prefix, size = copy_prefix(tmp_path, GPT, "half")
    code = ("import builtins, io, sys\n"
            "sys.modules['numpy'] = None\n"
            "real_open = io.open\n"
            "def guarded_open(path, *args, **kwargs):\n"
            "    assert not str(path).endswith('.bin'), path\n"
            "    return real_open(path, *args, **kwargs)\n"
            "builtins.open = io.open = guarded_open\n"
            "from megatron_dpp.data.index_file import bin_file_problem\n"
            f"print(bin_file_problem({prefix!r}))\n")
    result = subprocess.run([PYTHON, "-c", code], env=_env(), cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert short_line(prefix, size, size // 2) in result.stdout
