"""Concurrent jobs on one data directory: Megatron-Core's index cache is built by one job at a time
(megatron_dpp/data/index_cache.py), the sample data too (dir_lock.py); a wait says what it waits
for and ends with a one-line error."""
import os
import threading
import time

import pytest
from _data_util import data_args, sample_data  # noqa: F401 (fixture)

from megatron_dpp.data import dir_lock, index_cache
from megatron_dpp.data.dir_lock import DirectoryLock, lock_file_in
from megatron_dpp.data.errors import DataInputError


def _build(args):
    from megatron_dpp.data import build_tokenizer, build_train_valid_test_datasets

    return build_train_valid_test_datasets(args, build_tokenizer(args))


def _cache_files(directory):
    return sorted(name for _, _, names in os.walk(directory) for name in names
                  if name.endswith(".npy"))


@pytest.mark.timeout(120)
def test_a_second_job_waits_for_the_index_cache_then_loads_it(sample_data, tmp_path, capsys,
                                                               monkeypatch):
    """Another job holds the cache directory's lock (as while it writes the indices): this build
    waits, says so, writes nothing; once the lock is free it builds the cache."""
    monkeypatch.setattr(dir_lock, "WAIT_NOTICE_S", 0.5)
    cache = tmp_path / "cache"
    args = data_args(sample_data, data_cache_path=str(cache))
    lock_path = lock_file_in(str(cache), index_cache.LOCK_NAME)
    assert lock_path == str(cache / index_cache.LOCK_NAME)
    built = []
    with DirectoryLock(lock_path, 10, "the test"):
        builder = threading.Thread(target=lambda: built.append(_build(args)))
        builder.start()
        time.sleep(1.5)
        assert builder.is_alive() and _cache_files(cache) == []
    builder.join(timeout=90)
    assert not builder.is_alive() and built
    train, valid, _ = built[0]
    assert len(train) > 0 and len(valid) > 0
    assert len(_cache_files(cache)) == 6  # document, sample and shuffle index of train and valid
    waits = [line for line in capsys.readouterr().out.splitlines() if "waiting for" in line]
    assert waits and all(line.startswith(f"[data] waiting for {lock_path}, held by "
                                         f"{index_cache.HOLDER} (") for line in waits), waits


@pytest.mark.timeout(60)
def test_a_held_lock_ends_the_wait_with_one_line_naming_it(tmp_path):
    path = lock_file_in(str(tmp_path / "made"), "x.lock")
    assert path is not None and os.path.isfile(path)
    notices = []
    with DirectoryLock(path, 10, "the first holder"):
        with pytest.raises(DataInputError) as error:
            with DirectoryLock(path, 0.6, "the first holder", notices.append):
                pass
    message = str(error.value)
    assert "\n" not in message
    assert message == f"waited 1 s for {path}, held by the first holder; is it stuck?"
    assert notices and notices[0].startswith(f"waiting for {path}, held by the first holder (0 s")
    with DirectoryLock(path, 0.6, "nobody"):  # released: taken at once
        pass


def test_cache_directories_are_megatrons_sorted_and_unlocked_where_unwritable(tmp_path, monkeypatch):
    assert index_cache.index_cache_dirs(["b/x", "a/y", "b/x"], None) == ["a/y/cache", "b/x/cache"]
    assert index_cache.index_cache_dirs(["b/x", "a/y"], "/c") == ["/c"]

    def refuse(*_args, **_kwargs):
        raise PermissionError("read-only")

    monkeypatch.setattr(os, "makedirs", refuse)
    assert lock_file_in(str(tmp_path / "ro"), "x.lock") is None
    taken = []
    monkeypatch.setattr(index_cache, "DirectoryLock", lambda *args: taken.append(args))
    with index_cache.index_cache_lock([str(tmp_path / "ro" / "data")], None):
        pass
    assert taken == []  # nothing to lock: a cache nobody may write is only read
