"""What makes a checkpoint trustworthy: the checksum manifest written at save and verified at load,
and the estimate of the space a save needs. No process group here: save_load.py makes the ranks
agree on what these functions find.

The manifest is one JSON file per iteration folder, iter_NNNNNNN/checksums.json, written by rank 0
once every rank's files are on disk and before the folder is published (renamed from .saving):

    {"format": "megatron_dpp checksums", "version": 1, "algorithm": "crc32",
     "files": {"rank_00000.pt": {"bytes": 5545, "crc32": "1a2b3c4d"}, ...}}

It records every file of the folder but itself, by name (no subfolders: neither format makes any).
Each rank checksums the files it wrote (owner_rank: rank_RRRRR.pt and __R_*.distcp are rank R's,
the format's metadata files rank 0's): the per-rank files of --ckpt-format torch as they are
written, torch_dist's files read back once Megatron-Core wrote them (still in the page cache).
At load every rank checks its share of the files again (the same owner rule) before anything is
loaded, and the ranks agree on the first problem.

The saved state itself says that a manifest was written (SAVED_WITH_CHECKSUMS, in common.pt or in
each rank_RRRRR.pt), so that a deleted manifest is told apart from a checkpoint saved before
checksums were recorded (or by Megatron-LM), which loads with a one-line warning.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import zlib

import torch

MANIFEST_FILE = "checksums.json"
MANIFEST_FORMAT = "megatron_dpp checksums"
MANIFEST_VERSION = 1
# CRC-32, not SHA-256: the manifest guards against accidental damage (flipped bits, torn or
# truncated writes, a file copied from another checkpoint), which CRC-32 catches in every burst up
# to 32 bits and otherwise misses with probability 2^-32; together with the recorded size that is
# sound. zlib's CRC-32 runs at 3.8 GB/s on this machine, hashlib's SHA-256 at 1.6 GB/s with SHA
# instructions and far slower without them. Tampering is out of scope: whoever can rewrite a file
# can rewrite the manifest too.
ALGORITHM = "crc32"
CHUNK_BYTES = 8 << 20  # files are read in chunks: bounded memory whatever their size
# The key of the saved state (torch_dist's common.pt, each rank_RRRRR.pt) that names the manifest.
SAVED_WITH_CHECKSUMS = "megatron_dpp_checksums"

# What a save needs beyond the bytes of its tensors, per rank: the pickled args, RNG and scheduler
# states and the formats' own metadata (a few hundred KiB), plus 5% for the archives' headers.
SPACE_MARGIN_BYTES = 1 << 20
SPACE_MARGIN_FRACTION = 0.05

_OWNED_FILE = re.compile(r"(?:rank_|__)(\d+)")


class CheckpointDamaged(ValueError):
    """A file of a checkpoint that is missing, unreadable or not what was saved; the message is
    one line that names it."""


# ----------------------------------------------------------------------------------------------
# checksums
# ----------------------------------------------------------------------------------------------
class _ChecksummingWriter:
    """A binary file torch.save writes through: the checksum is computed on the way to disk."""

    def __init__(self, handle):
        self._handle = handle
        self._crc = 0
        self._bytes = 0
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            written = self._handle.write(data)
        except OSError as exc:
            self.error = exc  # torch's writer turns it into "unexpected pos": keep the real one
            raise
        self._crc = zlib.crc32(data, self._crc)
        self._bytes += len(data)
        return written

    def flush(self) -> None:
        self._handle.flush()

    def entry(self) -> dict:
        return {"bytes": self._bytes, ALGORITHM: f"{self._crc:08x}"}


def save_with_checksum(obj, path: str) -> dict:
    """torch.save `obj` to `path`, synced to disk, and its manifest entry (no second read).
    Raises OSError naming `path`, with the write's errno (a full disk: errno 28)."""
    try:
        with open(path, "wb") as handle:
            writer = _ChecksummingWriter(handle)
            try:
                torch.save(obj, writer)
            except RuntimeError:
                if writer.error is None:
                    raise
                raise writer.error from None
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        raise _naming(exc, path) from None
    return writer.entry()


def _naming(error: OSError, path: str) -> OSError:
    """`error` with `path` as its file name when it has none (a failed write() names no file)."""
    if error.filename is not None or error.errno is None:
        return error
    return type(error)(error.errno, error.strerror, path)


def file_entry(path: str) -> dict:
    """The manifest entry of a file on disk (read in chunks). Raises OSError."""
    crc = size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"bytes": size, ALGORITHM: f"{crc:08x}"}


def owner_rank(name: str, world_size: int) -> int:
    """The rank that checksums file `name` at save and checks it at load: R for rank_RRRRR.pt and
    __R_*.distcp (modulo the world size, when loading at another layout), 0 for the rest."""
    match = _OWNED_FILE.match(name)
    return int(match.group(1)) % world_size if match else 0


def checkpoint_files(directory: str) -> list[str]:
    """The files a manifest records: every regular file of the folder but the manifest."""
    return sorted(name for name in os.listdir(directory)
                  if name != MANIFEST_FILE and os.path.isfile(os.path.join(directory, name)))


def write_manifest(directory: str, entries: dict[str, dict]) -> None:
    """Rank 0, into the staging folder before it is published. Raises OSError."""
    manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "algorithm": ALGORITHM,
                "files": dict(sorted(entries.items()))}
    path = os.path.join(directory, MANIFEST_FILE)
    try:
        with open(path, "w") as handle:
            json.dump(manifest, handle, indent=1)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        raise _naming(exc, path) from None


# ----------------------------------------------------------------------------------------------
# verification (at load)
# ----------------------------------------------------------------------------------------------
def read_manifest(directory: str) -> dict[str, dict] | None:
    """The recorded files {name: entry}; None when the folder has no manifest. Raises
    CheckpointDamaged when it cannot be read or is not a manifest of this version."""
    path = os.path.join(directory, MANIFEST_FILE)
    if not os.path.lexists(path):
        return None
    try:
        with open(path, "rb") as handle:
            manifest = json.loads(handle.read().decode("utf-8"))
    except OSError as exc:
        raise CheckpointDamaged(f"checkpoint file {path} cannot be read: {_os_words(exc)}") from None
    except ValueError as exc:  # not UTF-8, not JSON
        raise CheckpointDamaged(f"checkpoint file {path} is damaged: not a JSON manifest "
                                f"({' '.join(str(exc).split())[:120]})") from None
    problem = _manifest_problem(manifest)
    if problem is not None:
        raise CheckpointDamaged(f"checkpoint file {path} is damaged: {problem}")
    return manifest["files"]


def _manifest_problem(manifest) -> str | None:
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return f"not a {MANIFEST_FORMAT!r} manifest"
    if manifest.get("version") != MANIFEST_VERSION or manifest.get("algorithm") != ALGORITHM:
        return (f"version {manifest.get('version')!r} with algorithm "
                f"{manifest.get('algorithm')!r}; this program reads version {MANIFEST_VERSION} "
                f"with {ALGORITHM}")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "it records no files"
    for name, entry in files.items():
        if "/" in name or name in ("", ".", "..") or not isinstance(entry, dict) or \
                not isinstance(entry.get("bytes"), int) or not isinstance(entry.get(ALGORITHM), str):
            return f"its entry {name!r} is not a file name with bytes and {ALGORITHM}"
    return None


def check_listing(directory: str, recorded: dict[str, dict]) -> None:
    """Every recorded file is there, and nothing else. Raises CheckpointDamaged."""
    present = set(checkpoint_files(directory))
    missing = sorted(set(recorded) - present)
    if missing:
        raise CheckpointDamaged(f"checkpoint file {os.path.join(directory, missing[0])} is "
                                f"missing (recorded in {MANIFEST_FILE})")
    extra = sorted(present - set(recorded))
    if extra:
        raise CheckpointDamaged(f"checkpoint file {os.path.join(directory, extra[0])} is not "
                                f"recorded in {MANIFEST_FILE}: it was added after the save (or "
                                f"comes from another layout); remove it")


def check_file(directory: str, name: str, recorded: dict) -> None:
    """The file is what was saved: its size, then its checksum. Raises CheckpointDamaged."""
    path = os.path.join(directory, name)
    try:
        found = os.path.getsize(path)
        if found != recorded["bytes"]:
            raise CheckpointDamaged(f"checkpoint file {path} is damaged: "
                                    f"{_size_words(recorded['bytes'], found)}")
        entry = file_entry(path)
    except OSError as exc:
        raise CheckpointDamaged(f"checkpoint file {path} cannot be read: {_os_words(exc)}") from None
    if entry[ALGORITHM] != recorded[ALGORITHM]:
        raise CheckpointDamaged(f"checkpoint file {path} is damaged: checksum mismatch "
                                f"({ALGORITHM} recorded {recorded[ALGORITHM]}, found "
                                f"{entry[ALGORITHM]})")


def _size_words(recorded: int, found: int) -> str:
    if found == 0:
        return f"it is empty ({recorded} bytes recorded)"
    if found < recorded:
        return f"truncated ({recorded} bytes recorded, {found} found)"
    return f"longer than saved ({recorded} bytes recorded, {found} found)"


def _os_words(error: OSError) -> str:
    if error.errno is not None and error.strerror:
        return f"[Errno {error.errno}] {error.strerror}"
    return f"{type(error).__name__}: {error}"


def missing_manifest(directory: str) -> str:
    """The error of a checkpoint whose state says it was saved with a manifest that is gone."""
    return (f"checkpoint file {os.path.join(directory, MANIFEST_FILE)} is missing: the checkpoint "
            f"was saved with checksums, so its files cannot be verified")


def unverified_warning(directory: str) -> str:
    return (f"checkpoint {directory} has no {MANIFEST_FILE} (saved before checksums were "
            f"recorded, or by Megatron-LM): no checksums recorded; not verified")


# ----------------------------------------------------------------------------------------------
# space (before a save)
# ----------------------------------------------------------------------------------------------
def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def tensor_bytes(*objects) -> int:
    """Bytes of the distinct tensors in nested dicts, lists and tuples (a tensor reached twice
    is saved once, and counts once)."""
    seen: set = set()
    total = 0
    for tensor in _tensors(objects):
        key = (tensor.device, tensor.data_ptr(), tensor.nbytes)
        if key not in seen:
            seen.add(key)
            total += tensor.nbytes
    return total


def bytes_needed(tensors: int) -> int:
    """This rank's share of a save: the bytes of its tensors plus the margin."""
    return int(tensors * (1 + SPACE_MARGIN_FRACTION)) + SPACE_MARGIN_BYTES


def free_bytes(path: str) -> int:
    """Free bytes (as an unprivileged user sees them) on the filesystem that holds or will hold
    `path`. Raises OSError."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    return shutil.disk_usage(existing).free


def space_problem(where: str, needed: int, free: int) -> str | None:
    if needed <= free:
        return None
    return (f"not enough free space in {where}: the checkpoint needs about {size_words(needed)} "
            f"(every rank's tensors plus {SPACE_MARGIN_FRACTION:.0%} and "
            f"{size_words(SPACE_MARGIN_BYTES)} a rank), {size_words(free)} are free")


def size_words(count: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} bytes"
