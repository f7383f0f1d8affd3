#!/usr/bin/env bash
# The one prepared check of ztier's GPU path, for a machine with a CUDA GPU
# that has CUDA, CMake and a Python with torch and transformers but none of
# ztier's Debian libraries and no network (the lent H200 machine), in two
# halves:
#
#   scripts/gpu_check.sh pack   here (Debian, the CUDA toolkit, .venv): a
#       release build with CUDA for sm_90, and into gpu-carry/ (git-ignored):
#       the GPU tests, ztier-train and ztier-bench, stripped; the shared
#       libraries they need that such a machine lacks (liburing, Highway,
#       hwloc, oneTBB, libudev); the Python package with ztier._C built for
#       that machine's Python (ZTIER_GPU_PYTHON, default Python 3.12).
#       And 1 MiB of the fortunes text (that machine has no corpus).
#   scripts/gpu_check.sh run    there, from the repository root with
#       gpu-carry/ carried: the GPU tests (ctest's label gpu, with gpt_cuda_test:
#       the whole GPT on cuda against the CPU, every byte value, teacher-forced),
#       ztier-bench
#       pcie, ztier-bench train (offloaded vs resident, GPT-2 small; again with
#       bf16 tensor-core matmuls), ztier-train
#       on cuda and on the host (20 steps, their losses
#       side by side in the logs), the Python suite's CUDA tests and the host suite,
#       finetune_hf.py --tiny on cuda and on the host, the throughput
#       benchmark (ztier.torch against plain torch), one summary at the end.
#       $OUT (or gpu-check-out/) gets summary.txt and logs.tgz (every
#       check's log, the runs' loss logs and JSON), made again after each
#       check; work directories go under /tmp. The checks run most
#       wanted first, each under a time limit of its own, all within
#       ZTIER_GPU_CHECK_SECONDS (default 540, inside a device call's 10
#       minutes); those the budget leaves no time for are listed as skipped.
#
# Failure: pack stops at the first error; run goes on past a failed or
# timed-out check and exits 1 if any failed or was skipped (the summary says
# which).
set -uo pipefail
cd "$(dirname "$0")/.."
carry=gpu-carry

pack() {
  set -e
  local py=${ZTIER_GPU_PYTHON:-$HOME/.pyenv/versions/3.12.1/bin/python3.12}
  [[ -x $py ]] || { echo "gpu_check: no $py for the GPU machine's Python (set ZTIER_GPU_PYTHON)" >&2; exit 2; }
  [[ -x .venv/bin/python ]] || scripts/python_env.sh >/dev/null
  scripts/install_deps.sh >/dev/null
  local nb
  nb=$(.venv/bin/python -m nanobind --cmake_dir)
  cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DZTIER_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DZTIER_WERROR=ON -DZTIER_BUILD_PYTHON=ON \
    -DPython_EXECUTABLE="$py" -Dnanobind_DIR="$nb" >/dev/null
  local tests=(gpt_cuda_test bf16_device_test cuda_device_test cuda_kernels_test
               nccl_collectives_test)
  cmake --build build/gpu -j "$(nproc)" --target "${tests[@]}" ztier-train ztier-bench _C
  rm -rf "$carry"
  mkdir -p "$carry/bin" "$carry/lib" "$carry/python/ztier"
  for t in "${tests[@]}"; do cp "build/gpu/tests/cuda/$t" "$carry/bin/"; done
  cp build/gpu/examples/ztier-train build/gpu/benchmarks/ztier-bench "$carry/bin/"
  cp build/gpu/python/ztier/_C*.so python/ztier/*.py "$carry/python/ztier/"
  strip "$carry"/bin/* "$carry"/python/ztier/_C*.so
  # The libraries those need from Debian (not CUDA's, NCCL's or libc's).
  ldd "$carry"/bin/* "$carry"/python/ztier/_C*.so | awk '/=> \//{print $3}' | sort -u |
    grep -E 'liburing|libhwy|libhwloc|libtbb|libudev|libnuma|libxml2|libicu|liblzma' |
    while read -r lib; do cp -L "$lib" "$carry/lib/"; done
  cat /usr/share/games/fortunes/fortunes /usr/share/games/fortunes/literature \
    /usr/share/games/fortunes/science 2>/dev/null | head -c 1048576 >"$carry/text.txt"
  du -sh "$carry"
  local bytes
  bytes=$(du -sb "$carry" | cut -f1)
  if ((bytes > 60 * 1024 * 1024)); then
    echo "gpu_check: $carry is $bytes bytes, over what a device call carries" >&2
    exit 1
  fi
  grep -qxF "/$carry/" .git/info/exclude 2>/dev/null || echo "/$carry/" >>.git/info/exclude
  echo "gpu_check: packed; on the GPU machine: scripts/gpu_check.sh run (carry $carry)"
}

run() {
  local out=${OUT:-gpu-check-out}
  mkdir -p "$out"
  [[ -d $carry/bin ]] || { echo "gpu_check: no $carry/ (scripts/gpu_check.sh pack makes it)" >&2; exit 2; }
  local py=${ZTIER_GPU_RUN_PYTHON:-python3}
  export LD_LIBRARY_PATH="$PWD/$carry/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
  # NCCL is not carried (too large): the system's, else the one beside torch.
  local nccl
  nccl=$("$py" -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' \
    2>/dev/null) && [[ -d $nccl ]] && LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$nccl"
  export PYTHONPATH="$PWD/$carry/python:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
  # Work directories (checkpoints, exports) stay out of $OUT, which brings
  # back 8 files at most: there go summary.txt and logs.tgz (every log and
  # every run's loss log and JSON), made again after each check, so that a
  # run cut short still brings back what it did.
  local work
  work=$(mktemp -d /tmp/ztier-gpu-check.XXXXXX)
  local logs=$work/logs
  mkdir -p "$logs"
  # The whole run fits a budget (a device call is cut at 10 minutes; what
  # is under $OUT comes back even then, but a check cut mid-way says
  # nothing): each check gets at most its own limit and what is left, and
  # the checks past the budget are listed as not run. Most wanted first.
  local budget=${ZTIER_GPU_CHECK_SECONDS:-540}
  local deadline=$((SECONDS + budget))
  local -a summary=()
  local failed=0
  save() {
    printf '%s\n' "${summary[@]}" >"$out/summary.txt"
    (cd "$work" && find . -type f \( -name '*.log' -o -name '*.json' -o -name '*.tsv' \
      -o -name '*.txt' \) -size -8M -print0 | tar czf "$out/logs.tgz.tmp" --null -T -) &&
      mv "$out/logs.tgz.tmp" "$out/logs.tgz"
  }
  # check [--strict] LIMIT_S NAME COMMAND...: runs it, logs to NAME.log,
  # notes the result. --strict: a skipped test is a failure (here a GPU
  # test that skips, "no CUDA device", ran nothing; gtest and pytest both
  # exit 0 for it).
  check() {
    local strict=0
    [[ $1 == --strict ]] && { strict=1; shift; }
    local limit=$1 name=$2
    shift 2
    local left=$((deadline - SECONDS))
    if ((left < 15)); then
      summary+=("skip  $name (the ${budget} s budget is spent)")
      failed=1
      save
      return
    fi
    ((limit > left)) && limit=$left
    local t0=$SECONDS rc=0 log=$logs/$name.log
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1 || rc=$?
    local skipped=0
    if ((strict)); then
      skipped=$(grep -cE '^\[  SKIPPED \] [A-Za-z]|^SKIPPED \[' "$log")
    fi
    if ((rc == 0 && skipped == 0)); then
      summary+=("ok    $name ($((SECONDS - t0)) s)")
    elif ((rc == 0)); then
      summary+=("FAIL  $name: $skipped test(s) skipped, so they ran nothing; see $name.log")
      failed=1
    elif ((rc == 124 || rc == 137)); then
      summary+=("FAIL  $name: cut at its ${limit} s limit; see $name.log")
      failed=1
    else
      summary+=("FAIL  $name ($((SECONDS - t0)) s, exit $rc): see $name.log")
      failed=1
    fi
    tail -n 4 "$log"
    save
  }
  nvidia-smi -L | tee "$work/gpu.txt"
  # What the carried programs cannot find here says at once why a check fails.
  ldd "$carry"/bin/* "$carry"/python/ztier/_C*.so 2>&1 | grep 'not found' | sort -u |
    tee "$work/ldd-missing.txt"
  # The whole GPT on cuda against the CPU (every byte value, teacher-forced)
  # first, then the other GPU tests. The one test that needs two GPUs may
  # skip on one: nccl_collectives_test runs a world of one there.
  check --strict 180 gpt_cuda_test "$carry/bin/gpt_cuda_test"
  # cuda_device_test's no-device case skips wherever a GPU is: left out
  # here, so that a skip anywhere else still fails the check.
  for t in "$carry"/bin/*_test; do
    case $(basename "$t") in
      gpt_cuda_test) ;;
      cuda_device_test)
        check --strict 120 cuda_device_test "$t" \
          --gtest_filter=-CudaDeviceNoGpuTest.MakeCudaDeviceIsUnavailableWithoutDevice ;;
      *) check --strict 120 "$(basename "$t")" "$t" ;;
    esac
  done
  # What offloading costs at the GPT-2-small shape: params streamed vs
  # resident, states in DRAM and on NVMe, the step split into its parts.
  check 180 train_bench "$carry/bin/ztier-bench" train --device cuda \
    --train "$carry/bin/ztier-train" --layers 12 --channels 768 --heads 12 --context 256 \
    --batch 8 --steps 16 --skip 4 --data "$carry/text.txt" --dir "$work/train-bench" --json
  check 60 pcie "$carry/bin/ztier-bench" pcie --device cuda
  local train=(--layers 4 --channels 128 --heads 4 --context 64 --batch 8 --steps 20
               --optimizer dram --overwrite --no-progress)
  check 60 train_cuda "$carry/bin/ztier-train" "${train[@]}" --data "$carry/text.txt" \
    --device cuda --out "$work/train-cuda"
  check 60 train_host "$carry/bin/ztier-train" "${train[@]}" --data "$carry/text.txt" \
    --device host --out "$work/train-host"
  # The two runs start from the same weights and batches: their first
  # losses agree to fp32 summation order; later ones drift apart by
  # rounding alone (gpt_cuda_test's teacher-forced case is the strict one).
  check 30 train_agree "$py" - "$work/train-cuda/train_log.tsv" "$work/train-host/train_log.tsv" <<'PY'
import math, sys
cuda, host = ([float(r.split("\t")[1]) for r in open(p).read().splitlines()[1:]] for p in sys.argv[1:3])
print("step  cuda     host")
for i, (c, h) in enumerate(zip(cuda, host), 1):
    print(f"{i:4d}  {c:.5f}  {h:.5f}")
assert len(cuda) == len(host) == 20, (len(cuda), len(host))
assert math.isclose(cuda[0], host[0], rel_tol=1e-3), "first losses differ"
assert math.isclose(cuda[-1], host[-1], rel_tol=0.1), "last losses differ by more than 10%"
PY
  # The same with bf16 tensor-core matmuls (states in DRAM): the example's
  # fp32 SGEMMs no longer set the pace.
  check 120 train_bench_bf16 "$carry/bin/ztier-bench" train --device cuda --matmul bf16 \
    --optimizer dram --train "$carry/bin/ztier-train" --layers 12 --channels 768 --heads 12 \
    --context 256 --batch 8 --steps 16 --skip 4 --data "$carry/text.txt" \
    --dir "$work/train-bench-bf16" --json
  check --strict 120 python_cuda "$py" -m pytest -q -rs -p no:cacheprovider tests/python/test_cuda.py
  check 90 finetune_cuda "$py" examples/finetune_hf.py --tiny --steps 60 --device cuda \
    --data "$carry/text.txt" --out "$work/ft-cuda" --json
  check 90 finetune_host "$py" examples/finetune_hf.py --tiny --steps 60 --data "$carry/text.txt" \
    --out "$work/ft-host" --json
  check 30 finetune_agree "$py" - "$logs/finetune_cuda.log" "$logs/finetune_host.log" <<'PY'
import json, math, sys
cuda, host = (json.loads(open(p).read().splitlines()[-1]) for p in sys.argv[1:3])
print(f"first loss {cuda['first_loss']:.4f} (cuda) vs {host['first_loss']:.4f} (host); "
      f"last {cuda['last_loss']:.4f} vs {host['last_loss']:.4f}; "
      f"{cuda['tokens_per_s']:,.0f} vs {host['tokens_per_s']:,.0f} tokens/s")
assert math.isclose(cuda["first_loss"], host["first_loss"], rel_tol=2e-2)
assert math.isclose(cuda["last_loss"], host["last_loss"], rel_tol=1e-1)
PY
  check 120 bench_small "$py" benchmarks/torch_offload_bench.py --device cuda --preset small \
    --batch 4 --seq 1024 --steps 5
  check 180 bench_1b "$py" benchmarks/torch_offload_bench.py --device cuda --preset 1b \
    --batch 4 --seq 1024 --steps 5
  # The host suite runs in CI already; here it checks the package built for
  # this machine's Python.
  check 240 python_host "$py" -m pytest -q -rs -p no:cacheprovider tests/python -k "not cuda"
  echo
  echo "== gpu_check summary"
  printf '%s\n' "${summary[@]}"
  save
  rm -rf "$work"
  return $failed
}

case ${1:-} in
  pack) pack ;;
  run) run ;;
  *)
    echo "usage: scripts/gpu_check.sh pack|run" >&2
    exit 2
    ;;
esac
