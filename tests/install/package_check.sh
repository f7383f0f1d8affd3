#!/usr/bin/env bash
# Checks the Debian package that scripts/package.sh builds, without
# installing it: its control fields (dpkg-deb -I: name, version,
# architecture, maintainer, section, description, Depends with the shared
# libraries dpkg-shlibdeps found), its control files (maintainer scripts,
# conffiles, the ldconfig trigger), its file list (dpkg-deb -c: programs,
# libztier.so.0, headers, static libraries, CMake and pkg-config files,
# systemd units, sysusers.d / tmpfiles.d, the config; nothing outside /usr
# and /etc), then its contents unpacked (dpkg -x): paths in the units and
# the .pc files, no RPATH into a build tree, and the unpacked ztierd
# --version and ztierctl --help run. Every missing file is named.
#
#   tests/install/package_check.sh [DEB]   (default: build/package/ztier_*_amd64.deb)
set -euo pipefail
cd "$(dirname "$0")/../.."

if (($# > 0)); then
  deb=$1
else
  debs=(build/package/ztier_*_amd64.deb)
  deb=${debs[0]}
fi
[[ -f ${deb} ]] || {
  echo "package_check: no package '${deb}' (scripts/package.sh builds it)" >&2
  exit 1
}

errors=()
error() { errors+=("$*"); }
finish() {
  if ((${#errors[@]} > 0)); then
    echo "package_check: FAIL: ${deb}:" >&2
    printf '  %s\n' "${errors[@]}" >&2
    exit 1
  fi
}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/ztier-package-check.XXXXXX")
trap 'rm -rf -- "${tmp}"' EXIT
multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch)
libdir=/usr/lib/${multiarch}

echo "== dpkg-deb -I ${deb}"
dpkg-deb -I "${deb}" | tee "${tmp}/info"
field() { dpkg-deb -f "${deb}" "$1"; }
[[ $(field Package) == ztier ]] || error "Package: '$(field Package)', not ztier"
[[ $(field Architecture) == amd64 ]] || error "Architecture: '$(field Architecture)', not amd64"
version=$(field Version)
[[ $(basename "${deb}") == "ztier_${version}_amd64.deb" ]] ||
  error "file name $(basename "${deb}"), not ztier_${version}_amd64.deb"
for f in Maintainer Section Description; do
  [[ -n $(field "${f}") ]] || error "no ${f} field"
done
depends=$(field Depends)
# Shared libraries of the programs and libztier.so (dpkg-shlibdeps), and the
# accounts' creator of postinst.
for dep in libc6 libstdc++6 libgcc-s1 liburing2 libtbb12 libhwloc15 libhwy1 \
  "adduser | systemd-sysusers"; do
  [[ ", ${depends}," == *", ${dep}"[\ ,]* ]] || error "Depends lacks '${dep}': ${depends}"
done

dpkg-deb -e "${deb}" "${tmp}/control"
for f in postinst prerm postrm conffiles triggers shlibs; do
  [[ -f ${tmp}/control/${f} ]] || error "no control file ${f}"
done
for f in postinst prerm postrm; do
  [[ ! -f ${tmp}/control/${f} || -x ${tmp}/control/${f} ]] || error "control file ${f} is not executable"
done
grep -qxF /etc/ztier/ztierd.json "${tmp}/control/conffiles" 2>/dev/null ||
  error "conffiles does not list /etc/ztier/ztierd.json"
grep -qx "activate-noawait ldconfig" "${tmp}/control/triggers" 2>/dev/null ||
  error "triggers does not activate ldconfig"

echo "== dpkg-deb -c ${deb}"
dpkg-deb -c "${deb}" | awk '{ print $6 }' | sed 's|^\./|/|; s|/$||' | sort >"${tmp}/files"
wc -l <"${tmp}/files" | xargs echo "entries:"
expect=(
  /usr/bin/ztierd /usr/bin/ztierctl /usr/bin/ztier-bench /usr/bin/ztier-train
  "${libdir}/libztier.so.${version}" "${libdir}/libztier.so.0" "${libdir}/libztier.so"
  "${libdir}"/libztier_{client,engine,wire,state_files,nvme,cpu_adam,common}.a
  "${libdir}"/cmake/ztier/ztier{Config,ConfigVersion,Targets}.cmake
  "${libdir}"/pkgconfig/ztier{,_c}.pc
  /usr/include/ztier/ztier.h /usr/include/ztier/ztier_c.h /usr/include/ztier/common/status.h
  /usr/include/ztier/engine/engine.h
  /usr/lib/systemd/system/ztierd.service /usr/lib/systemd/system/ztierd.socket
  /usr/lib/sysusers.d/ztier.conf /usr/lib/tmpfiles.d/ztier.conf
  /etc/ztier/ztierd.json
)
if [[ -f deploy/ztierd-metrics.socket ]]; then
  expect+=(/usr/lib/systemd/system/ztierd-metrics.socket)
fi
for f in "${expect[@]}"; do
  grep -qxF "${f}" "${tmp}/files" || error "missing ${f}"
done
outside=$(grep -Ev '^(/|/usr|/usr/.*|/etc|/etc/.*)$' "${tmp}/files" || true)
[[ -z ${outside} ]] || error "files outside /usr and /etc: ${outside//$'\n'/ }"

echo "== dpkg -x ${deb}"
root=${tmp}/root
dpkg -x "${deb}" "${root}"
unit=${root}/usr/lib/systemd/system/ztierd.service
if [[ -f ${unit} ]]; then
  grep -qxF "ExecStart=/usr/bin/ztierd --config /etc/ztier/ztierd.json --quota-file /var/lib/ztier/quotas.json" "${unit}" ||
    error "ztierd.service: $(grep '^ExecStart=' "${unit}"), not /usr/bin/ztierd with /etc/ztier/ztierd.json"
fi
for pc in ztier ztier_c; do
  f=${root}${libdir}/pkgconfig/${pc}.pc
  [[ ! -f ${f} ]] || grep -qx "prefix=/usr" "${f}" || error "${pc}.pc: $(grep '^prefix=' "${f}"), not /usr"
done
for f in "${root}"/usr/bin/* "${root}${libdir}"/libztier.so.*; do
  [[ -f ${f} && ! -L ${f} ]] || continue
  if readelf -d "${f}" | grep -qE '\((RPATH|RUNPATH)\)'; then
    error "${f#"${root}"} has an RPATH: $(readelf -d "${f}" | grep -E 'RPATH|RUNPATH')"
  fi
done
run() {
  local name=$1 out
  shift
  if [[ ! -x ${root}/usr/bin/${name} ]]; then
    return  # named above as missing
  fi
  if out=$(LD_LIBRARY_PATH=${root}${libdir} "${root}/usr/bin/${name}" "$@" 2>&1); then
    echo "${name} $*: $(head -n 1 <<<"${out}")"
  else
    error "${name} $* failed: ${out}"
    return
  fi
  if [[ ${name} == ztierd ]]; then
    [[ ${out} == "ztierd ${version}"* ]] || error "ztierd --version: '${out}', not ztierd ${version}"
  fi
}
run ztierd --version
run ztierctl --help

finish
echo "package_check: ok: ${deb} (Depends: ${depends})"
