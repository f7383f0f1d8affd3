#!/usr/bin/env bash
# Installs everything ztier needs to build, test and benchmark on a fresh
# Debian 12 machine (apt-get). Idempotent: packages already present are not
# touched, and apt is only called when something is missing.
#
# The CUDA toolkit and NCCL are not Debian 12 packages: ztier builds its CUDA
# code when the standard install (/usr/local/cuda, nvcc) is present and skips
# it otherwise (ZTIER_CUDA=AUTO).
set -euo pipefail

packages=(
  build-essential cmake pkg-config git   # toolchain
  libgtest-dev libgmock-dev              # tests
  liburing-dev                           # nvme/ io_uring swap space
  libtbb-dev                             # cpu_adam/ task arenas
  libhwy-dev                             # cpu_adam/ SIMD (Highway)
  libhwloc-dev                           # NUMA topology
  nlohmann-json3-dev                     # engine/ config files
  fio                                    # ztier-bench nvme reference
  strace                                 # durability test: the system calls of a checkpoint
  systemd                                # deploy test: systemd-analyze, systemd-socket-activate
  dpkg-dev                               # scripts/package.sh: dpkg-shlibdeps (also in build-essential)
  clang libclang-rt-14-dev               # libFuzzer targets (scripts/fuzz.sh)
  fortunes                               # English text corpus for ztier-train (fortunes data files)
  python3-dev python3-venv               # the Python package (scripts/python_env.sh)
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "install_deps: all ${#packages[@]} packages present"
  exit 0
fi

sudo=()
if [[ $(id -u) -ne 0 ]]; then sudo=(sudo); fi
echo "install_deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
