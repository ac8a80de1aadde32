"""The Megatron-Core internals this project relies on are still there, unchanged (megatron_dpp/
mcore/version.py): every name of SEAMS resolves in the installed megatron-core, and every upstream
source of FINGERPRINTS hashes as it did when our copy or override was written. On an upgrade these
fail once, listing what to re-read (docs/mcore_internals.md says where each is used). The version
gate says in one line which megatron-core runs here and which is installed, before any rank starts."""
import ast
import importlib
import importlib.util
import inspect
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
