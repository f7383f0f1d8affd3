#!/usr/bin/env bash
# ztier-bench nvme as a user runs it: a missing --path is refused (never
# created), and --backend both measures io_uring and the thread pool on the
# same directory, leaving no swap file behind.
set -euo pipefail
bench=$1
dir=$(mktemp -d -p "$PWD" nvme-bench-test.XXXXXX)
trap 'rm -rf "$dir"' EXIT
# A build tree on tmpfs (memory) is refused as a drive: only that is tested.
case $(stat -f -c %T "$dir") in
  tmpfs | ramfs)
    status=0
    out=$("$bench" nvme --path "$dir" --no-fio --no-sweep --runs 1 --size 4M 2>&1) || status=$?
    [[ $status -eq 1 && $out == *"which is memory"* ]] || { echo "tmpfs gave $status: $out"; exit 1; }
    echo "nvme_bench_test: ok (the build tree is on tmpfs: only its refusal is tested)"
    exit 0
    ;;
esac
if out=$("$bench" nvme --path "$dir/missing" --no-fio --no-sweep --runs 1 --size 4M 2>&1); then
  echo "a missing --path was accepted: $out"; exit 1
fi
[[ $out == *"not an existing directory"* ]] || { echo "unclear error: $out"; exit 1; }
[ ! -e "$dir/missing" ] || { echo "the missing --path was created"; exit 1; }
# A file where the default --path goes: said so (it was said to be a --path
# not given that did not exist).
if out=$(cd "$dir" && touch ztier-bench-swap &&
         "$bench" nvme --no-fio --no-sweep --runs 1 --size 4M 2>&1); then
  echo "a file as the default --path was accepted: $out"; exit 1
fi
[[ $out == *"the default --path ./ztier-bench-swap is not a directory"* ]] ||
  { echo "unclear error: $out"; exit 1; }
rm -f "$dir/ztier-bench-swap"
json=$("$bench" nvme --path "$dir" --backend both --no-fio --no-sweep --runs 1 --size 8M \
  --stripe 256K --json | tail -n 1)
for name in '"backend":"io_uring"' '"backend":"threads"'; do
  [[ $json == *"$name"* ]] || { echo "no $name result: $json"; exit 1; }
done
leftovers=$(find "$dir" -type f)
[ -z "$leftovers" ] || { echo "files left behind: $leftovers"; exit 1; }
# A path whose name is not UTF-8 comes out as U+FFFD in the JSON (its byte
# went through, and the output was no JSON a parser takes).
bad="$dir/bad"$'\xff'"dir"
mkdir "$bad"
"$bench" nvme --path "$bad" --no-fio --no-sweep --runs 1 --size 4M --json | tail -n 1 >"$dir/bad.json"
python3 -c 'import json, sys; p = json.loads(open(sys.argv[1], "rb").read().decode("utf-8"))["paths"][0]; assert p.endswith("bad\ufffddir"), p' "$dir/bad.json" ||
  { echo "the JSON of a path that is not UTF-8 is not JSON"; exit 1; }
rm -rf "$bad" "$dir/bad.json"
# Sizes are checked before anything is allocated: a stripe that made the
# stripe unit wrap to 0 divided by it (SIGFPE); sizes past this machine's
# memory are said up front instead of the OOM killer ending the run, and
# sizes past the drive's free space before a swap file fills it.
status=0
"$bench" nvme --stripe 9223372036854775808 --path "$dir" --path "$dir" >/dev/null 2>&1 || status=$?
[ "$status" -eq 2 ] || { echo "a 2^63 --stripe gave exit $status, not a usage error"; exit 1; }
status=0
out=$("$bench" nvme --path "$dir" --size 18446744073709551615 --no-fio --no-sweep 2>&1) || status=$?
[[ $status -eq 2 && $out == *"--size"* ]] || { echo "a 2^64-1 --size gave exit $status: $out"; exit 1; }
[ -z "$(find "$dir" -type f)" ] || { echo "a 2^64-1 --size left files"; exit 1; }
status=0
out=$("$bench" nvme --path "$dir" --size 1.5K 2>&1) || status=$?
[[ $status -eq 2 && $out == *"--size 1.5K: '1.5K' is not a size"* ]] ||
  { echo "--size 1.5K gave exit $status without saying why: $out"; exit 1; }
status=0
out=$("$bench" nvme --path "$dir" --size 1048576G --no-fio 2>&1) || status=$?
[[ $status -eq 1 && $out == *"bytes on the filesystem of $dir, which has"* ]] ||
  { echo "--size 1048576G gave exit $status: $out"; exit 1; }
[ -z "$(find "$dir" -type f)" ] || { echo "--size 1048576G left files"; exit 1; }
status=0
out=$("$bench" nvme --path "$dir" --size 1G --stripe 1G --no-fio 2>&1) || status=$?
[[ $status -eq 2 && $out == *"bytes of memory; this machine has"* ]] ||
  { echo "--stripe 1G --size 1G gave exit $status: $out"; exit 1; }
status=0
out=$("$bench" adam --params 1048576G --runs 1 2>&1) || status=$?
[[ $status -eq 1 && $out == *"bytes of memory; this machine has"* ]] ||
  { echo "adam --params 1048576G gave exit $status: $out"; exit 1; }
# fio's comparison: a path with a colon (fio split its filename there and
# wrote beside it), and a fio that fails says why while ztier's figures
# stand (the run ended with "fio failed (cmd)" and exit 1, its figures lost).
mkdir -p "$dir/fake" "$dir/a:b"
printf '#!/bin/sh\n[ "$1" = --version ] && exit 0\necho "fio: no such engine" >&2\nexit 1\n' \
  > "$dir/fake/fio"
chmod +x "$dir/fake/fio"
json=$(PATH="$dir/fake:$PATH" "$bench" nvme --path "$dir/a:b" --no-sweep --runs 1 --size 4M \
  --json 2>"$dir/err" | tail -n 1)
[[ $json == *'"fio_error":"fio --rw=write failed (exit code 1): fio: no such engine"'* &&
   $json == *'"read_bytes_per_s":'[0-9]* ]] || { echo "a failing fio: $json $(cat "$dir/err")"; exit 1; }
rm -rf "$dir/fake" "$dir/err"
# A SIGTERM while fio ran ended the bench at once and left fio writing its
# file in the user's drive directory. The stop now goes on to fio, which is
# waited for; the bench exits 143 and removes what it and fio made.
mkdir -p "$dir/fake"
printf '#!/bin/sh\n[ "$1" = --version ] && exit 0\ntouch "%s/a:b/ztier-bench.fio" "%s/fio-ran"\nexec sleep 37.25\n' \
  "$dir" "$dir" > "$dir/fake/fio"
chmod +x "$dir/fake/fio"
PATH="$dir/fake:$PATH" "$bench" nvme --path "$dir/a:b" --no-sweep --runs 1 --size 4M \
  >"$dir/term.txt" 2>&1 &
b=$!
for _ in $(seq 300); do [ -e "$dir/fio-ran" ] && break; sleep 0.1; done
kill -TERM "$b"
status=0
wait "$b" || status=$?
[ "$status" -eq 143 ] || { echo "a SIGTERM'd bench exited $status"; cat "$dir/term.txt"; exit 1; }
if pgrep -f "sleep 37.25" >/dev/null; then
  echo "fio runs on after the bench was stopped"; pkill -f "sleep 37.25"; exit 1
fi
grep -q "stopped by" "$dir/term.txt" || { echo "no word of the stop: $(cat "$dir/term.txt")"; exit 1; }
rm -rf "$dir/fake" "$dir/fio-ran" "$dir/term.txt"
if command -v fio >/dev/null; then
  json=$("$bench" nvme --path "$dir/a:b" --no-sweep --runs 1 --size 4M --json | tail -n 1)
  [[ $json == *'"fio_error":null'* && $json == *'"fio_read_bytes_per_s":'[0-9]* ]] ||
    { echo "fio on a path with a colon: $json"; exit 1; }
fi
[ -z "$(find "$dir" -type f)" ] || { echo "files left behind: $(find "$dir" -type f)"; exit 1; }
# The default directory (./ztier-bench-swap) is made for the run and goes
# with it (an empty one was left behind); a TMPDIR that is not there is no
# matter (fio's job file went there, and the run aborted on it).
mkdir -p "$dir/cwd"
(cd "$dir/cwd" && TMPDIR="$dir/none" "$bench" nvme --no-sweep --runs 1 --size 4M >/dev/null) ||
  { echo "a run with the default path and a missing TMPDIR failed"; exit 1; }
[ -z "$(ls -A "$dir/cwd")" ] || { echo "left in the working directory: $(ls -A "$dir/cwd")"; exit 1; }
# A path on tmpfs is memory: refused, rather than its figures given as a
# drive's.
if [ "$(stat -f -c %T /dev/shm 2>/dev/null)" = tmpfs ]; then
  shm=$(mktemp -d -p /dev/shm nvme-bench-test.XXXXXX)
  status=0
  out=$("$bench" nvme --path "$shm" --no-fio --no-sweep --runs 1 --size 4M 2>&1) || status=$?
  rm -rf "$shm"
  [[ $status -eq 1 && $out == *"is on tmpfs, which is memory"* ]] ||
    { echo "a path on tmpfs gave exit $status: $out"; exit 1; }
fi
echo "nvme_bench_test: ok"
