#!/usr/bin/env bash
# The README's first command: install, build, and run the main job:
# ztier-train with its defaults (a small GPT on the fortunes corpus, the
# engine embedded, optimizer states on NVMe swap under ./ztier-run).
# Extra arguments go to ztier-train (--help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh release
exec build/release/examples/ztier-train "$@"
