#!/usr/bin/env bash
# Builds the libFuzzer targets under tests/fuzz with clang (ASan + UBSan) and
# runs each for a bounded time. Usage: scripts/fuzz.sh [seconds per target]
# (default 60). Crashes are written to build/fuzz/<target>/ and fail the run.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
cxx=${CXX_FUZZ:-clang++}
if ! command -v "$cxx" >/dev/null; then
  echo "fuzz: $cxx not found (scripts/install_deps.sh installs clang)" >&2
  exit 1
fi
out=build/fuzz
mkdir -p "$out"
flags=(-std=c++20 -O1 -g -I. -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all)
common=(common/status.cc common/log.cc common/crc32c.cc)
common+=(common/file_util.cc common/numbers.cc)
declare -A sources=(
  [safetensors_header]="engine/safetensors.cc"
  [settings]="engine/settings.cc"
  [checkpoint_manifest]="engine/checkpoint_manifest.cc"
  [swap_manifest]="nvme/swap_manifest.cc"
)
declare -A libs=()
declare -A seeds=(
  [safetensors_header]=tests/fuzz/seeds/safetensors
  [settings]=tests/fuzz/seeds/settings
  [checkpoint_manifest]=tests/fuzz/seeds/checkpoint_manifest
  [swap_manifest]=tests/fuzz/seeds/swap_manifest
)
for target in safetensors_header settings checkpoint_manifest swap_manifest; do
  echo "fuzz: building $target"
  "$cxx" "${flags[@]}" "tests/fuzz/${target}_fuzz.cc" ${sources[$target]} "${common[@]}" \
    ${libs[$target]:-} -o "$out/$target-fuzzer"
  corpus="$out/$target-corpus"
  mkdir -p "$corpus" "$out/$target"
  echo "fuzz: running $target for ${seconds}s"
  "$out/$target-fuzzer" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -artifact_prefix="$out/$target/" -print_final_stats=1 "$corpus" "${seeds[$target]}" \
    2>&1 | tail -n 4
  if ls "$out/$target"/crash-* "$out/$target"/leak-* "$out/$target"/timeout-* >/dev/null 2>&1; then
    echo "fuzz: $target found a failure: $(ls "$out/$target")" >&2
    exit 1
  fi
done
echo "fuzz: all targets ran ${seconds}s without a failure"
