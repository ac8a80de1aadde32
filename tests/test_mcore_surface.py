"""The Megatron-Core internals this project relies on are still there, unchanged (megatron_dpp/
mcore/version.py): every name of SEAMS resolves in the installed megatron-core, and every upstream
source of FINGERPRINTS hashes as it did when our copy or override was written. On an upgrade these
fail once, listing what to re-read (docs/mcore_internals.md says where each is used). The version
gate says in one line which megatron-core runs here and which is installed, before any rank starts."""
import ast
import importlib
import importlib.util
import inspect
import pathlib
import subprocess
import sys

import pytest

from megatron_dpp.mcore.version import (FINGERPRINTS, SEAMS, SUPPORTED_VERSIONS, installed_version,
                                        source_fingerprint, version_obstacle)


def _resolve(module: str, qualname: str):
    found = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def test_the_installed_megatron_core_is_a_supported_one():
    assert installed_version() in SUPPORTED_VERSIONS
    assert version_obstacle(installed_version()) is None
    from megatron.core import package_info
    assert package_info.__version__ == installed_version()


def _upstream_source(module: str, qualname: str) -> str:
    """The definition's text in the module's file, decorators included, as inspect.getsource gives
    it: read from the file, not from the live object, which the CPU patches may have rebound."""
    path = importlib.util.find_spec(module).origin
    text = open(path, encoding="utf-8").read()
    scope = ast.parse(text).body
    node = None
    for name in qualname.split("."):
        node = next(child for child in scope
                    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                    and child.name == name)
        scope = node.body
    first = min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)])
    return "".join(text.splitlines(keepends=True)[first - 1:node.end_lineno])


def test_every_seam_resolves():
    missing = []
    for (module, qualname), use in SEAMS.items():
        try:
            _resolve(module, qualname)
        except (ImportError, AttributeError) as error:
            missing.append(f"{module}:{qualname} ({use}): {type(error).__name__}")
    assert not missing, "Megatron-Core internals that are gone:\n" + "\n".join(missing)


def test_every_copied_source_is_unchanged():
    changed = []
    for (module, qualname), fingerprint in FINGERPRINTS.items():
        if source_fingerprint(_upstream_source(module, qualname)) != fingerprint:
            changed.append(f"{module}:{qualname}")
    assert not changed, ("upstream sources that changed since our copy or override was written "
                         "(re-read each against its use, docs/mcore_internals.md):\n"
                         + "\n".join(changed))


def test_a_changed_source_or_a_missing_name_is_found():
    (module, qualname), fingerprint = next(iter(FINGERPRINTS.items()))
    source = _upstream_source(module, qualname)
    assert source == inspect.getsource(_resolve(module, qualname))  # the same text as inspect's
    assert source_fingerprint(source) == fingerprint
    assert source_fingerprint(source + "\n# one more line") != fingerprint
    with pytest.raises(AttributeError):
        _resolve("megatron.core.pipeline_parallel.schedules", "no_such_function")


@pytest.mark.parametrize("installed, expected", [
    ("0.17.0", "megatron-core 0.17.0 is installed; megatron-dpp runs on megatron-core 0.16.1 only "
               "(it relies on internals that change between releases, docs/mcore_internals.md): "
               "pip install megatron-core==0.16.1"),
    (None, "megatron-core is not installed; megatron-dpp runs on megatron-core 0.16.1: "
           "bash run_scripts/setup_env.sh, or pip install megatron-core==0.16.1"),
])
def test_another_version_is_one_line(installed, expected):
    assert version_obstacle(installed) == expected


def test_the_flag_check_stops_on_another_version_before_anything_runs():
    """The launchers' check (python -m megatron_dpp.arguments) with the metadata saying 0.17.0."""
    code = ("import sys; from importlib import metadata; real = metadata.version\n"
            "metadata.version = lambda name: '0.17.0' if name == 'megatron-core' else real(name)\n"
            "from megatron_dpp.arguments import parse_args\n"
            "parse_args(['--num-layers', '2'], prog='megatron_dpp.pretrain_gpt')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env={"WORLD_SIZE": "1", "RANK": "0",
                                              "PATH": "/usr/bin:/bin"})
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "megatron_dpp.pretrain_gpt: error: megatron-core 0.17.0 is installed; megatron-dpp runs on "
        "megatron-core 0.16.1 only (it relies on internals that change between releases, "
        "docs/mcore_internals.md): pip install megatron-core==0.16.1"], result.stderr


# ---------------------------------------------------------------------------------------------
# Nothing outside megatron_dpp/mcore/ names a private Megatron-Core attribute
# ---------------------------------------------------------------------------------------------
REPO = pathlib.Path(__file__).resolve().parents[1]
GUARDED_FOLDERS = ("megatron_dpp", "benchmarks", "tools")

# Names that Megatron-Core happens to use for something of its own too, and whose owner here is
# another: ours (allowed only in a file that defines the name itself: there it is ours), or
# torch's.
OTHER_OWNERS = {
    "_cond": "ours", "_finished": "ours", "_forward": "ours", "_handle": "ours", "_index": "ours",
    "_name": "ours", "_open": "ours", "_read": "ours", "_split": "ours", "_start": "ours",
    "_tensors": "ours", "_tokenizer": "ours", "_value": "ours", "_vocab_size": "ours",
    "_C": "torch's (torch._C) and our extensions' compiled modules",
}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_"


def _defined_names(tree: ast.AST) -> set:
    """Names a file defines: functions, classes, assigned names and attributes, arguments."""
    defined = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            defined.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
    return defined


def _reaching_names(tree: ast.AST):
    """(name, line) of every mention that can reach into another module's objects: attributes,
    imported names and modules, strings that are identifiers (getattr(x, "_name")), and methods
    (an override). A plain name (a local, a module-level function) is the file's own."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            yield node.attr, node.lineno
        elif isinstance(node, ast.ClassDef):
            for child in node.body:
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield child.name, child.lineno
        elif isinstance(node, ast.alias):
            for part in node.name.split("."):
                yield part, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module:
            for part in node.module.split("."):
                yield part, node.lineno
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.isidentifier():
            yield node.value, node.lineno


def _megatron_core_private_names() -> set:
    """Every private name Megatron-Core's source defines or imports, and its private modules."""
    root = pathlib.Path(importlib.util.find_spec("megatron.core").origin).parent
    names = set()
    for path in root.rglob("*.py"):
        names.update(part for part in path.relative_to(root).with_suffix("").parts
                     if _is_private(part))
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except SyntaxError:
            continue
        names.update(name for name in _defined_names(tree) if _is_private(name))
        names.update(alias.asname or alias.name.split(".")[-1] for node in ast.walk(tree)
                     if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names
                     if _is_private(alias.asname or alias.name.split(".")[-1]))
    return names


def _reaches_into_megatron_core(path: pathlib.Path, private: set) -> list:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    defined = _defined_names(tree)

    def allowed(name: str) -> bool:
        owner = OTHER_OWNERS.get(name)
        return owner is not None and (owner != "ours" or name in defined)

    return sorted({f"{path.relative_to(REPO)}:{line}: {name}"
                   for name, line in _reaching_names(tree) if name in private and not allowed(name)})


def test_nothing_outside_mcore_names_a_private_megatron_core_attribute():
    private = _megatron_core_private_names()
    mcore = REPO / "megatron_dpp" / "mcore"
    found = []
    for folder in GUARDED_FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            if mcore not in path.parents:
                found += _reaches_into_megatron_core(path, private)
    assert not found, ("private Megatron-Core names outside megatron_dpp/mcore/ (move the use "
                       "behind a named function there, or, for a name that is not Megatron-Core's, "
                       "add it to OTHER_OWNERS):\n" + "\n".join(found))


def test_a_reach_into_megatron_core_outside_mcore_is_found(tmp_path):
    private = _megatron_core_private_names()
    assert {"_communicate", "_get_num_epochs", "_forward_impl"} <= private
    reach = tmp_path / "reach.py"
    reach.write_text("from megatron.core.fusions.fused_bias_dropout import _bias_dropout_add_func\n"
                     "def f(layer):\n"
                     "    return layer._forward_impl, getattr(layer, '_handle')\n")
    global REPO
    saved, REPO = REPO, tmp_path
    try:
        assert _reaches_into_megatron_core(reach, private) == [
            "reach.py:1: _bias_dropout_add_func", "reach.py:3: _forward_impl",
            "reach.py:3: _handle"]
    finally:
        REPO = saved
