"""The build self-check: every transport error class raised through every compiled extension must
arrive in Python as its own class. run_scripts/setup_env.sh runs it after each build.

    python tools/check_extensions.py              # check in a subprocess; if that dies, rebuild with
                                                  # the system compiler and check again
    python tools/check_extensions.py --in-process # the check itself (a crash kills this process)

Why: compiled by a g++ newer than the libstdc++ the process loads (a GPU image's CXX=/opt/gcc/bin/g++),
the extensions built and imported, and then every C++ error raised into Python was a SIGSEGV. Such a
build is found here, at install time, and rebuilt with the system compiler (/usr/bin/g++); if that
dies too, one line names the compilers and the libstdc++ each links against versus the one loaded.
Exit status: 0 passed, 1 a wrong class (a bug in the bindings), 2 the check process died.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEM_CC = "/usr/bin/gcc"
SYSTEM_CXX = "/usr/bin/g++"

# errors.h class (what raise_for_build_check throws) -> the Python class it must arrive as.
ERROR_CLASSES = {
    "TransportError": "TransportError",
    "TransportTimeout": "TransportTimeout",
    "PeerLost": "PeerLostError",
    "ProtocolError": "ProtocolError",
    "MessageTooLarge": "MessageTooLargeError",
}
# Each extension's classes follow megatron_dpp/comm/errors.py: a RuntimeError, a timeout also a
# TimeoutError.
PYTHON_BASES = {"TransportTimeout": (TimeoutError,)}
LIBSTDCXX_PREFIX = "libstdc++ loaded: "
CHECKING_PREFIX = "checking "


def extension_modules() -> list[str]:
    """shm_tensor._C always; rdma_tensor._C when it was built (it needs UCX's headers)."""
    modules = ["shm_tensor._C"]
    if importlib.util.find_spec("rdma_tensor._C") is not None:
        modules.append("rdma_tensor._C")
    return modules


def loaded_libstdcxx() -> str:
    """The libstdc++ this process mapped (/proc/self/maps), or "unknown"."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "libstdc++.so" in os.path.basename(path):
                    return os.path.realpath(path)
    except OSError:
        pass
    return "unknown"


def problem_with(module, cpp_class: str) -> str:
    """"" when raise_for_build_check(cpp_class) arrives as the module's class, else what went wrong."""
    if not hasattr(module, "raise_for_build_check"):
        return f"{module.__name__} predates the self-check (no raise_for_build_check): rebuild it"
    expected = getattr(module, ERROR_CLASSES[cpp_class])
    try:
        module.raise_for_build_check(cpp_class)
    except Exception as error:  # noqa: BLE001 -- any class is an answer to check
        got = type(error)
        if got is not expected:
            return f"{module.__name__}: {cpp_class} arrived as {got.__module__}.{got.__qualname__}"
        for base in (module.TransportError, RuntimeError, *PYTHON_BASES.get(ERROR_CLASSES[cpp_class], ())):
            if not issubclass(got, base):
                return f"{module.__name__}: {got.__qualname__} is not a subclass of {base.__qualname__}"
        return ""
    return f"{module.__name__}: raise_for_build_check({cpp_class}) returned without raising"


def check_in_process() -> int:
    """Imports every extension first (as a training run does), then raises each class through each."""
    sys.path.insert(0, REPO_ROOT)  # this checkout's extensions, whatever else is installed
    import torch  # noqa: F401 -- the extensions link against torch's libraries

    modules = []
    for name in extension_modules():
        try:
            modules.append(importlib.import_module(name))
        except ImportError as error:
            print(f"check_extensions: {name} does not import: {error}", file=sys.stderr)
            return 1
    print(LIBSTDCXX_PREFIX + loaded_libstdcxx(), flush=True)
    for module in modules:
        for cpp_class in ERROR_CLASSES:
            print(f"{CHECKING_PREFIX}{module.__name__} {cpp_class}", flush=True)
            problem = problem_with(module, cpp_class)
            if problem:
                print(f"check_extensions: {problem}", file=sys.stderr)
                return 1
    names = ", ".join(module.__name__ for module in modules)
    print(f"check_extensions: passed: {len(ERROR_CLASSES)} error classes raised through {names}, each "
          f"caught as its own class")
    return 0


def compiler_libstdcxx(cxx: str) -> str:
    """The libstdc++ `cxx` links against (`cxx -print-file-name=libstdc++.so`), or "unknown"."""
    try:
        printed = subprocess.run([cxx, "-print-file-name=libstdc++.so"], capture_output=True, text=True,
                                 timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return os.path.realpath(printed) if os.path.isabs(printed) else "unknown"


def resolved(command: str) -> str:
    """The file a compiler command runs (symlinks followed), or the command itself if not found."""
    found = shutil.which(command)
    return os.path.realpath(found) if found else command


def run_check(check_command: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """(exit status, negative for a signal; the libstdc++ it loaded; what it was doing last)."""
    result = subprocess.run(check_command, env=env, capture_output=True, text=True)
    libstdcxx, last_step = "unknown", ""
    for line in result.stdout.splitlines():
        if line.startswith(LIBSTDCXX_PREFIX):
            libstdcxx = line[len(LIBSTDCXX_PREFIX):]
        elif line.startswith(CHECKING_PREFIX):
            last_step = line[len(CHECKING_PREFIX):]
    if result.returncode == 0:
        print(result.stdout.splitlines()[-1] if result.stdout else "check_extensions: passed")
    elif result.returncode > 0:
        sys.stderr.write(result.stderr)
    return result.returncode, libstdcxx, last_step


def death(returncode: int, last_step: str) -> str:
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"died ({name}) raising {last_step}" if last_step else f"died ({name})"


def check_and_rebuild(check_command: list[str], rebuild_command: list[str], env: dict[str, str],
                      system_cc: str = SYSTEM_CC, system_cxx: str = SYSTEM_CXX) -> int:
    """Runs the check; if its process dies and the build did not use `system_cxx`, rebuilds with
    `system_cc`/`system_cxx` and checks again. Returns the exit status of the module (see its doc)."""
    returncode, loaded, last_step = run_check(check_command, env)
    if returncode >= 0:
        return 0 if returncode == 0 else 1
    cxx = env.get("CXX", "c++")  # what torch's BuildExtension compiles with
    first = (f"CXX={cxx} (libstdc++ {compiler_libstdcxx(cxx)}) {death(returncode, last_step)}; "
             f"the process loaded libstdc++ {loaded}")
    if not os.path.exists(system_cxx):
        print(f"check_extensions: the build made with {first}; no system compiler {system_cxx} to "
              f"rebuild with: build with a g++ whose libstdc++ is the one loaded", file=sys.stderr)
        return 2
    if resolved(cxx) == resolved(system_cxx):
        print(f"check_extensions: the build made with {first}; that is the system compiler already",
              file=sys.stderr)
        return 2
    print(f"check_extensions: the build made with {first}: rebuilding with CXX={system_cxx}", flush=True)
    rebuild_env = dict(env, CC=system_cc, CXX=system_cxx)
    rebuilt = subprocess.run(rebuild_command, env=rebuild_env, cwd=REPO_ROOT, capture_output=True, text=True)
    if rebuilt.returncode != 0:
        sys.stderr.write("".join((rebuilt.stdout + rebuilt.stderr).splitlines(keepends=True)[-20:]))
        print(f"check_extensions: the rebuild with CXX={system_cxx} failed (exit {rebuilt.returncode}, its "
              f"last lines above): {' '.join(rebuild_command)}", file=sys.stderr)
        return 2
    returncode, loaded, last_step = run_check(check_command, env)
    if returncode >= 0:
        return 0 if returncode == 0 else 1
    print(f"check_extensions: the build made with {first}; rebuilt with CXX={system_cxx} (libstdc++ "
          f"{compiler_libstdcxx(system_cxx)}) it {death(returncode, last_step)}, loaded libstdc++ "
          f"{loaded}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-process", action="store_true",
                        help="run the check in this process, without the crash handling and rebuild")
    args = parser.parse_args(argv)
    if args.in_process:
        return check_in_process()
    check_command = [sys.executable, os.path.abspath(__file__), "--in-process"]
    rebuild_command = [sys.executable, "setup.py", "build_ext", "--inplace"]
    return check_and_rebuild(check_command, rebuild_command, dict(os.environ))


if __name__ == "__main__":
    sys.exit(main())
