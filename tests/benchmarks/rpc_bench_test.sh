#!/usr/bin/env bash
# ztier-bench rpc as a user runs it: both round trips are measured and
# reported with their ratio, and bad options are usage errors.
set -euo pipefail
bench=$1
json=$("$bench" rpc --rounds 2000 --json | tail -n 1)
for key in '"bare_p50_us":' '"rpc_p50_us":' '"rpc_p99_us":' '"ratio":'; do
  [[ $json == *"$key"* ]] || { echo "no $key in: $json"; exit 1; }
done
# The rounds the JSON gives are those the text gives, and that ran.
out=$("$bench" rpc --rounds 2001 --json)
[[ $out == *"2000 round trips each"* && $(echo "$out" | tail -n 1) == *'"rounds":2000,'* ]] ||
  { echo "--rounds 2001: text and JSON disagree: $out"; exit 1; }
status=0
"$bench" rpc --rounds 5 >/dev/null 2>&1 || status=$?
[ "$status" -eq 2 ] || { echo "--rounds 5 gave exit $status, not a usage error"; exit 1; }
echo "rpc_bench_test: ok"
