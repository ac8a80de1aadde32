#!/usr/bin/env bash
# The Python that run_scripts/setup_env.sh uses for the environment VENV (its argument): prints its
# path, and one line on stderr saying which one and why. In this order:
#   1. DPP_PYTHON, if set;
#   2. VENV's own Python, if VENV exists (an environment keeps its interpreter);
#   3. a supported Python that already imports a CUDA torch: python3 first (a GPU image's), then
#      python3.13, python3.12, python3.11 (the venv, made with --system-site-packages, uses that torch);
#   4. one that already imports a CPU torch, in the same order;
#   5. the newest supported python3.X found.
# Supported: pyproject.toml's requires-python. A bare name that is a pyenv shim without that version
# selected (`python3.12` -> "command not found") is looked up in pyenv's versions.
# Exit 2 with one line when DPP_PYTHON or VENV's Python is not supported, or none is found.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$1"

# requires-python = ">=3.11,<3.14" -> minors 11..13.
REQUIRES="$(sed -n 's/^requires-python = ">=3\.\([0-9]*\),<3\.\([0-9]*\)"$/\1 \2/p' "$REPO_ROOT/pyproject.toml")"
if [ -z "$REQUIRES" ]; then
  echo "setup_env: cannot read requires-python (\">=3.X,<3.Y\") from $REPO_ROOT/pyproject.toml" >&2
  exit 2
fi
read -r MIN_MINOR END_MINOR <<<"$REQUIRES"
SUPPORTED="3.$MIN_MINOR to 3.$((END_MINOR - 1))"

# "3.12" for an interpreter, or nothing if it does not run.
version_of() {
  "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true
}

supported() {
  [[ "$1" =~ ^3\.([0-9]+)$ ]] && [ "${BASH_REMATCH[1]}" -ge "$MIN_MINOR" ] && [ "${BASH_REMATCH[1]}" -lt "$END_MINOR" ]
}

# "cuda <version>", "cpu <version>" or "none -": the torch an interpreter imports.
torch_of() {
  timeout 300 "$1" -c "import torch; print('cuda' if torch.version.cuda else 'cpu', torch.__version__)" \
    2>/dev/null || echo "none -"
}

# The path of a runnable interpreter for NAME (a name on PATH or a path), or nothing.
runnable() {
  local name="$1" found version
  found="$(command -v "$name" 2>/dev/null)" || return 0
  if "$found" -c "" >/dev/null 2>&1; then
    echo "$found"
    return 0
  fi
  # A pyenv shim whose version is not selected: pyenv's newest installed 3.X of that name.
  if [[ "$name" =~ ^python(3\.[0-9]+)$ ]] && command -v pyenv >/dev/null 2>&1; then
    version="$(pyenv versions --bare 2>/dev/null | grep -E "^${BASH_REMATCH[1]//./\\.}\.[0-9]+$" | sort -V | tail -1)"
    if [ -n "$version" ] && [ -x "$(pyenv root)/versions/$version/bin/$name" ]; then
      echo "$(pyenv root)/versions/$version/bin/$name"
    fi
  fi
}

if [ -n "${DPP_PYTHON:-}" ]; then
  PYTHON="$(runnable "$DPP_PYTHON")"
  VERSION="$([ -z "$PYTHON" ] || version_of "$PYTHON")"
  if [ -z "$VERSION" ]; then
    echo "setup_env: DPP_PYTHON=$DPP_PYTHON does not run; set it to a Python $SUPPORTED" >&2
    exit 2
  fi
  if ! supported "$VERSION"; then
    echo "setup_env: DPP_PYTHON=$DPP_PYTHON is Python $VERSION; this project supports $SUPPORTED (pyproject.toml)" >&2
    exit 2
  fi
  if [ -x "$VENV/bin/python" ] && [ "$(version_of "$VENV/bin/python")" != "$VERSION" ]; then
    echo "setup_env: $VENV has Python $(version_of "$VENV/bin/python"), DPP_PYTHON=$DPP_PYTHON is $VERSION; remove $VENV or set DPP_VENV" >&2
    exit 2
  fi
  echo "setup_env: Python $VERSION ($PYTHON): set by DPP_PYTHON" >&2
  echo "$PYTHON"
  exit 0
fi

if [ -x "$VENV/bin/python" ]; then
  VERSION="$(version_of "$VENV/bin/python")"
  if ! supported "$VERSION"; then
    echo "setup_env: $VENV has Python ${VERSION:-that does not run}; this project supports $SUPPORTED: remove $VENV (or set DPP_VENV) and run again" >&2
    exit 2
  fi
  echo "setup_env: Python $VERSION ($VENV/bin/python): $VENV exists and keeps its interpreter" >&2
  echo "$VENV/bin/python"
  exit 0
fi

CANDIDATES=(python3)
for ((minor = END_MINOR - 1; minor >= MIN_MINOR; minor--)); do CANDIDATES+=("python3.$minor"); done
declare -A SEEN=()
CPU_CHOICE="" NEWEST="" NEWEST_MINOR=0 TRIED=()
for name in "${CANDIDATES[@]}"; do
  path="$(runnable "$name")"
  TRIED+=("$name")
  [ -n "$path" ] || continue
  real="$(readlink -f "$path")"
  [ -z "${SEEN[$real]:-}" ] || continue
  SEEN[$real]=1
  VERSION="$(version_of "$path")"
  supported "$VERSION" || continue
  read -r KIND TORCH <<<"$(torch_of "$path")"
  case "$KIND" in
    cuda)
      echo "setup_env: Python $VERSION ($path): it already imports a CUDA torch ($TORCH)" >&2
      echo "$path"
      exit 0
      ;;
    cpu)
      [ -n "$CPU_CHOICE" ] || CPU_CHOICE="$path $VERSION $TORCH"
      ;;
  esac
  if [ "${VERSION#3.}" -gt "$NEWEST_MINOR" ]; then NEWEST="$path" NEWEST_MINOR="${VERSION#3.}"; fi
done
if [ -n "$CPU_CHOICE" ]; then
  read -r path VERSION TORCH <<<"$CPU_CHOICE"
  echo "setup_env: Python $VERSION ($path): no supported Python imports a CUDA torch; this one imports a CPU torch ($TORCH)" >&2
  echo "$path"
  exit 0
fi
if [ -n "$NEWEST" ]; then
  echo "setup_env: Python 3.$NEWEST_MINOR ($NEWEST): no supported Python imports torch; the newest supported one" >&2
  echo "$NEWEST"
  exit 0
fi
echo "setup_env: no Python $SUPPORTED found (tried ${TRIED[*]}); install one or set DPP_PYTHON" >&2
exit 2
