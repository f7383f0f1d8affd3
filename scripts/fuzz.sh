#!/usr/bin/env bash
# Builds the libFuzzer targets under tests/fuzz with clang (ASan + UBSan) and
# runs each for a bounded time. Usage: scripts/fuzz.sh [seconds per target]
# (default 60). Crashes are written to build/fuzz/<target>/ and fail the run
# with the fuzzer's whole report and the input's path; each target's output
# is kept in build/fuzz/<target>.log.
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
  [safetensors_header]="engine/safetensors.cc engine/json_strict.cc"
  [settings]="engine/settings.cc engine/json_strict.cc"
  [checkpoint_manifest]="engine/checkpoint_manifest.cc engine/json_strict.cc"
  [swap_manifest]="nvme/swap_manifest.cc"
  [protocol]="engine/protocol.cc"
)
declare -A libs=()
declare -A seeds=(
  [safetensors_header]=tests/fuzz/seeds/safetensors
  [settings]=tests/fuzz/seeds/settings
  [checkpoint_manifest]=tests/fuzz/seeds/checkpoint_manifest
  [swap_manifest]=tests/fuzz/seeds/swap_manifest
  [protocol]=tests/fuzz/seeds/protocol
)
# FUZZ_TARGETS="a b" runs a subset.
read -r -a targets <<<"${FUZZ_TARGETS:-safetensors_header settings checkpoint_manifest swap_manifest protocol}"
for target in "${targets[@]}"; do
  echo "fuzz: building $target"
  "$cxx" "${flags[@]}" "tests/fuzz/${target}_fuzz.cc" ${sources[$target]} "${common[@]}" \
    ${libs[$target]:-} -o "$out/$target-fuzzer"
  corpus="$out/$target-corpus"
  rm -rf "$out/$target"  # artifacts of an earlier run are not this run's failures
  mkdir -p "$corpus" "$out/$target"
  echo "fuzz: running $target for ${seconds}s"
  log="$out/$target.log"
  rc=0
  "$out/$target-fuzzer" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -artifact_prefix="$out/$target/" -print_final_stats=1 "$corpus" "${seeds[$target]}" \
    >"$log" 2>&1 || rc=$?
  artifacts=$(ls "$out/$target"/crash-* "$out/$target"/leak-* "$out/$target"/timeout-* \
    "$out/$target"/oom-* 2>/dev/null || true)
  if [[ $rc -ne 0 || -n $artifacts ]]; then
    # The whole report: the sanitizer's stack and the input that caused it.
    cat "$log" >&2
    echo "fuzz: $target failed (exit $rc); the input that caused it: ${artifacts:-none written}" >&2
    echo "fuzz: reproduce with: $out/$target-fuzzer ${artifacts%%$'\n'*}" >&2
    exit 1
  fi
  tail -n 4 "$log"
done
echo "fuzz: all targets ran ${seconds}s without a failure"
