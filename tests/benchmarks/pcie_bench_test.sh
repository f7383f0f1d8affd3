#!/usr/bin/env bash
# ztier-bench pcie as a user runs it: on the host backend every size is
# measured against its limit in the same run; asked for a CUDA device where
# there is none it says so at once (before the engine pins its states: about
# 8 GiB for the default size, which took 40 s to give the same answer); bad
# options are usage errors.
set -euo pipefail
bench=$1
json=$("$bench" pcie --device host --max-size 1M --reps 2 --json | tail -n 1)
for key in '"backend":"host"' '"h2d_ratio":' '"d2h_ratio":' '"both_ratio":' '"sizes":'; do
  [[ $json == *"$key"* ]] || { echo "no $key in: $json"; exit 1; }
done
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  status=0
  start=$SECONDS
  err=$(timeout 60 "$bench" pcie --device cuda 2>&1 >/dev/null) || status=$?
  [ "$status" -eq 1 ] || { echo "--device cuda without a GPU gave exit $status: $err"; exit 1; }
  [[ $err == *"no CUDA device"* || $err == *"CUDA"* ]] || { echo "unclear error: $err"; exit 1; }
  # Not a speed target: the answer must come before the 8 GiB of states.
  ((SECONDS - start < 10)) || { echo "--device cuda without a GPU took $((SECONDS - start)) s"; exit 1; }
fi
for bad in "--max-size 3" "--reps 0" "--device tpu" "--bogus"; do
  status=0
  # shellcheck disable=SC2086
  "$bench" pcie $bad >/dev/null 2>&1 || status=$?
  [ "$status" -eq 2 ] || { echo "'$bad' gave exit $status, not a usage error"; exit 1; }
done
# A count that does not parse is named by its flag and range (it was "'-1'
# is not a size", of no flag).
status=0
err=$("$bench" pcie --ordinal -1 2>&1 >/dev/null) || status=$?
[[ $status -eq 2 && $err == *"--ordinal -1: "*"; want 0..1023"* ]] ||
  { echo "--ordinal -1 gave exit $status: $err"; exit 1; }
echo "pcie_bench_test: ok"
