#!/usr/bin/env bash
# Configures and builds one CMake preset (default: release) after making sure
# the dependencies are installed. Usage: scripts/build.sh [release|debug|asan|tsan]
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-release}
scripts/install_deps.sh
cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset" -j "$(nproc)"
