#!/usr/bin/env bash
# The README's test command: install, build a preset (default: release) and
# run its test suite with CTest. Tests labelled slow or fuzz are left out
# (run the slow ones with: ctest --preset release-slow). GPU tests skip, with the
# reason, when no CUDA device is present.
# Usage: scripts/test.sh [release|debug|asan|tsan] [extra ctest args]
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-release}
shift || true
scripts/build.sh "$preset"
ctest --preset "$preset" -j "$(nproc)" "$@"
