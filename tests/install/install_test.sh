#!/usr/bin/env bash
# tests/install: installs a build tree (`cmake --install BUILD --prefix TMP`)
# and uses it as a user would, without the source or build tree:
#   - the install stays under its prefix and names neither tree;
#   - the expected files are there (headers, libztier.so.0, the static
#     libraries, the CMake package, the .pc files, the programs, the units
#     with ExecStart= at the installed ztierd, the config);
#   - the installed headers are exactly the project headers that
#     <ztier/ztier.h> includes (cmake/install.cmake's list, against g++ -MM);
#   - two consumers (tests/install/consumer/: C through the C ABI, C++
#     through the C++ API) build with find_package(ztier CONFIG) and with
#     pkg-config, and each of the four programs trains a small model in an
#     embedded session and prints its "ok" line;
#   - the installed ztierd answers --version.
#
#   install_test.sh BUILD_DIR SOURCE_DIR
#
# Environment (from CTest, tests/install/CMakeLists.txt): CMAKE (the cmake
# to use), CC, CXX (the build's compilers), ZTIER_SANITIZE (the build's:
# set, the test skips with 77, since a consumer would need the sanitizer's
# flags and runtime), ZTIER_KEEP_INSTALL_TEST=1 keeps the temporary tree.
set -euo pipefail

build=${1:?usage: install_test.sh BUILD_DIR SOURCE_DIR}
source=${2:?usage: install_test.sh BUILD_DIR SOURCE_DIR}
cmake=${CMAKE:-cmake}
cc=${CC:-gcc}
cxx=${CXX:-g++}

if [[ -n ${ZTIER_SANITIZE:-} ]]; then
  echo "install_test: skipped: a ZTIER_SANITIZE=${ZTIER_SANITIZE} build (its libraries need the" \
    "sanitizer's flags and runtime in every consumer)"
  exit 77
fi

fail() {
  echo "install_test: FAIL: $*" >&2
  exit 1
}
step() { echo "== $*"; }

tmp=$(mktemp -d "${TMPDIR:-/tmp}/ztier-install-test.XXXXXX")
if [[ ${ZTIER_KEEP_INSTALL_TEST:-0} == 1 ]]; then
  echo "install_test: keeping ${tmp}"
else
  trap 'rm -rf -- "${tmp}"' EXIT
fi
prefix=${tmp}/prefix

step "cmake --install ${build} --prefix ${prefix}"
"${cmake}" --install "${build}" --prefix "${prefix}" >"${tmp}/install.log" 2>&1 ||
  { cat "${tmp}/install.log" >&2; fail "cmake --install failed"; }
# Everything lands under the prefix (a relative config dir, no absolute
# destination), and nothing installed names the source or build tree.
outside=$(grep -v "^${prefix}/" "${build}/install_manifest.txt" || true)
[[ -z ${outside} ]] || fail "installed outside the prefix ${prefix}:"$'\n'"${outside}"
leaks=$(grep -rlF -e "${source}" -e "${build}" "${prefix}/include" "${prefix}"/lib* "${prefix}/etc" \
  --include='*.cmake' --include='*.pc' --include='*.h' --include='*.service' --include='*.socket' \
  --include='*.json' || true)
[[ -z ${leaks} ]] || fail "installed files name the source or build tree:"$'\n'"${leaks}"

libdir=$(dirname "$(find "${prefix}" -name 'libztier.so.0' -print -quit)")
[[ ${libdir} != . ]] || fail "no libztier.so.0 under ${prefix}"
step "layout (libdir ${libdir#"${prefix}"/})"
expect=(
  include/ztier/ztier.h include/ztier/ztier_c.h include/ztier/common/status.h
  "${libdir#"${prefix}"/}"/libztier.so "${libdir#"${prefix}"/}"/libztier_client.a
  "${libdir#"${prefix}"/}"/libztier_common.a
  "${libdir#"${prefix}"/}"/cmake/ztier/ztierConfig.cmake
  "${libdir#"${prefix}"/}"/cmake/ztier/ztierConfigVersion.cmake
  "${libdir#"${prefix}"/}"/cmake/ztier/ztierTargets.cmake
  "${libdir#"${prefix}"/}"/pkgconfig/ztier.pc "${libdir#"${prefix}"/}"/pkgconfig/ztier_c.pc
  bin/ztierd
  lib/systemd/system/ztierd.service lib/systemd/system/ztierd.socket
  lib/sysusers.d/ztier.conf lib/tmpfiles.d/ztier.conf etc/ztier/ztierd.json
)
for f in "${expect[@]}"; do
  [[ -e ${prefix}/${f} ]] || fail "missing ${prefix}/${f}"
done
# The service runs the installed ztierd with the installed config.
want="ExecStart=${prefix}/bin/ztierd --config ${prefix}/etc/ztier/ztierd.json --quota-file /var/lib/ztier/quotas.json"
grep -qxF "${want}" "${prefix}/lib/systemd/system/ztierd.service" ||
  fail "ztierd.service: no line '${want}':"$'\n'"$(grep ExecStart "${prefix}/lib/systemd/system/ztierd.service")"
version=$("${prefix}/bin/ztierd" --version) || fail "${prefix}/bin/ztierd --version failed"
echo "ztierd --version: ${version}"

step "installed headers = the project headers <ztier/ztier.h> includes"
# With only the install's include dirs: a header missing from the install
# fails here, naming it; one installed but not included is listed.
printf '#include <ztier/ztier.h>\n#include <ztier/ztier_c.h>\n' >"${tmp}/headers.cc"
"${cxx}" -std=c++20 -MM -MT x -I"${prefix}/include" -I"${prefix}/include/ztier" "${tmp}/headers.cc" \
  >"${tmp}/headers.d" 2>"${tmp}/headers.err" ||
  fail "the installed <ztier/ztier.h> does not compile with only the install's headers" \
    "(a header missing from ZTIER_INSTALLED_HEADERS in cmake/install.cmake?):"$'\n'"$(cat "${tmp}/headers.err")"
included=$(tr -s ' ' '\n' <"${tmp}/headers.d" | grep "^${prefix}/include/" | sort -u)
installed=$(find "${prefix}/include" -type f | sort)
extra=$(comm -13 <(echo "${included}") <(echo "${installed}"))
[[ -z ${extra} ]] || fail "installed but not included by <ztier/ztier.h> (drop from" \
  "ZTIER_INSTALLED_HEADERS in cmake/install.cmake):"$'\n'"${extra}"
echo "$(echo "${installed}" | wc -l) headers"

# Runs a consumer from ${tmp}/run (the engine's files stay in the test's
# tree) and checks its "ok" line.
run_consumer() {
  local name=$1 program=$2 out
  shift 2
  mkdir -p "${tmp}/run"
  out=$(cd "${tmp}/run" && env "$@" "${program}" 2>&1) || fail "${name} failed:"$'\n'"${out}"
  grep -q "^${program##*/}: ok" <<<"${out}" || fail "${name}: no ok line:"$'\n'"${out}"
  echo "${name}: $(grep "^${program##*/}: ok" <<<"${out}")"
}

step "consumers through find_package(ztier CONFIG)"
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
CC=${cc} CXX=${cxx} "${cmake}" -S "${source}/tests/install/consumer" -B "${tmp}/cmake-build" \
  "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="${prefix}" \
  >"${tmp}/consumer-configure.log" 2>&1 ||
  { cat "${tmp}/consumer-configure.log" >&2; fail "configuring the CMake consumer failed"; }
"${cmake}" --build "${tmp}/cmake-build" -j 2 >"${tmp}/consumer-build.log" 2>&1 ||
  { cat "${tmp}/consumer-build.log" >&2; fail "building the CMake consumer failed"; }
# libztier.so.0 from the install (the imported target's path), not the build.
resolved=$(ldd "${tmp}/cmake-build/c_consumer" | awk '$1 == "libztier.so.0" { print $3 }')
[[ ${resolved} == "${libdir}/libztier.so.0" ]] ||
  fail "the CMake c_consumer loads libztier.so.0 from '${resolved}', not ${libdir}"
run_consumer "c_consumer (cmake)" "${tmp}/cmake-build/c_consumer"
run_consumer "cpp_consumer (cmake)" "${tmp}/cmake-build/cpp_consumer"

step "consumers through pkg-config"
export PKG_CONFIG_PATH=${libdir}/pkgconfig
mkdir -p "${tmp}/pc-build"
# shellcheck disable=SC2046  # pkg-config's flags are words
"${cc}" -std=c11 -Wall -Wextra -Werror -o "${tmp}/pc-build/c_consumer" \
  "${source}/tests/install/consumer/c_consumer.c" $(pkg-config --cflags --libs ztier_c) -lm ||
  fail "gcc with \$(pkg-config --cflags --libs ztier_c) failed"
# shellcheck disable=SC2046
"${cxx}" -std=c++20 -O1 -Wall -Wextra -Werror -o "${tmp}/pc-build/cpp_consumer" \
  "${source}/tests/install/consumer/cpp_consumer.cc" $(pkg-config --cflags --libs ztier) ||
  fail "g++ with \$(pkg-config --cflags --libs ztier) failed"
run_consumer "c_consumer (pkg-config)" "${tmp}/pc-build/c_consumer" LD_LIBRARY_PATH="${libdir}"
run_consumer "cpp_consumer (pkg-config)" "${tmp}/pc-build/cpp_consumer"

echo "install_test: ok"
