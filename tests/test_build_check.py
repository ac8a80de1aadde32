"""The build self-check (tools/check_extensions.py), its rebuild-with-the-system-compiler fallback,
and run_scripts/choose_python.sh (which Python setup_env.sh builds the environment with)."""
from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK_SCRIPT = os.path.join(REPO_ROOT, "tools", "check_extensions.py")
CHOOSE_PYTHON = os.path.join(REPO_ROOT, "run_scripts", "choose_python.sh")
SETUP_ENV = os.path.join(REPO_ROOT, "run_scripts", "setup_env.sh")


def load_check_module():
    spec = importlib.util.spec_from_file_location("check_extensions", CHECK_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_extensions = load_check_module()


def extension(name: str):
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not built (rdma_tensor needs UCX's headers)")
    import torch  # noqa: F401 -- the extensions link against torch's libraries

    return importlib.import_module(name)


# --- the real extensions -------------------------------------------------------------------------

@pytest.mark.parametrize("module_name", ["shm_tensor._C", "rdma_tensor._C"])
@pytest.mark.parametrize("cpp_class", sorted(check_extensions.ERROR_CLASSES))
def test_each_error_class_arrives_as_its_own_class(module_name, cpp_class):
    # Both extensions loaded, as in a training run: with pybind11's shared (global) translators the one
    # registered last answered for both, and shm_tensor's errors arrived as rdma_tensor's classes.
    module = extension(module_name)
    for name in ("shm_tensor._C", "rdma_tensor._C"):
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)
    expected = getattr(module, check_extensions.ERROR_CLASSES[cpp_class])
    with pytest.raises(expected) as raised:
        module.raise_for_build_check(cpp_class)
    assert type(raised.value) is expected
    assert isinstance(raised.value, module.TransportError) and isinstance(raised.value, RuntimeError)
    assert isinstance(raised.value, TimeoutError) == (cpp_class == "TransportTimeout")
    assert f"raise_for_build_check({cpp_class})" in str(raised.value)


def test_an_unknown_class_is_a_value_error():
    module = extension("shm_tensor._C")
    with pytest.raises(ValueError, match="NoSuchError"):
        module.raise_for_build_check("NoSuchError")


def test_check_passes_on_this_build():
    result = subprocess.run([sys.executable, CHECK_SCRIPT], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("check_extensions: passed: 5 error classes raised through shm_tensor._C")


# --- the fallback: a check process that dies ----------------------------------------------------

LOADED = "/usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.30"


def dying_check(unless_exists: str = "") -> list[str]:
    """A check command that prints what the real one prints first, then dies by SIGSEGV (unless the
    file `unless_exists` exists: then it passes)."""
    code = (
        "import os, signal, sys\n"
        f"if {unless_exists!r} and os.path.exists({unless_exists!r}):\n"
        "    print('check_extensions: passed: fake'); sys.exit(0)\n"
        f"print({check_extensions.LIBSTDCXX_PREFIX + LOADED!r})\n"
        "print('checking shm_tensor._C ProtocolError', flush=True)\n"
        "os.kill(os.getpid(), signal.SIGSEGV)\n"
    )
    return [sys.executable, "-c", code]


def recording_rebuild(marker: str) -> list[str]:
    """A rebuild command that writes the CC and CXX it was given to `marker`."""
    code = f"import os; open({marker!r}, 'w').write(os.environ['CC'] + ' ' + os.environ['CXX'])"
    return [sys.executable, "-c", code]


NEWER_CXX = "/opt/newer-gcc/bin/g++"  # not on this machine: its libstdc++ reads as "unknown"


def test_a_crash_rebuilds_with_the_system_compiler_and_passes(tmp_path, capsys):
    marker = str(tmp_path / "rebuilt")
    status = check_extensions.check_and_rebuild(
        dying_check(unless_exists=marker), recording_rebuild(marker), dict(os.environ, CXX=NEWER_CXX),
        system_cc="/usr/bin/gcc", system_cxx="/usr/bin/g++")
    out, err = capsys.readouterr()
    assert status == 0, err
    with open(marker) as rebuilt:
        assert rebuilt.read() == "/usr/bin/gcc /usr/bin/g++"
    assert f"CXX={NEWER_CXX}" in out and "died (SIGSEGV) raising shm_tensor._C ProtocolError" in out
    assert "rebuilding with CXX=/usr/bin/g++" in out and "check_extensions: passed: fake" in out


def test_a_crash_after_the_rebuild_stops_with_one_line_naming_the_mismatch(tmp_path, capsys):
    marker = str(tmp_path / "rebuilt")
    status = check_extensions.check_and_rebuild(
        dying_check(), recording_rebuild(marker), dict(os.environ, CXX=NEWER_CXX),
        system_cc="/usr/bin/gcc", system_cxx="/usr/bin/g++")
    _, err = capsys.readouterr()
    assert status == 2
    assert os.path.exists(marker)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert f"CXX={NEWER_CXX} (libstdc++ unknown) died (SIGSEGV)" in line
    assert "rebuilt with CXX=/usr/bin/g++ (libstdc++ " in line
    assert f"loaded libstdc++ {LOADED}" in line


def test_a_crash_with_the_system_compiler_does_not_rebuild(tmp_path, capsys):
    marker = str(tmp_path / "rebuilt")
    status = check_extensions.check_and_rebuild(
        dying_check(), recording_rebuild(marker), dict(os.environ, CXX="/usr/bin/g++"),
        system_cc="/usr/bin/gcc", system_cxx="/usr/bin/g++")
    _, err = capsys.readouterr()
    assert status == 2 and not os.path.exists(marker)
    assert len(err.strip().splitlines()) == 1 and "that is the system compiler already" in err


def test_a_crash_without_a_system_compiler_stops_with_one_line(tmp_path, capsys):
    marker = str(tmp_path / "rebuilt")
    status = check_extensions.check_and_rebuild(
        dying_check(), recording_rebuild(marker), dict(os.environ, CXX=NEWER_CXX),
        system_cc="/nonexistent/gcc", system_cxx="/nonexistent/g++")
    _, err = capsys.readouterr()
    assert status == 2 and not os.path.exists(marker)
    assert err.strip().splitlines() == [err.strip()] and "no system compiler /nonexistent/g++" in err
    assert f"CXX={NEWER_CXX}" in err and f"loaded libstdc++ {LOADED}" in err


def test_a_failed_rebuild_stops_with_its_last_lines(capsys):
    failing = [sys.executable, "-c", "import sys; print('csrc/x.cpp:1: error: boom'); sys.exit(3)"]
    status = check_extensions.check_and_rebuild(
        dying_check(), failing, dict(os.environ, CXX=NEWER_CXX), system_cc="/usr/bin/gcc",
        system_cxx="/usr/bin/g++")
    _, err = capsys.readouterr()
    assert status == 2
    assert err.strip().splitlines() == [
        "csrc/x.cpp:1: error: boom",
        "check_extensions: the rebuild with CXX=/usr/bin/g++ failed (exit 3, its last lines above): "
        + " ".join(failing)]


def test_a_wrong_class_fails_without_a_rebuild(tmp_path, capsys):
    marker = str(tmp_path / "rebuilt")
    wrong = [sys.executable, "-c", "import sys; print('check_extensions: x: wrong class', file=sys.stderr); sys.exit(1)"]
    status = check_extensions.check_and_rebuild(
        wrong, recording_rebuild(marker), dict(os.environ, CXX=NEWER_CXX),
        system_cc="/usr/bin/gcc", system_cxx="/usr/bin/g++")
    _, err = capsys.readouterr()
    assert status == 1 and not os.path.exists(marker)
    assert err.strip() == "check_extensions: x: wrong class"


# --- choose_python.sh, with fake interpreters --------------------------------------------------

def fake_python(directory, name: str, version: str, torch: str = "") -> str:
    """An executable that answers like a Python `version` whose `import torch` gives
    `torch` ("cuda 2.11.0+cu130", "cpu 2.13.0+cpu") or fails ("")."""
    path = os.path.join(directory, name)
    torch_answer = f'echo "{torch}"' if torch else "exit 1"
    with open(path, "w") as script:
        script.write(f'#!/bin/bash\ncase "$2" in *"import torch"*) {torch_answer};; *) echo {version};; esac\n')
    os.chmod(path, 0o755)
    return path


# What choose_python.sh runs besides the interpreters: the PATH holds only these and the fakes, so
# the machine's own Pythons (and pyenv) stay out of the choice.
SHELL_TOOLS = ("dirname", "sed", "timeout", "readlink", "grep", "sort", "tail")


def choose(tmp_path, interpreters: dict[str, tuple[str, str]], venv: str = "", dpp_python: str = ""):
    bin_dir = tmp_path / "bin"
    tools_dir = tmp_path / "tools"
    if not bin_dir.exists():
        bin_dir.mkdir()
        tools_dir.mkdir()
        for tool in SHELL_TOOLS:
            os.symlink(shutil.which(tool), tools_dir / tool)
    for name, (version, torch) in interpreters.items():
        fake_python(bin_dir, name, version, torch)
    env = {"PATH": f"{bin_dir}:{tools_dir}", "HOME": str(tmp_path)}
    if dpp_python:
        env["DPP_PYTHON"] = dpp_python
    return subprocess.run(["/bin/bash", CHOOSE_PYTHON, venv or str(tmp_path / "venv")], env=env,
                          capture_output=True, text=True, timeout=60)


def test_choose_prefers_a_cuda_torch_then_python3(tmp_path):
    result = choose(tmp_path, {"python3": ("3.12", "cuda 2.11.0+cu130"), "python3.13": ("3.13", ""),
                               "python3.11": ("3.11", "cuda 2.13.0+cu130")})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "bin" / "python3")
    assert result.stderr.strip() == (f"setup_env: Python 3.12 ({tmp_path}/bin/python3): it already "
                                     "imports a CUDA torch (2.11.0+cu130)")


def test_choose_takes_a_cuda_torch_over_a_newer_python(tmp_path):
    result = choose(tmp_path, {"python3": ("3.10", "cpu 2.4.0"), "python3.13": ("3.13", ""),
                               "python3.12": ("3.12", "cpu 2.13.0+cpu"), "python3.11": ("3.11", "cuda 2.13.0+cu130")})
    assert result.stdout.strip() == str(tmp_path / "bin" / "python3.11"), result.stderr


def test_choose_takes_a_cpu_torch_when_none_has_cuda(tmp_path):
    result = choose(tmp_path, {"python3.13": ("3.13", ""), "python3.11": ("3.11", "cpu 2.13.0+cpu")})
    assert result.stdout.strip() == str(tmp_path / "bin" / "python3.11"), result.stderr
    assert "imports a CPU torch (2.13.0+cpu)" in result.stderr


def test_choose_takes_the_newest_when_none_has_torch(tmp_path):
    result = choose(tmp_path, {"python3": ("3.11", ""), "python3.12": ("3.12", ""), "python3.11": ("3.11", "")})
    assert result.stdout.strip() == str(tmp_path / "bin" / "python3.12"), result.stderr
    assert "the newest supported one" in result.stderr


def test_choose_fails_in_one_line_without_a_supported_python(tmp_path):
    result = choose(tmp_path, {"python3": ("3.10", "cpu 2.4.0")})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "setup_env: no Python 3.11 to 3.13 found (tried python3 python3.13 python3.12 python3.11); "
        "install one or set DPP_PYTHON"]


def test_an_existing_venv_keeps_its_python(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake_python(venv / "bin", "python", "3.12")
    result = choose(tmp_path, {"python3": ("3.13", "cuda 2.11.0+cu130")}, venv=str(venv))
    assert result.stdout.strip() == str(venv / "bin" / "python"), result.stderr
    assert "exists and keeps its interpreter" in result.stderr


def test_dpp_python_wins_and_must_match_an_existing_venv(tmp_path):
    chosen = choose(tmp_path, {"python3": ("3.12", "cuda 2.11.0+cu130"), "python3.11": ("3.11", "")},
                    dpp_python="python3.11")
    assert chosen.stdout.strip() == str(tmp_path / "bin" / "python3.11"), chosen.stderr
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake_python(venv / "bin", "python", "3.12")
    clash = choose(tmp_path, {}, venv=str(venv), dpp_python="python3.11")
    assert clash.returncode == 2 and len(clash.stderr.strip().splitlines()) == 1
    assert "has Python 3.12, DPP_PYTHON=python3.11 is 3.11" in clash.stderr


def test_setup_env_refuses_an_unsupported_dpp_python_in_one_line(tmp_path):
    fake = fake_python(tmp_path, "python3.10", "3.10")
    venv = tmp_path / "venv"
    result = subprocess.run(["bash", SETUP_ENV], env=dict(os.environ, DPP_PYTHON=fake, DPP_VENV=str(venv)),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and not venv.exists()
    assert result.stderr.strip().splitlines() == [
        f"setup_env: DPP_PYTHON={fake} is Python 3.10; this project supports 3.11 to 3.13 (pyproject.toml)"]


def test_setup_env_explains_itself_and_refuses_arguments_in_one_line():
    usage = subprocess.run(["bash", SETUP_ENV, "--help"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 0 and usage.stderr == ""
    assert "DPP_VENV" in usage.stdout and "DPP_PYTHON" in usage.stdout and "--help" in usage.stdout
    assert not usage.stdout.lstrip().startswith("#") and "set -euo" not in usage.stdout
    for argv in (["--torch"], ["--help", "extra"]):
        wrong = subprocess.run(["bash", SETUP_ENV, *argv], capture_output=True, text=True, timeout=60)
        assert wrong.returncode == 2 and wrong.stdout == "", argv
        assert wrong.stderr.strip().splitlines() == [
            f"setup_env: unexpected arguments: {' '.join(argv)}; it takes --help or nothing "
            "(settings are variables)"]
