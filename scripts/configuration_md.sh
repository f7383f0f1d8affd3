#!/usr/bin/env bash
# Writes the settings table of docs/configuration.md: the lines between its
# two "ztierd --describe-settings" markers become what that ztierd prints
# (engine/settings.cc, DescribeSettings: one row per setting, then the
# DeepSpeed keys accepted and ignored). The prose around the markers is kept.
#
#   scripts/configuration_md.sh [ZTIERD]          rewrite the table
#   scripts/configuration_md.sh --check [ZTIERD]  exit 1, with a diff, if it differs
#
# ZTIERD defaults to build/release/engine/ztierd; build it first
# (cmake --build build/release --target ztierd). ctest runs the --check form
# (configuration_doc_test), and settings_test compares the table too.
set -euo pipefail
cd "$(dirname "$0")/.."

check=0
if [[ ${1:-} == --check ]]; then
  check=1
  shift
fi
ztierd=${1:-build/release/engine/ztierd}
doc=docs/configuration.md
begin='<!-- BEGIN ztierd --describe-settings'
end='<!-- END ztierd --describe-settings'

[[ -x ${ztierd} ]] || {
  echo "configuration_md.sh: ${ztierd}: no such program (cmake --build build/release --target ztierd)" >&2
  exit 2
}
[[ $(grep -c -- "^${begin}" "${doc}") == 1 && $(grep -c -- "^${end}" "${doc}") == 1 ]] || {
  echo "configuration_md.sh: ${doc} needs one line starting '${begin}' and one starting '${end}'" >&2
  exit 2
}

table=$(mktemp)
new=$(mktemp)
trap 'rm -f "${table}" "${new}"' EXIT
"${ztierd}" --describe-settings >"${table}"
# Everything up to the begin marker, the table, everything from the end marker.
awk -v table="${table}" -v begin="${begin}" -v end="${end}" '
  index($0, begin) == 1 { print; while ((getline line < table) > 0) print line; skip = 1; next }
  index($0, end) == 1 { skip = 0 }
  !skip { print }
' "${doc}" >"${new}"

if ((check)); then
  if ! diff -u "${doc}" "${new}"; then
    echo "configuration_md.sh: ${doc} is not what ${ztierd} --describe-settings prints;" \
      "regenerate it: scripts/configuration_md.sh ${ztierd}" >&2
    exit 1
  fi
  echo "${doc}: the settings table is current"
else
  cat "${new}" >"${doc}"
  echo "wrote the settings table of ${doc}"
fi
