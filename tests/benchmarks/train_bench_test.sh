#!/usr/bin/env bash
# ztier-bench train as a user runs it: a small GPT through ztier-train,
# params streamed and resident, states in DRAM and on NVMe; every run
# reports tokens/s and a step whose parts (compute and the waits) add up to
# it; bad options are usage errors, a missing ztier-train a clear failure.
set -euo pipefail
bench=$1
train=$2
dir=$(mktemp -d -p "$PWD" train-bench-test.XXXXXX)  # (its nvme runs want a drive, not /tmp's tmpfs)
trap 'rm -rf "$dir"' EXIT
# States "on NVMe" in memory (a tmpfs --dir, or TMPDIR) are refused: their
# figures were the RAM's, said as the drive's.
shm=/dev/shm
if [[ -d $shm && -w $shm && "$(stat -f -c %T "$shm")" == tmpfs ]]; then
  for how in "--dir $shm/train-bench-test.$$" "TMPDIR=$shm"; do
    status=0
    if [[ $how == TMPDIR=* ]]; then
      out=$(env "$how" "$bench" train --train "$train" --steps 3 --skip 1 2>&1) || status=$?
    else
      out=$("$bench" train --train "$train" $how --steps 3 --skip 1 2>&1) || status=$?
    fi
    [[ $status -eq 1 && $out == *"which is memory"*"or --optimizer dram"* ]] ||
      { echo "$how gave exit $status: $out"; exit 1; }
  done
  [[ ! -e "$shm/train-bench-test.$$" ]] || { echo "the refused --dir was left"; exit 1; }
fi
# (A variable's name with a quote in it: the JSON's keys are escaped too.)
json=$(env 'ZTIER_TEST_Q"UOTE=1' ZTIER_CHECKSUMS=false "$bench" train --train "$train" --layers 1 --channels 64 --heads 2 --context 16 \
  --batch 2 --steps 4 --skip 1 --dir "$dir/runs" --json | tail -n 1)
python3 - "$json" <<'PY'
import json, sys
o = json.loads(sys.argv[1])
runs = o["runs"]
# The settings the runs took from the environment are part of the figures.
assert o["environment"].get("ZTIER_CHECKSUMS") == "false", o["environment"]
assert o["environment"].get('ZTIER_TEST_Q"UOTE') == "1", o["environment"]
assert [(r["optimizer"], r["params"]) for r in runs] == [
    ("dram", "offloaded"), ("dram", "resident"), ("nvme", "offloaded"), ("nvme", "resident")], runs
for r in runs:
    assert r["tokens_per_s"] > 0, r
    parts = (r["compute_seconds"] + r["optimizer_wait_seconds"] + r["h2d_wait_seconds"]
             + r["d2h_wait_seconds"] + r["collective_wait_seconds"])
    assert abs(parts - r["step_seconds"]) <= 1e-5 + 1e-3 * r["step_seconds"], r
    assert min(r[k] for k in r if k.endswith("_wait_seconds")) >= 0, r
    assert r["h2d_bytes_per_step"] > 0 and r["d2h_bytes_per_step"] > 0, r
# A streamed unit (the block: 98 KB of bf16, over the 64 KiB threshold) is
# fetched for the forward and again for the backward.
assert runs[0]["h2d_bytes_per_step"] > runs[1]["h2d_bytes_per_step"], runs
print("runs:", [(r["optimizer"], r["params"], round(r["tokens_per_s"])) for r in runs])
PY
# The --dir it made goes with its runs' files (their summaries and logs,
# and the directory, were left behind).
[ ! -e "$dir/runs" ] || { echo "left behind: $(find "$dir/runs")"; exit 1; }
status=0
"$bench" train --steps 3 --skip 3 >/dev/null 2>&1 || status=$?
[ "$status" -eq 2 ] || { echo "--skip 3 of --steps 3 gave exit $status, not a usage error"; exit 1; }
status=0
out=$("$bench" train --heads 3 --channels 100 --steps 3 --skip 1 2>&1) || status=$?
[[ $status -eq 2 && $out == *"--heads 3 must divide --channels 100"* ]] ||
  { echo "heads that do not divide channels gave exit $status: $out"; exit 1; }
status=0
out=$("$bench" train --train "$dir/no-such-program" 2>&1) || status=$?
[ "$status" -eq 1 ] && [[ $out == *"no-such-program"* ]] ||
  { echo "a missing ztier-train gave exit $status: $out"; exit 1; }
# A --dir on a read-only filesystem: said so at the start (it was said as
# ztier-train failing to start). Where a read-only bind mount can be made.
mkdir "$dir/ro"
if mount --bind "$dir/ro" "$dir/ro" 2>/dev/null; then
  if mount -o remount,bind,ro "$dir/ro" 2>/dev/null; then
    status=0
    out=$("$bench" train --train "$train" --dir "$dir/ro" 2>&1) || status=$?
    [[ $status -eq 1 && $out == *"--dir $dir/ro cannot be written: Read-only file system"* &&
      $out != *"starting"* ]] || { umount "$dir/ro"; echo "a read-only --dir gave exit $status: $out"; exit 1; }
  fi
  umount "$dir/ro"
fi
# A name without a slash is found as a shell finds a command, in PATH (the
# check looked in the working directory, and the run then searched PATH):
# a name PATH lacks is refused even with a file of that name here, and a
# directory is not a program.
mkdir -p "$dir/bin" "$dir/cwd"
ln -s "$(realpath "$train")" "$dir/bin/my-train"
cp /bin/true "$dir/cwd/only-here"
out=$(cd "$dir/cwd" && PATH="$dir/bin:$PATH" "$bench" train --train my-train --layers 1 \
  --channels 64 --heads 2 --context 16 --batch 2 --steps 2 --skip 1 --optimizer dram \
  --dir "$dir/runs2" 2>&1) || { echo "--train NAME in PATH failed: $out"; exit 1; }
status=0
out=$(cd "$dir/cwd" && "$bench" train --train only-here 2>&1) || status=$?
[[ $status -eq 1 && $out == *"no executable of that name in PATH"* ]] ||
  { echo "--train NAME not in PATH gave exit $status: $out"; exit 1; }
status=0
out=$("$bench" train --train "$dir/bin" 2>&1) || status=$?
[[ $status -eq 1 && $out == *"not an executable file"* ]] ||
  { echo "--train DIRECTORY gave exit $status: $out"; exit 1; }
# A SIGTERM to the bench (a scheduler's, a CI's) left its ztier-train
# training on under init, and its scratch directory behind. The run now stops
# with it (signal passed on), the bench exits 143 and removes what it made.
mkdir "$dir/tmp"
TMPDIR="$dir/tmp" "$bench" train --train "$train" --layers 1 --channels 64 --heads 2 \
  --context 16 --batch 2 --steps 100000 --skip 1 --optimizer dram >"$dir/term.txt" 2>&1 &
b=$!
for _ in $(seq 300); do
  compgen -G "$dir/tmp/ztier-bench-train.*/*.log" >/dev/null && break
  sleep 0.1
done
sleep 1
kill -TERM "$b"
status=0
wait "$b" || status=$?
[ "$status" -eq 143 ] || { echo "a SIGTERM'd bench exited $status"; cat "$dir/term.txt"; exit 1; }
if pgrep -f -- "--out $dir/tmp/" >/dev/null; then
  echo "ztier-train runs on after the bench was stopped"; pkill -f -- "--out $dir/tmp/"; exit 1
fi
left=$(ls -A "$dir/tmp")
[ -z "$left" ] || { echo "the bench left $left in TMPDIR"; exit 1; }
echo "train_bench_test: ok"
