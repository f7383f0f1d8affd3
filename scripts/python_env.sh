#!/usr/bin/env bash
# Creates (or completes) the project's Python environment in .venv: PyTorch
# and NumPy, the independent oracle of the optimizer tests (torch.optim) and
# the side PyTorch users train from. Idempotent: when .venv already imports
# every package at the pinned versions nothing is downloaded; pip's cache
# (~/.cache/pip) is reused. Never touches the system Python.
#
# Usage: scripts/python_env.sh [extra pip requirement...]
#   ZTIER_PYTHON   the interpreter that creates the venv (default: python3)
#   ZTIER_VENV     where the venv goes (default: <repo>/.venv)
# Prints the venv's python path as its last line.
set -euo pipefail
cd "$(dirname "$0")/.."

# PyPI's torch wheel for Linux x86-64 is its CUDA build (it runs on a CPU
# only machine too; the CUDA libraries come as nvidia-* wheels).
requirements=("torch==2.15.0" "numpy>=2.0" "$@")

venv=${ZTIER_VENV:-$PWD/.venv}
python=$venv/bin/python
base=${ZTIER_PYTHON:-python3}

if ! command -v "$base" >/dev/null 2>&1; then
  echo "python_env: $base not found; install Python 3.10 or newer (or set ZTIER_PYTHON)" >&2
  exit 2
fi

satisfied() {
  [[ -x $python ]] || return 1
  "$python" - "$@" <<'EOF' >/dev/null 2>&1
import sys
from importlib.metadata import version, PackageNotFoundError
from packaging.requirements import Requirement
for text in sys.argv[1:]:
    req = Requirement(text)
    try:
        if not req.specifier.contains(version(req.name), prereleases=True):
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
EOF
}

if satisfied "${requirements[@]}"; then
  echo "python_env: $venv has ${requirements[*]}"
  echo "$python"
  exit 0
fi

if [[ ! -x $python ]]; then
  echo "python_env: creating $venv with $("$base" --version 2>&1)"
  if ! "$base" -m venv "$venv"; then
    # Debian's python3 keeps venv (ensurepip) in a package of its own.
    if command -v apt-get >/dev/null 2>&1; then
      sudo=()
      if [[ $(id -u) -ne 0 ]]; then sudo=(sudo); fi
      echo "python_env: installing python3-venv (apt)"
      "${sudo[@]}" apt-get install -y -qq --no-install-recommends python3-venv
      rm -rf "$venv"
      "$base" -m venv "$venv"
    else
      echo "python_env: $base cannot make a venv; install its venv module" >&2
      exit 2
    fi
  fi
fi
pip=("$python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip packaging
echo "python_env: installing ${requirements[*]} (PyTorch is a large download the first time)"
start=$SECONDS
"${pip[@]}" install -q "${requirements[@]}"
"$python" -c 'import torch, numpy; print(f"python_env: torch {torch.__version__}, numpy {numpy.__version__}")'
echo "python_env: ready in $((SECONDS - start)) s"
echo "$python"
