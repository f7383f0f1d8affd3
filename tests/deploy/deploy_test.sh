#!/usr/bin/env bash
# tests/deploy/deploy_test.sh: checks the systemd deployment in deploy/
# without systemd running as PID 1:
#   a. install.sh into a staging root: idempotent, the prefix substituted
#      into ExecStart=, an admin's edited config kept;
#   b. `systemd-analyze verify` of the installed units finds nothing (and
#      does catch a planted typo);
#   c. `systemd-analyze security --offline=yes` rates the service <= 2.0;
#   d. the installed ztierd under systemd-socket-activate, notifying a
#      datagram socket this test owns: READY=1, STATUS=, WATCHDOG=1 at half
#      of WATCHDOG_USEC, clients served on the passed socket, STOPPING=1 and
#      exit 0 on SIGTERM.
#
#   deploy_test.sh ZTIERD_BINARY SOURCE_DIR
#
# Exit codes: 0 passed, 1 failed (the message says what), 77 skipped (no
# systemd-analyze or systemd-socket-activate on this machine).
set -euo pipefail

if (($# != 2)); then
  echo "usage: $0 ZTIERD_BINARY SOURCE_DIR" >&2
  exit 2
fi
ztierd=$1
source_dir=$2

for tool in systemd-analyze systemd-socket-activate; do
  if ! command -v "${tool}" >/dev/null; then
    echo "SKIP: ${tool} is not installed (Debian: apt-get install systemd)"
    exit 77
  fi
done
command -v python3 >/dev/null || {
  echo "FAIL: python3 is needed (it owns the sd_notify socket)" >&2
  exit 1
}
[[ -x ${ztierd} ]] || {
  echo "FAIL: ${ztierd} is not an executable (build the ztierd target)" >&2
  exit 1
}
install_sh=${source_dir}/deploy/install.sh
[[ -f ${install_sh} ]] || {
  echo "FAIL: ${install_sh} not found (second argument: the source dir)" >&2
  exit 1
}

# AF_UNIX paths are limited to 107 bytes: keep the scratch dir short.
tmp_base=${TMPDIR:-/tmp}
((${#tmp_base} <= 60)) || tmp_base=/tmp
work=$(mktemp -d "${tmp_base}/ztier-deploy.XXXXXX")
pids=()
cleanup() {
  local pid
  # (stderr off: bash reports the killed jobs)
  {
    for pid in "${pids[@]}"; do
      kill -KILL "${pid}" || true
      wait "${pid}" || true
    done
  } 2>/dev/null
  rm -rf -- "${work}"
}
trap cleanup EXIT

# Logs shown when a check fails.
fail_logs=()
fail() {
  local f
  echo "FAIL: $*" >&2
  for f in "${fail_logs[@]}"; do
    if [[ -s ${f} ]]; then
      echo "---- ${f##*/}" >&2
      cat -- "${f}" >&2
    else
      echo "---- ${f##*/}: empty" >&2
    fi
  done
  exit 1
}
check() {
  echo "check: $*"
}

# A snapshot of a tree: every entry's type, mode, path and size, plus the
# checksum of every file (times are not part of "the same result").
snapshot() {
  (
    cd -- "$1"
    find . -printf '%y %m %p %s\n' | LC_ALL=C sort
    find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
  )
}

# ---- a. install.sh
root=${work}/root
check "install.sh --destdir stages the files"
bash "${install_sh}" --destdir "${root}" --binary "${ztierd}" >"${work}/install1.log" 2>&1 ||
  fail "install.sh failed: $(cat "${work}/install1.log")"
for f in usr/local/bin/ztierd etc/systemd/system/ztierd.socket etc/systemd/system/ztierd.service \
  etc/systemd/system/ztierd-metrics.socket \
  etc/sysusers.d/ztier.conf etc/tmpfiles.d/ztier.conf etc/ztier/ztierd.json; do
  [[ -f ${root}/${f} ]] || fail "install.sh did not install ${f}"
done
[[ -x ${root}/usr/local/bin/ztierd ]] || fail "the installed ztierd is not executable"
cmp -s "${ztierd}" "${root}/usr/local/bin/ztierd" || fail "the installed ztierd differs from ${ztierd}"
grep -qx 'ExecStart=/usr/local/bin/ztierd --config /etc/ztier/ztierd.json --quota-file /var/lib/ztier/quotas.json' \
  "${root}/etc/systemd/system/ztierd.service" ||
  fail "ExecStart= of the installed service is not /usr/local/bin/ztierd --config /etc/ztier/ztierd.json --quota-file /var/lib/ztier/quotas.json"

check "a second install.sh gives the same tree"
snapshot "${root}" >"${work}/tree1"
bash "${install_sh}" --destdir "${root}" --binary "${ztierd}" >"${work}/install2.log" 2>&1 ||
  fail "install.sh failed the second time: $(cat "${work}/install2.log")"
snapshot "${root}" >"${work}/tree2"
diff -u "${work}/tree1" "${work}/tree2" >"${work}/tree.diff" ||
  fail "the second install changed the tree: $(cat "${work}/tree.diff")"

check "install.sh keeps an edited config"
config=${root}/etc/ztier/ztierd.json
echo '// edited by the admin' >>"${config}"
cp -- "${config}" "${work}/edited.json"
bash "${install_sh}" --destdir "${root}" --binary "${ztierd}" >"${work}/install3.log" 2>&1 ||
  fail "install.sh failed the third time: $(cat "${work}/install3.log")"
cmp -s "${config}" "${work}/edited.json" || fail "install.sh overwrote the edited ${config}"
grep -q 'keeping' "${work}/install3.log" || fail "install.sh did not say it kept the config"

check "--prefix /opt/ztier puts the binary and ExecStart= there"
root_opt=${work}/root-opt
bash "${install_sh}" --prefix /opt/ztier --destdir "${root_opt}" --binary "${ztierd}" \
  >"${work}/install4.log" 2>&1 || fail "install.sh --prefix failed: $(cat "${work}/install4.log")"
[[ -x ${root_opt}/opt/ztier/bin/ztierd ]] || fail "--prefix /opt/ztier: no opt/ztier/bin/ztierd"
grep -qx 'ExecStart=/opt/ztier/bin/ztierd --config /etc/ztier/ztierd.json --quota-file /var/lib/ztier/quotas.json' \
  "${root_opt}/etc/systemd/system/ztierd.service" || fail "--prefix /opt/ztier: ExecStart= not substituted"
if grep -rq /usr/local/bin "${root_opt}/etc/systemd/system"; then
  fail "--prefix /opt/ztier: a unit still names /usr/local/bin"
fi

if command -v systemd-sysusers >/dev/null; then
  check "systemd-sysusers accepts sysusers.d/ztier.conf (dry run)"
  mkdir "${work}/sysroot"
  systemd-sysusers --root="${work}/sysroot" --dry-run "${root}/etc/sysusers.d/ztier.conf" \
    >"${work}/sysusers.log" 2>&1 || fail "systemd-sysusers: $(cat "${work}/sysusers.log")"
  grep -q "Creating user 'ztier'" "${work}/sysusers.log" ||
    fail "systemd-sysusers would not create user ztier: $(cat "${work}/sysusers.log")"
else
  echo "note: sysusers.d/ztier.conf not checked (no systemd-sysusers)"
fi
if command -v systemd-tmpfiles >/dev/null && ((EUID == 0)); then
  check "systemd-tmpfiles creates /run/ztier 0755 (in a scratch root)"
  mkdir "${work}/tmpfilesroot"
  systemd-tmpfiles --root="${work}/tmpfilesroot" --create "${root}/etc/tmpfiles.d/ztier.conf" \
    >"${work}/tmpfiles.log" 2>&1 || fail "systemd-tmpfiles: $(cat "${work}/tmpfiles.log")"
  [[ $(stat -c %a "${work}/tmpfilesroot/run/ztier") == 755 ]] ||
    fail "systemd-tmpfiles did not create run/ztier with mode 0755"
else
  echo "note: tmpfiles.d/ztier.conf not checked (needs systemd-tmpfiles and root, for its chown)"
fi

# The metrics socket listens only where the admin enabled it (any account
# on the host can read it): the service does not pull it in (Sockets=
# implies Wants=, and it listened whenever ztierd ran).
if grep -nE '^(Sockets|Wants|Requires|BindsTo|Upholds)=.*ztierd-metrics' \
  "${root}/etc/systemd/system/ztierd.service"; then
  echo "FAIL: ztierd.service pulls in ztierd-metrics.socket"
  exit 1
fi

# ---- b. systemd-analyze verify
# The units, with ExecStart= pointing at the staged binary (verify checks
# that it is executable).
verify_dir=${work}/verify
mkdir "${verify_dir}"
for unit in ztierd.socket ztierd-metrics.socket ztierd.service; do
  sed "s|/usr/local/bin/ztierd|${root}/usr/local/bin/ztierd|g" \
    "${root}/etc/systemd/system/${unit}" >"${verify_dir}/${unit}"
done
# Verifies the units in $1; prints every problem with them. Fails on a
# non-zero exit or on any line about ztierd's units: systemd 252 only warns
# (and exits 0) on an unknown key or a bad value. Lines about other units
# (the host's) are shown, not held against ours. The only tolerated line
# about ours is a missing user or group ztier, which this host may lack.
verify_units() {
  local dir=$1 out rc=0 bad lines
  out=$(systemd-analyze verify --man=no --recursive-errors=no \
    "${dir}/ztierd.socket" "${dir}/ztierd-metrics.socket" "${dir}/ztierd.service" 2>&1) || rc=$?
  bad=$(grep -E 'ztierd(-metrics)?\.(service|socket)' <<<"${out}" |
    grep -vE "(user|group) '?ztier'? .*(not found|does not exist|No such)" || true)
  if [[ -n ${out} && -z ${bad} ]]; then
    echo "  (systemd-analyze verify, about other units:)"
    mapfile -t lines <<<"${out}"
    printf '  %s\n' "${lines[@]}"
  fi
  if ((rc != 0)) || [[ -n ${bad} ]]; then
    echo "${out}"
    return 1
  fi
}
check "systemd-analyze verify finds nothing wrong with the installed units"
problems=$(verify_units "${verify_dir}") || fail "systemd-analyze verify: ${problems}"
[[ -z ${problems} ]] || echo "${problems}"

check "systemd-analyze verify catches a planted typo (WatchdogSecc=)"
typo_dir=${work}/typo
mkdir "${typo_dir}"
cp -- "${verify_dir}"/ztierd.* "${typo_dir}/"
sed -i 's/^WatchdogSec=/WatchdogSecc=/' "${typo_dir}/ztierd.service"
grep -q '^WatchdogSecc=' "${typo_dir}/ztierd.service" || fail "could not plant the typo"
if verify_units "${typo_dir}" >/dev/null; then
  fail "systemd-analyze verify passed a unit with the unknown key WatchdogSecc="
fi

# ---- c. systemd-analyze security
check "systemd-analyze security --offline=yes: overall exposure <= 2.0"
security_log=${work}/security.log
fail_logs+=("${security_log}")
systemd-analyze security --offline=yes --no-pager \
  "${root}/etc/systemd/system/ztierd.service" >"${security_log}" 2>&1 ||
  fail "systemd-analyze security failed"
exposure=$(sed -n 's/.*Overall exposure level for [^:]*: \([0-9][0-9.]*\).*/\1/p' "${security_log}")
[[ -n ${exposure} ]] || fail "no 'Overall exposure level' in the output of systemd-analyze security"
echo "  overall exposure level: ${exposure}"
awk -v e="${exposure}" 'BEGIN { exit !(e <= 2.0) }' ||
  fail "exposure ${exposure} is above 2.0: harden ztierd.service"
fail_logs=()

# ---- d. ztierd under socket activation
# One helper owns the sd_notify socket (records every assignment with a
# CLOCK_MONOTONIC time), plays the clients and reads the record.
helper_py=${work}/helper.py
cat >"${helper_py}" <<'EOF'
import re, socket, sys, time

def listen(path, log):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(0.5)
    end = time.monotonic() + 100  # the test's timeout bounds it anyway
    with open(log, "a", buffering=1) as out:
        while time.monotonic() < end:
            try:
                data = s.recv(65536)
            except socket.timeout:
                continue
            t = time.monotonic()
            for line in data.decode(errors="replace").split("\n"):
                if line:
                    out.write(f"{t:.6f} {line}\n")

def records(log):
    out = []
    with open(log) as f:
        for line in f:
            t, _, assignment = line.rstrip("\n").partition(" ")
            out.append((float(t), assignment))
    return out

def wait_for(log, pattern, after, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for t, a in records(log):
            if t >= after and re.fullmatch(pattern, a):
                return t
        time.sleep(0.05)
    return None

def connections(log, n, after, timeout):
    return wait_for(log, r"STATUS=serving: %d connections, \d+ jobs" % n, after, timeout)

def client(path, log):
    # The first connection is what makes systemd-socket-activate exec ztierd.
    first = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    first.connect(path)
    print("  connected (the connection that starts ztierd)")
    ready = wait_for(log, r"READY=1", 0, 15)
    if ready is None:
        sys.exit("no READY=1 within 15 s of the first connection")
    print("  READY=1")
    if connections(log, 1, ready - 1, 5) is None:
        sys.exit("no STATUS=serving: 1 connections: ztierd did not accept the first connection")
    print("  STATUS=serving: 1 connections")
    second = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    second.connect(path)
    print("  connected again, ztierd running")
    if connections(log, 2, ready, 5) is None:
        sys.exit("no STATUS=serving: 2 connections: ztierd did not accept the second connection")
    print("  STATUS=serving: 2 connections")
    second.close()
    first.close()

def watchdog(log, window, min_pings, max_gap):
    ready = wait_for(log, r"READY=1", 0, 1)
    if ready is None:
        sys.exit("no READY=1")
    time.sleep(max(0.0, ready + window + 0.2 - time.monotonic()))
    pings = [t for t, a in records(log) if a == "WATCHDOG=1"]
    in_window = [t for t in pings if ready - 0.1 <= t <= ready + window]
    gaps = [b - a for a, b in zip(pings, pings[1:])]
    print(f"  {len(in_window)} WATCHDOG=1 in the {window} s after READY=1, "
          f"largest gap {max(gaps, default=0):.3f} s")
    if len(in_window) < min_pings:
        sys.exit(f"{len(in_window)} WATCHDOG=1 in {window} s, expected >= {min_pings}")
    if max(gaps, default=0) >= max_gap:
        sys.exit(f"a gap of {max(gaps):.3f} s between WATCHDOG=1, the interval is {max_gap} s")

def stopping(log):
    if wait_for(log, r"STOPPING=1", 0, 3) is None:
        sys.exit("no STOPPING=1 after SIGTERM")
    print("  STOPPING=1")

cmd, args = sys.argv[1], sys.argv[2:]
if cmd == "listen":
    listen(*args)
elif cmd == "client":
    client(*args)
elif cmd == "watchdog":
    watchdog(args[0], 2.5, 3, 1.0)
elif cmd == "stopping":
    stopping(*args)
EOF

# Runs a helper command; its message (stderr) is the failure's.
helper() {
  local what=$1
  shift
  python3 "${helper_py}" "$@" 2>"${work}/helper.err" || fail "${what}: $(cat "${work}/helper.err")"
}

notify_sock=${work}/notify.sock
notify_log=${work}/notify.log
control_sock=${work}/ztierd.sock
ztierd_log=${work}/ztierd.log
: >"${notify_log}"
fail_logs+=("${notify_log}" "${ztierd_log}")

python3 "${helper_py}" listen "${notify_sock}" "${notify_log}" &
pids+=("$!")
for _ in $(seq 100); do
  [[ -S ${notify_sock} ]] && break
  sleep 0.05
done
[[ -S ${notify_sock} ]] || fail "the sd_notify listener did not bind ${notify_sock}"

# systemd-socket-activate passes only the -E variables (plus PATH, HOME...),
# like systemd's clean service environment. It execs ztierd on the first
# connection, so ztierd keeps its pid (LISTEN_PID, and no WATCHDOG_PID
# needed). The installed config (64G budget) is used, with a small budget
# and no huge pages on top, as a drop-in's Environment= would.
check "ztierd under systemd-socket-activate --seqpacket --fdname=control"
systemd-socket-activate --seqpacket --listen="${control_sock}" --fdname=control \
  -E NOTIFY_SOCKET="${notify_sock}" -E WATCHDOG_USEC=1000000 \
  -E ZTIER_DRAM_BUDGET=64M -E ZTIER_HUGE_PAGES=none \
  "${root}/usr/local/bin/ztierd" --config "${root}/etc/ztier/ztierd.json" \
  >"${ztierd_log}" 2>&1 &
ztierd_pid=$!
pids+=("${ztierd_pid}")
for _ in $(seq 200); do
  [[ -S ${control_sock} ]] && break
  kill -0 "${ztierd_pid}" 2>/dev/null || break
  sleep 0.05
done
[[ -S ${control_sock} ]] || fail "systemd-socket-activate did not create ${control_sock}"

check "a client connects; ztierd sends READY=1 and serves it and one more"
helper "socket activation" client "${control_sock}" "${notify_log}"
grep -q 'listening on the socket systemd passed' "${ztierd_log}" ||
  fail "ztierd did not say it took the socket systemd passed"
grep -Eq '^[0-9.]+ STATUS=serving: [0-9]+ connections, [0-9]+ jobs$' "${notify_log}" ||
  fail "no STATUS=serving: N connections, M jobs line"

check "WATCHDOG=1 at half of WATCHDOG_USEC=1000000 (>= 3 in 2.5 s, no gap of 1 s)"
helper "watchdog" watchdog "${notify_log}"

check "SIGTERM: STOPPING=1, exit 0 within 10 s"
kill -TERM "${ztierd_pid}"
for _ in $(seq 100); do
  kill -0 "${ztierd_pid}" 2>/dev/null || break
  sleep 0.1
done
kill -0 "${ztierd_pid}" 2>/dev/null && fail "ztierd still runs 10 s after SIGTERM"
rc=0
wait "${ztierd_pid}" || rc=$?
((rc == 0)) || fail "ztierd exited ${rc} after SIGTERM, expected 0"
helper "SIGTERM" stopping "${notify_log}"
grep -q 'ztierd: stopped' "${ztierd_log}" || fail "ztierd did not log 'stopped'"

echo "PASS: deploy (exposure ${exposure})"
