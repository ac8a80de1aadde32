"""Every repository path docs/architecture.md names exists: a newcomer who follows the map finds the
file. A name with a folder (`training/loop.py`, `megatron_dpp/pipeline/`, `csrc/common/...`) is read
from the repository root or from megatron_dpp/; a bare file name (`loop.py` in its package's row)
must exist somewhere in the repository."""
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Files that runs write or read, named in the map for what they hold, not repository paths.
RUN_FILES = {"checksums.json", "config.json"}
_PATH_LIKE = re.compile(r"^[\w.\-/]+(\.(py|md|sh|h|cpp|json|toml|txt)|/)$")


def named_paths(text: str) -> set:
    """The backticked words of `text` shaped like a file or folder path."""
    words = {word.rstrip(",.:;") for word in re.findall(r"`([^`\s]+)`", text)}
    return {word for word in words if _PATH_LIKE.match(word) and word not in RUN_FILES}


def _exists(path: str) -> bool:
    if "/" in path.rstrip("/"):
        return any((base / path).exists() for base in (ROOT, ROOT / "megatron_dpp"))
    name = path.rstrip("/")
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [sub for sub in subfolders if not sub.startswith(".")]  # .git, .venv
        if name in files or name in subfolders:
            return True
    return False


def test_every_path_the_architecture_map_names_exists():
    names = named_paths((ROOT / "docs" / "architecture.md").read_text())
    assert len(names) > 50, sorted(names)  # the map names its files
    missing = sorted(name for name in names if not _exists(name))
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_a_missing_path_is_found():
    assert named_paths("`training/no_such_file.py` and `loop.py`, `--flag`") == \
        {"training/no_such_file.py", "loop.py"}
    assert not _exists("training/no_such_file.py") and _exists("training/loop.py")
