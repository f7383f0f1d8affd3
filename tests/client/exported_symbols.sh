#!/usr/bin/env bash
# libztier.so exports its C ABI and nothing else (client/libztier.map).
set -euo pipefail
lib=$1
syms=$(nm -D --defined-only "$lib" | awk '$2 != "A" {print $3}')
[ -n "$syms" ] || { echo "no symbols exported from $lib"; exit 1; }
bad=$(echo "$syms" | grep -v '^ztier_' || true)
if [ -n "$bad" ]; then
  echo "libztier exports symbols outside its C ABI:"; echo "$bad" | head -20; exit 1
fi
echo "$(echo "$syms" | wc -l) ztier_* symbols exported, nothing else"
