#!/usr/bin/env bash
# deploy/install.sh: installs ztierd as a systemd service: the binary, the
# units (ztierd.socket, ztierd.service), the sysusers.d and tmpfiles.d
# entries and, once, the default config /etc/ztier/ztierd.json (an existing
# config is never overwritten). Idempotent: running it again gives the same
# files.
#
#   deploy/install.sh [--prefix /usr/local] [--destdir DIR] [--binary PATH]
#
# With --destdir (a staging root, for packages and tests) it only writes
# files under DIR. Without it, on a host where systemd runs, it then creates
# the user and /run/ztier and reloads systemd; enabling is left to the admin.
set -euo pipefail

script_dir=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
repo_root=$(cd -- "${script_dir}/.." && pwd)

prefix=/usr/local
destdir=
binary=${repo_root}/build/release/engine/ztierd
ctl_binary=${repo_root}/build/release/client/ztierctl

usage() {
  cat <<EOF
usage: $0 [--prefix DIR] [--destdir DIR] [--binary PATH] [--ctl-binary PATH]

  --prefix DIR    where the binary goes: DIR/bin/ztierd (default /usr/local)
  --destdir DIR   staging root: every file goes under DIR, nothing is run
                  (default: none, install on this host)
  --binary PATH   the ztierd to install (default build/release/engine/ztierd)
  --ctl-binary PATH  the ztierctl to install beside it (default
                  build/release/client/ztierctl; skipped with a note when absent)
EOF
}

die() {
  echo "install.sh: $*" >&2
  exit 2
}

while (($# > 0)); do
  case $1 in
    --prefix | --destdir | --binary | --ctl-binary)
      (($# >= 2)) || die "$1 needs a value"
      opt=$1 val=$2
      shift 2
      ;;
    --prefix=* | --destdir=* | --binary=* | --ctl-binary=*)
      opt=${1%%=*} val=${1#*=}
      shift
      ;;
    -h | --help)
      usage
      exit 0
      ;;
    *)
      usage >&2
      die "unknown argument '$1'"
      ;;
  esac
  case ${opt} in
    --prefix) prefix=${val} ;;
    --destdir) destdir=${val} ;;
    --binary) binary=${val} ;;
    --ctl-binary) ctl_binary=${val} ;;
  esac
done

# The prefix ends up in ExecStart=: an absolute path of plain characters
# (no spaces, quotes or '%', which systemd would read as specifiers).
[[ ${prefix} =~ ^/[A-Za-z0-9._/+-]*$ ]] ||
  die "--prefix '${prefix}': not an absolute path of letters, digits and ._/+-"
prefix=${prefix%/}
[[ -n ${prefix} ]] || prefix=/
if [[ -n ${destdir} ]]; then
  [[ ${destdir} == /* ]] || destdir=${PWD}/${destdir}
  destdir=${destdir%/}
fi
[[ -n ${destdir} || ${EUID} -eq 0 ]] ||
  die "installing on this host needs root (or stage the files with --destdir DIR)"
[[ -f ${binary} && -x ${binary} ]] ||
  die "--binary '${binary}': no such executable (build it: cmake --build build/release --target ztierd)"

bin_path=${prefix%/}/bin/ztierd
unit_dir=${destdir}/etc/systemd/system
config=${destdir}/etc/ztier/ztierd.json

# Writes stdin to $1 with mode $2, through a temporary file in the same
# directory (a running ztierd or systemd never sees a half-written file).
put() {
  local dest=$1 mode=$2 tmp
  mkdir -p -- "$(dirname -- "${dest}")"
  tmp=$(mktemp "${dest}.XXXXXX")
  cat >"${tmp}"
  chmod "${mode}" "${tmp}"
  mv -f -- "${tmp}" "${dest}"
}

echo "installing ztierd to ${destdir}${bin_path}"
put "${destdir}${bin_path}" 0755 <"${binary}"
if [[ -f ${ctl_binary} && -x ${ctl_binary} ]]; then
  echo "installing ztierctl to ${destdir}${prefix%/}/bin/ztierctl"
  put "${destdir}${prefix%/}/bin/ztierctl" 0755 <"${ctl_binary}"
else
  echo "note: no ztierctl at ${ctl_binary} (cmake --build build/release --target ztierctl); not installed"
fi

for unit in ztierd.socket ztierd-metrics.socket ztierd.service; do
  text=$(<"${script_dir}/${unit}")
  # The units name /usr/local/bin/ztierd; point them at this install.
  text=${text//\/usr\/local\/bin\/ztierd/"${bin_path}"}
  echo "installing ${unit_dir}/${unit}"
  printf '%s\n' "${text}" | put "${unit_dir}/${unit}" 0644
done

echo "installing ${destdir}/etc/sysusers.d/ztier.conf"
put "${destdir}/etc/sysusers.d/ztier.conf" 0644 <"${script_dir}/sysusers.d/ztier.conf"
echo "installing ${destdir}/etc/tmpfiles.d/ztier.conf"
put "${destdir}/etc/tmpfiles.d/ztier.conf" 0644 <"${script_dir}/tmpfiles.d/ztier.conf"

if [[ -e ${config} ]]; then
  echo "keeping ${config} (an existing config is never overwritten; the default is ${script_dir}/ztierd.json)"
else
  echo "installing ${config}"
  put "${config}" 0644 <"${script_dir}/ztierd.json"
fi

# What a host needs after the files: the user and groups, /run/ztier, and
# systemd reading the new units. `steps run` does it, `steps show` says it.
steps() {
  "$1" systemd-sysusers /etc/sysusers.d/ztier.conf
  "$1" systemd-tmpfiles --create /etc/tmpfiles.d/ztier.conf
  "$1" systemctl daemon-reload
}
run() {
  echo "running: $*"
  "$@"
}
show() {
  echo "  $*"
}

echo
if [[ -z ${destdir} && -d /run/systemd/system ]]; then
  steps run
  echo
  echo "installed. Edit /etc/ztier/ztierd.json (and ReadWritePaths= for NVMe swap"
  echo "directories: systemctl edit ztierd.service), add training users to group"
  echo "ztier, then start listening:"
  echo "  systemctl enable --now ztierd.socket"
  echo "(after an upgrade, also: systemctl restart ztierd.service)"
else
  if [[ -n ${destdir} ]]; then
    echo "staged under ${destdir}; on the target host, next:"
  else
    echo "systemd is not running here (no /run/systemd/system); on a host where it runs, next:"
  fi
  steps show
  show systemctl enable --now ztierd.socket
fi
