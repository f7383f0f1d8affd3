#!/usr/bin/env bash
# Creates (or completes) the project's Python environment in .venv: PyTorch
# and NumPy (the independent oracle of the optimizer tests, torch.optim),
# Hugging Face transformers / safetensors / accelerate and pytest (the Python
# suite, tests/python), matplotlib (benchmarks/plot.py), nanobind and
# scikit-build-core (the build of the package), then builds and installs the
# ztier package itself (pip install ./python: ztier._C over the C++ client,
# and ztier.torch).
# Idempotent: when .venv already has every package at the pinned versions
# nothing is downloaded; pip's cache (~/.cache/pip) is reused, and the
# package's CMake build (build/python/) is incremental. Never touches the
# system Python.
#
# Usage: scripts/python_env.sh [extra pip requirement...]
#   ZTIER_PYTHON   the interpreter that creates the venv (default: python3)
#   ZTIER_VENV     where the venv goes (default: <repo>/.venv)
#   ZTIER_PYTHON_PACKAGE=0   skip building and installing the ztier package
# Prints the venv's python path as its last line.
set -euo pipefail
cd "$(dirname "$0")/.."

# PyPI's torch wheel for Linux x86-64 is its CUDA build (it runs on a CPU
# only machine too; the CUDA libraries come as nvidia-* wheels).
requirements=("torch==2.15.0" "numpy>=2.0" "transformers==5.23.0" "safetensors==0.8.0"
              "accelerate==1.15.0" "pytest==9.2.0" "matplotlib==3.11.2" "nanobind==3.1.0"
              "scikit-build-core==1.1.2" "$@")

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

# The ztier package, built from this checkout (incremental after the first
# time); it needs the C++ dependencies (apt) first.
install_package() {
  if [[ ${ZTIER_PYTHON_PACKAGE:-1} == 0 ]]; then return; fi
  scripts/install_deps.sh
  echo "python_env: building and installing the ztier package (pip install ./python)"
  local start=$SECONDS
  "$python" -m pip --disable-pip-version-check install -q --no-build-isolation --no-deps \
    --force-reinstall ./python
  echo "python_env: ztier $("$python" -c 'import ztier; print(ztier.__version__)') installed in $((SECONDS - start)) s"
}

if satisfied "${requirements[@]}"; then
  echo "python_env: $venv has ${requirements[*]}"
  install_package
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
install_package
echo "$python"
