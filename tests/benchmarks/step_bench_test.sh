#!/usr/bin/env bash
# ztier-bench step as a user runs it: a step is timed to its last
# write-back, so its NVMe bytes are those io alone moves (every state read
# and written back, fp32 master, m and v). Timed to the last unit's
# publish, a step's write-backs fell into the next round's io alone: written
# bytes per step came out at 0 and efficiencies of 1.6 to 2.4.
set -euo pipefail
bench=$1
dir=$(mktemp -d -p "$PWD" step-bench-test.XXXXXX)
trap 'rm -rf "$dir"' EXIT
# A directory in memory (tmpfs) is refused as a drive (its figures, the
# RAM's, were said as the drive's); a build tree there tests only that.
shm=/dev/shm
[[ "$(stat -f -c %T "$dir")" == tmpfs ]] && shm=$dir
if [[ -d $shm && -w $shm && "$(stat -f -c %T "$shm")" == tmpfs ]]; then
  status=0
  out=$("$bench" step --path "$shm" --params 4M --unit-params 1M --steps 1 2>&1) || status=$?
  [[ $status -eq 1 && $out == *"which is memory"* ]] || { echo "tmpfs gave $status: $out"; exit 1; }
  if [[ $shm == "$dir" ]]; then
    echo "step_bench_test: ok (the build tree is on tmpfs: only its refusal is tested)"
    exit 0
  fi
fi
# More than the machine's memory is refused before anything is pinned (the
# engine warned of a budget the bench had set itself, then ran on).
status=0
out=$("$bench" step --params 1T --tier dram --steps 1 2>&1) || status=$?
[[ $status -eq 1 && $out == *"bytes of memory; this machine has"* && $out != *"DRAM budget"* ]] ||
  { echo "--params 1T gave $status: $out"; exit 1; }
for args in "--params 4M --unit-params 1M --stripe 4K --qd 1" "--params 8M --unit-params 2M"; do
  json=$("$bench" step $args --steps 2 --threads 1 --path "$dir" --json --no-timeline | tail -n 1)
  python3 - "$json" "$args" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
args = sys.argv[2]
read, written = r["nvme_read_bytes_per_step"], r["nvme_write_bytes_per_step"]
# fp32 master, m and v: 12 bytes a parameter each way.
assert read == written == r["state_bytes"] > 0, (args, read, written, r["state_bytes"])
for s in r["steps"]:
    assert 0 < s["published_seconds"] <= s["step_seconds"], (args, s)
    # (A step timed short of its write-backs moved 0 written bytes: the
    # check above. Its efficiency is the benchmark's figure, not held here:
    # other tests' I/O on the shared disk moves "io alone" by more than
    # any bound that would still catch something.)
    assert s["overlap_efficiency"] > 0, (args, s)
PY
done
# A stop between steps ends the run with 128 + the signal; the swap file
# goes, and the default directory made for the run with it (both were left).
mkdir -p "$dir/cwd"
(cd "$dir/cwd" && exec "$bench" step --params 8M --unit-params 1M --steps 1000 --threads 1 \
  --no-timeline >"$dir/out.txt" 2>&1) &
b=$!
for _ in $(seq 300); do
  [ -e "$dir/cwd/ztier-bench-swap/ztier.swap" ] && break
  kill -0 "$b" 2>/dev/null || break
  sleep 0.1
done
[ -e "$dir/cwd/ztier-bench-swap/ztier.swap" ] || { kill -KILL "$b" 2>/dev/null || true; echo "no swap file made"; exit 1; }
kill -TERM "$b"
status=0
wait "$b" || status=$?
[ "$status" -eq 143 ] || { echo "a SIGTERM'd step bench exited $status: $(cat "$dir/out.txt")"; exit 1; }
grep -q "stopped by" "$dir/out.txt" || { echo "no word of the stop: $(cat "$dir/out.txt")"; exit 1; }
[ -z "$(ls -A "$dir/cwd")" ] || { echo "left behind: $(find "$dir/cwd")"; exit 1; }
# A reader of the output gone (| head -1) stops it as a signal does: it
# was killed at its next line, leaving the swap file (13 GB by default).
rm -rf "$dir/cwd" && mkdir -p "$dir/cwd"
status=0
(cd "$dir/cwd" && "$bench" step --params 8M --unit-params 1M --steps 1000 --threads 1 \
  --no-timeline 2>"$dir/err.txt" | head -n 1 >/dev/null) || true
[ -z "$(ls -A "$dir/cwd")" ] || { echo "left behind with its reader gone: $(find "$dir/cwd"; cat "$dir/err.txt")"; exit 1; }
grep -q "stopped by" "$dir/err.txt" || { echo "no word of the stop: $(cat "$dir/err.txt")"; exit 1; }
echo "step_bench_test: ok"
