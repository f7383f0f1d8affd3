#!/usr/bin/env bash
# ztier-bench nvme as a user runs it: a missing --path is refused (never
# created), and --backend both measures io_uring and the thread pool on the
# same directory, leaving no swap file behind.
set -euo pipefail
bench=$1
dir=$(mktemp -d -p "$PWD" nvme-bench-test.XXXXXX)
trap 'rm -rf "$dir"' EXIT
if out=$("$bench" nvme --path "$dir/missing" --no-fio --no-sweep --runs 1 --size 4M 2>&1); then
  echo "a missing --path was accepted: $out"; exit 1
fi
[[ $out == *"not an existing directory"* ]] || { echo "unclear error: $out"; exit 1; }
[ ! -e "$dir/missing" ] || { echo "the missing --path was created"; exit 1; }
json=$("$bench" nvme --path "$dir" --backend both --no-fio --no-sweep --runs 1 --size 8M \
  --stripe 256K --json | tail -n 1)
for name in '"backend":"io_uring"' '"backend":"threads"'; do
  [[ $json == *"$name"* ]] || { echo "no $name result: $json"; exit 1; }
done
leftovers=$(find "$dir" -type f)
[ -z "$leftovers" ] || { echo "files left behind: $leftovers"; exit 1; }
echo "nvme_bench_test: ok"
