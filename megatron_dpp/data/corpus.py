"""The sample corpus: documentation strings of the Python standard library, made locally.

Every machine with Python has this text, so the project needs no download. Sources are parsed with
`ast` (never imported: importing some stdlib modules has side effects). One docstring is one
document, which gives the spread of lengths the variable-sequence-length mode wants.
"""
import ast
import json
import os
import sysconfig
from typing import Iterator, Tuple

# Directories whose docstrings are test scaffolding or demos rather than prose.
_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo",
                 "lib2to3", "__pycache__", "ensurepip"}
MIN_DOCSTRING_CHARS = 64
_DOCUMENTED_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def stdlib_source_files(stdlib_dir: str) -> Iterator[str]:
    """The stdlib's .py files in a fixed (sorted) order, so the corpus is deterministic."""
    for dirpath, dirnames, filenames in os.walk(stdlib_dir):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def docstrings_of(path: str) -> Iterator[str]:
    """Docstrings of the module, its classes and functions, in source order."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return  # a few stdlib files are deliberately invalid or in other encodings
    for node in ast.walk(tree):
        if isinstance(node, _DOCUMENTED_NODES):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= MIN_DOCSTRING_CHARS:
                yield doc


def write_stdlib_corpus(output_path: str, progress=None) -> Tuple[int, int]:
    """Write the corpus as JSONL ({"text": ...} per line); returns (documents, characters).

    Written under a temporary name and renamed, so an existing file is always complete.
    `progress(files_done, files_total)` is called as files are read, when given.
    """
    stdlib_dir = sysconfig.get_paths()["stdlib"]
    files = list(stdlib_source_files(stdlib_dir))
    documents = characters = 0
    tmp_path = f"{output_path}.tmp{os.getpid()}"
    with open(tmp_path, "w", encoding="utf-8") as out:
        for done, path in enumerate(files, start=1):
            for doc in docstrings_of(path):
                out.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
                documents += 1
                characters += len(doc)
            if progress is not None:
                progress(done, len(files))
    os.replace(tmp_path, output_path)
    return documents, characters
