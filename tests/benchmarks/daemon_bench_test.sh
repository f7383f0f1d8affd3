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
# Sizes past this machine's memory are said up front (the OOM killer ended
# the run).
status=0
out=$("$bench" daemon --units 4096 --unit-params 1G 2>&1) || status=$?
[[ $status -eq 1 && $out == *"bytes of memory; this machine has"* ]] ||
  { echo "--units 4096 --unit-params 1G gave exit $status: $out"; exit 1; }
# A stop during the steps ends the run at the next one, its socket's
# directory removed (it was left in /tmp), with 128 + the signal.
before=$(ls -d /tmp/ztier-bench-daemon-* 2>/dev/null || true)
out_file=$(mktemp)
"$bench" daemon --units 4 --unit-params 64K --steps 1000000 >"$out_file" 2>&1 &
b=$!
made=""
for _ in $(seq 300); do
  made=$(comm -13 <(echo "$before") <(ls -d /tmp/ztier-bench-daemon-* 2>/dev/null || true) | head -n 1)
  [ -n "$made" ] && break
  sleep 0.1
done
[ -n "$made" ] || { kill -KILL "$b" 2>/dev/null || true; echo "the bench made no socket directory"; exit 1; }
sleep 1
kill -TERM "$b"
status=0
wait "$b" || status=$?
[ "$status" -eq 143 ] || { echo "a SIGTERM'd bench exited $status: $(cat "$out_file")"; exit 1; }
grep -q "stopped by" "$out_file" || { echo "no word of the stop: $(cat "$out_file")"; exit 1; }
rm -f "$out_file"
[ ! -e "$made" ] || { echo "$made was left behind"; exit 1; }
echo "daemon_bench_test: ok"
