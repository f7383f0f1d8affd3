#!/usr/bin/env bash
# The README's test command: install, build a preset (default: release) and
# run its test suite with CTest, then (release only) the Python suite
# (tests/python: ztier.torch on tiny Hugging Face models) with pytest in the
# project's .venv, after installing the ztier package from this checkout.
# Tests labelled slow or fuzz are left out (run the slow ones with: ctest
# --preset release-slow). GPU tests skip, with the reason, when no CUDA
# device is present. The Python suite skips, with the reason, when there is
# no .venv (scripts/python_env.sh makes it), unless ZTIER_REQUIRE_TORCH=1,
# which makes that a failure.
# Usage: scripts/test.sh [release|debug|asan|tsan] [extra ctest args]
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-release}
shift || true
scripts/build.sh "$preset"
ctest --preset "$preset" -j "$(nproc)" "$@"

if [[ $preset != release ]]; then
  exit 0
fi
venv=${ZTIER_VENV:-$PWD/.venv}
if [[ ! -x $venv/bin/python ]]; then
  if [[ ${ZTIER_REQUIRE_TORCH:-0} == 1 ]]; then
    echo "test: no Python environment at $venv (ZTIER_REQUIRE_TORCH=1); run scripts/python_env.sh" >&2
    exit 1
  fi
  echo "test: Python suite skipped: no $venv (scripts/python_env.sh makes it)"
  exit 0
fi
echo "== python: the ztier package and tests/python"
scripts/python_env.sh >/dev/null
(cd tests/python && "$venv/bin/python" -m pytest -q -p no:cacheprovider .)
