#!/usr/bin/env bash
# The protocol version the documentation's sample outputs show ("(protocol
# N)" in ztierd --version and ztierctl status, "protocol": N in --json
# status) is the one ztierd speaks.
# Usage: protocol_in_docs.sh REPO_ROOT ZTIERD_BINARY. Exit 0, or 1 naming
# each sample of another version.
set -euo pipefail
root=$1
ztierd=$2
version=$("$ztierd" --version | sed -n 's/.*(protocol \([0-9]*\)).*/\1/p')
if [[ -z "$version" ]]; then
  echo "protocol_in_docs: '$ztierd --version' names no protocol" >&2
  exit 1
fi
bad=$(grep -rnoE '\(protocol [0-9]+\)|"protocol": [0-9]+' "$root/README.md" "$root/docs" |
  grep -vE "(protocol $version\)|\"protocol\": $version)\$" || true)
if [[ -n "$bad" ]]; then
  echo "protocol_in_docs: ztierd speaks protocol $version; these samples show another:" >&2
  echo "$bad" >&2
  exit 1
fi
