#!/usr/bin/env bash
# Builds the Debian package ztier_<version>_amd64.deb (CPack, cmake/package.cmake)
# in its own build directory, build/package: Release, prefix /usr, CUDA off
# (so that every dependency is a Debian 12 package: the CUDA runtime and
# NCCL are not), no tests, with ztier-bench and ztier-train. Prints the
# .deb's path as its last line; tests/install/package_check.sh checks it.
# Usage: scripts/package.sh   (BUILD_DIR=... to build elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build/package}
scripts/install_deps.sh >&2
start=${SECONDS}
cmake -S . -B "${build}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=/usr \
  -DZTIER_CUDA=OFF -DZTIER_WERROR=ON -DZTIER_BUILD_TESTS=OFF \
  -DZTIER_BUILD_BENCHMARKS=ON -DZTIER_BUILD_EXAMPLES=ON >&2
cmake --build "${build}" -j "$(nproc)" >&2
rm -f "${build}"/ztier_*_amd64.deb
(cd "${build}" && cpack -G DEB) >&2
debs=("${build}"/ztier_*_amd64.deb)
if [[ ${#debs[@]} -ne 1 || ! -f ${debs[0]} ]]; then
  echo "package: expected one ${build}/ztier_*_amd64.deb, found: ${debs[*]}" >&2
  exit 1
fi
echo "package: built in $((SECONDS - start)) s" >&2
echo "${debs[0]}"
