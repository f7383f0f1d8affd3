#!/usr/bin/env bash
# ztier-bench daemon as a user runs it: both steps and the round trip are
# measured and reported with their ratio, and bad options are usage errors.
set -euo pipefail
bench=$1
json=$("$bench" daemon --units 4 --unit-params 64K --steps 3 --rounds 200 --json | tail -n 1)
for key in '"embedded_step_ms":' '"daemon_step_ms":' '"rtt_p50_us":' '"rtt_p99_us":' '"ratio":'; do
  [[ $json == *"$key"* ]] || { echo "no $key in: $json"; exit 1; }
done
status=0
"$bench" daemon --steps 1 >/dev/null 2>&1 || status=$?
[ "$status" -eq 2 ] || { echo "--steps 1 gave exit $status, not a usage error"; exit 1; }
echo "daemon_bench_test: ok"
