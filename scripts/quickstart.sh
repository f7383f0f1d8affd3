#!/usr/bin/env bash
# The README's first command: install, build, and run the main job:
# ztier-train with its defaults (a small GPT on the fortunes corpus, the
# engine embedded, optimizer states on NVMe swap under ./ztier-run).
# Extra arguments go to ztier-train (--help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
# --help asks nothing of the machine: answered without installing or
# building (from the built program where there is one).
for arg in "$@"; do
  if [[ $arg == --help || $arg == -h ]]; then
    if [[ -x build/release/examples/ztier-train ]]; then
      exec build/release/examples/ztier-train --help
    fi
    echo "usage: scripts/quickstart.sh [ztier-train flags]"
    echo "Installs what is missing (apt), builds (scripts/build.sh release), then runs"
    echo "build/release/examples/ztier-train with these flags; once built, this --help"
    echo "shows ztier-train's own."
    exit 0
  fi
done
scripts/build.sh release
exec build/release/examples/ztier-train "$@"
