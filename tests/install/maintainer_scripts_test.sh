#!/usr/bin/env bash
# The package's maintainer scripts (deploy/debian) through dpkg's lifecycle,
# run against a scratch root (DPKG_ROOT, which deb-systemd-helper honours),
# with systemd's tools stubbed: install enables ztierd.socket; remove masks
# it (keeping its enablement); a reinstall enables it again (a remove that
# disabled it left it disabled: deb-systemd-helper's record said an admin
# had, and the socket was never started again); an admin's disable outlives
# a remove and a reinstall; purge leaves no link, mask or record. The
# metrics socket stays the admin's to enable. Needs deb-systemd-helper
# (init-system-helpers); skips (77) without it.
set -euo pipefail
cd "$(dirname "$0")/../.."
command -v deb-systemd-helper >/dev/null || { echo "no deb-systemd-helper: skipped"; exit 77; }
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
export DPKG_ROOT=$root DPKG_MAINTSCRIPT_PACKAGE=ztier DPKG_MAINTSCRIPT_NAME=postinst
mkdir -p "$root/lib/systemd/system" "$root/stubs" "$root/var/lib/ztier"
cp deploy/ztierd.service deploy/ztierd.socket deploy/ztierd-metrics.socket "$root/lib/systemd/system/"
for tool in systemd-sysusers systemctl systemd-tmpfiles deb-systemd-invoke; do
  printf '#!/bin/sh\nexit 0\n' >"$root/stubs/$tool"
  chmod +x "$root/stubs/$tool"
done
export PATH="$root/stubs:$PATH"
run() { sh "deploy/debian/$1" "${@:2}"; }
wants=$root/etc/systemd/system/sockets.target.wants
mask=$root/etc/systemd/system/ztierd.socket
fail() { echo "maintainer_scripts_test: $*" >&2; find "$root/etc" "$root/var" 2>/dev/null >&2; exit 1; }
enabled() { [[ -L $wants/ztierd.socket ]]; }
masked() { [[ -L $mask && $(readlink "$mask") == /dev/null ]]; }

run postinst configure
enabled || fail "a first install did not enable ztierd.socket"
[[ ! -e $wants/ztierd-metrics.socket ]] || fail "the metrics socket was enabled unasked"
run prerm remove
run postrm remove
masked || fail "a remove did not mask ztierd.socket"
run postinst configure  # a reinstall (the package was removed, not purged)
enabled || fail "a reinstall after a remove left ztierd.socket disabled"
masked && fail "a reinstall left ztierd.socket masked"
# An admin disables it (systemctl disable: the link goes); that stays so.
rm "$wants/ztierd.socket"
run prerm remove
run postrm remove
run postinst configure
enabled && fail "a reinstall enabled a socket its admin had disabled"
run prerm remove
run postrm remove
run postrm purge
[[ ! -e $mask && ! -L $mask ]] || fail "a purge left ztierd.socket masked"
[[ -z $(find "$root/etc/systemd" -type l 2>/dev/null) ]] || fail "a purge left links"
[[ ! -e $root/var/lib/ztier ]] || fail "a purge left /var/lib/ztier"
[[ -z $(ls -A "$root/var/lib/systemd/deb-systemd-helper-enabled" 2>/dev/null | grep -v '^$' || true) ]] ||
  fail "a purge left deb-systemd-helper's record"
echo "maintainer_scripts_test: ok"
