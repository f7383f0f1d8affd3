#!/usr/bin/env bash
# The README's first command: install, build, and run the main job.
# Today the main job is the CPU AdamW benchmark (ztier-bench adam) with its
# default sizes; extra arguments go to it.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh release
exec build/release/benchmarks/ztier-bench adam "$@"
