#!/usr/bin/env bash
# Idempotent environment setup: a Python virtual environment with torch, megatron-core and this
# package installed editable (with the compiled shm_tensor and rdma_tensor, checked by
# tools/check_extensions.py after each build), and UCX from the system packages. Second run: a few
# seconds.
#   DPP_VENV=/path/to/venv   where the environment lives (default: <repo>/.venv)
#   DPP_PYTHON=python3.12    the interpreter that creates it (default: run_scripts/choose_python.sh
#                            picks one: a Python 3.11-3.13 that already imports a CUDA torch, else
#                            a CPU torch, else the newest; an existing environment keeps its own)
#   -h, --help               this text
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DPP_VENV:-$REPO_ROOT/.venv}"
TORCH_PIN="torch==2.13.0"

case "$#:${1:-}" in
  0:) ;;
  1:-h | 1:--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "setup_env: unexpected arguments: $*; it takes --help or nothing (settings are variables)" >&2; exit 2 ;;
esac

PYTHON="$(bash "$REPO_ROOT/run_scripts/choose_python.sh" "$VENV")" || exit 2

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup_env: creating $VENV"
  # --system-site-packages keeps a CUDA torch that a GPU machine already has.
  "$PYTHON" -m venv --system-site-packages "$VENV"
  # --system-site-packages reaches only the base interpreter's packages. When the chosen Python is
  # itself a venv (a GPU image's /opt/torch/.venv/bin/python3, say), a .pth file makes that venv's
  # packages (its CUDA torch) visible too, behind ours.
  PARENT_SITE="$("$PYTHON" -c 'import sys, sysconfig
if sys.prefix != sys.base_prefix:
    print("\n".join(dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])))')"
  if [ -n "$PARENT_SITE" ]; then
    VENV_SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
    echo "$PARENT_SITE" >"$VENV_SITE/_megatron_dpp_parent_venv.pth"
    echo "setup_env: $PYTHON is a virtual environment itself; its packages stay visible ($VENV_SITE/_megatron_dpp_parent_venv.pth)"
  fi
fi
PY="$VENV/bin/python"

# UCX for rdma_tensor (the cross-node transport): Debian's libucx-dev, built with verbs and rdmacm,
# so one build uses InfiniBand/RoCE on a cluster and TCP elsewhere. (PyPI's UCX wheel lacks verbs.)
if [ ! -f /usr/include/ucp/api/ucp.h ]; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup_env: installing libucx-dev (UCX, for rdma_tensor)"
    export DEBIAN_FRONTEND=noninteractive
    if ! { apt-get install -y -q libucx-dev >/dev/null 2>&1 ||
           { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libucx-dev >/dev/null 2>&1; }; }; then
      # No package registry (an offline GPU image): one node still works through shm_tensor.
      echo "setup_env: could not install libucx-dev (apt-get failed); building without rdma_tensor, so --p2p-transport rdma (across nodes) is unavailable"
    fi
  else
    echo "setup_env: UCX headers missing; install them first (Debian/Ubuntu: sudo apt-get install libucx-dev), then run this again" >&2
    exit 2
  fi
fi

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "setup_env: installing $TORCH_PIN"
  "$PY" -m pip install -q "$TORCH_PIN"
fi
TORCH_VERSION="$("$PY" -W ignore -c 'import torch; print(torch.__version__.split("+")[0])')"

# Stamp: the install is redone only when the package metadata or the C++ sources change.
STAMP="$VENV/.megatron_dpp_installed"
HASH="$(cd "$REPO_ROOT" && cat pyproject.toml setup.py $(find csrc -type f 2>/dev/null | sort) | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$HASH" ]; then
  echo "setup_env: installing megatron-dpp (editable) with torch $TORCH_VERSION kept"
  CONSTRAINTS="$(mktemp)"
  trap 'rm -f "$CONSTRAINTS"' EXIT
  echo "torch==$TORCH_VERSION" >"$CONSTRAINTS"
  "$PY" -m pip install -q -c "$CONSTRAINTS" setuptools wheel ninja
  (cd "$REPO_ROOT" && "$PY" -m pip install -q -c "$CONSTRAINTS" --no-build-isolation -e ".[test]")
  # Every transport error raised through every extension, in a subprocess: a build whose error path
  # crashes is rebuilt with the system compiler, or stops here with one line (exit 2).
  "$PY" "$REPO_ROOT/tools/check_extensions.py"
  echo "$HASH" >"$STAMP"
fi
echo "setup_env: ready ($VENV, Python $("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])'), torch $TORCH_VERSION)"
