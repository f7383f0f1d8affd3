#!/usr/bin/env bash
# ztier-bench adam as a user runs it: every case of a small run is timed
# against its memory kernel (a ratio, a positive rate) in fp32 and int8
# states; sizes this machine cannot hold, past 2^64 bytes too, are refused
# before anything is allocated, and bad options are usage errors.
set -euo pipefail
bench=$1
for dtype in fp32 int8; do
  json=$("$bench" adam --params 64K,96K --threads 1 --runs 2 --state-dtype "$dtype" --json | tail -n 1)
  python3 - "$json" "$dtype" <<'PY'
import json, sys
o = json.loads(sys.argv[1])
cases = o["cases"]
assert sorted({c["params"] for c in cases}) == [65536, 98304], cases
for c in cases:
    assert c["state_dtype"] == sys.argv[2], c
    assert c["seconds"] > 0 and c["limit_seconds"] > 0, c
    assert c["ratio_to_limit"] > 0, c
    assert abs(c["params_per_s"] * c["seconds"] - c["params"]) <= 1e-3 * c["params"], c
PY
done
# Output that cannot all be written is a failure, not exit 0 (a JSON cut
# mid-object then went on to the next command of a script).
if [[ -w /dev/full ]]; then
  status=0
  err=$("$bench" adam --params 64K --threads 1 --runs 1 --json 2>&1 >/dev/full) || status=$?
  [[ $status -eq 1 && $err == *"its output could not all be written"* ]] ||
    { echo "adam > /dev/full gave exit $status: $err"; exit 1; }
fi
# 18e18 params need ~3e20 bytes: more than 2^64, which the check used to wrap.
for n in 18000000000000000000 4T; do
  status=0
  out=$("$bench" adam --params "$n" --threads 1 2>&1) || status=$?
  [[ $status -eq 1 && $out == *"bytes of memory; this machine has"* ]] ||
    { echo "--params $n gave exit $status: $out"; exit 1; }
  [[ $out != *"cannot allocate"* ]] || { echo "--params $n was allocated first: $out"; exit 1; }
done
for bad in "--params 0x10" "--params 64K, " "--threads 0" "--state-dtype fp16" "--bogus" "--out none --store both"; do
  status=0
  # shellcheck disable=SC2086
  "$bench" adam $bad >/dev/null 2>&1 || status=$?
  [ "$status" -eq 2 ] || { echo "'$bad' gave exit $status, not a usage error"; exit 1; }
done
# A count is said to be no count (it was "not a size", of --runs).
status=0
out=$("$bench" adam --runs -1 2>&1) || status=$?
[[ $status -eq 2 && $out == *"--runs -1: '-1' is not a count"* ]] ||
  { echo "--runs -1 gave exit $status: $out"; exit 1; }
echo "adam_bench_test: ok"
