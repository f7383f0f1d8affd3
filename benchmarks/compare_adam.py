#!/usr/bin/env python3
# Compare ztier's CPU AdamW kernel with PyTorch and DeepSpeed CPU optimizers.
#
# For each (params, threads) case this script times:
#   * torch.optim.AdamW(fused=True) on CPU: one opt.step(), and opt.step()
#     followed by the bf16 publish copy (out.copy_(param)) that ztier's kernel
#     produces in the same pass;
#   * DeepSpeed's DeepSpeedCPUAdam (adamw_mode=True): the same two timings;
#   * ztier-bench adam (bf16 grads, fp32 master/m/v, bf16 output copy),
#     if the benchmark binary has been built;
# and prints a table of params/s with the ratios ztier/torch and
# ztier/deepspeed, plus ztier's fraction of its memory-bandwidth limit.
#
# Every torch and DeepSpeed case runs in a fresh subprocess so that the thread
# count (torch.set_num_threads and OMP_NUM_THREADS) really takes effect.
#
# Usage, from the repository root:
#   python3 benchmarks/compare_adam.py --install   # once: the project's .venv
#                                                  # (scripts/python_env.sh) plus
#                                                  # deepspeed, ninja, py-cpuinfo
#   python3 benchmarks/compare_adam.py             # re-executes in that venv
#   python3 benchmarks/compare_adam.py --params 16M,64M --threads 1,2 --json
#
# The ztier benchmark is expected at build/release/benchmarks/ztier-bench
# (--bench PATH to change). DeepSpeed compiles its cpu_adam op on first use,
# which needs g++ and ninja and can take a few minutes.
#
# This is a manual benchmark: it downloads DeepSpeed and is never run in CI
# (--install refuses to run when CI=true).

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VENV = REPO_ROOT / ".venv"
PYTHON_ENV_SCRIPT = REPO_ROOT / "scripts" / "python_env.sh"
DEFAULT_BENCH = REPO_ROOT / "build" / "release" / "benchmarks" / "ztier-bench"
DEFAULT_PARAMS = "16M,64M"
DEFAULT_THREADS = "1,2"

# Installed in two steps: scripts/python_env.sh makes the venv with the
# project's torch and numpy plus these; DeepSpeed is a source distribution
# whose setup.py wants torch already importable, so it is built after, without
# build isolation.
BASE_PACKAGES = ["ninja", "py-cpuinfo"]
DEEPSPEED_PACKAGES = ["deepspeed"]

SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}

# Set in the environment of a re-executed process so it never loops.
REEXEC_MARKER = "ZTIER_COMPARE_ADAM_REEXEC"

WORKER_TIMEOUT_S = 600
# The first DeepSpeed run may JIT-compile cpu_adam.
DEEPSPEED_BUILD_TIMEOUT_S = 1800

TORCH_GRAD_NOTE = (
    "torch fused AdamW needs grads of the param dtype: the bf16 grad is "
    "converted to fp32 before timing (not timed)"
)
DEEPSPEED_GRAD_NOTE = "DeepSpeedCPUAdam: fp32 param with fp32 grad"


# ---------------------------------------------------------------- parsing


def parse_count(text: str) -> int:
    """Parse '16M', '512K', '1G' or '1000000' (K/M/G are powers of 2^10)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMGkmg]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (use e.g. 16M, 512K, 1000000)")
    value = int(match.group(1)) * SUFFIXES.get(match.group(2).upper(), 1)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def parse_list(values: list[str] | None, default: str, item) -> list[int]:
    """Flatten repeatable, comma-separated options; keep order, drop repeats."""
    result: list[int] = []
    for value in values or [default]:
        for part in value.split(","):
            if part.strip():
                number = item(part)
                if number not in result:
                    result.append(number)
    return result


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def format_count(n: int) -> str:
    for suffix, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{suffix}"
    return str(n)


def format_rate(value: float | None) -> str:
    if value is None:
        return "-"
    for suffix, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{suffix}"
    return f"{value:.0f}"


def format_ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def format_seconds(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.2f} ms"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Compare ztier's CPU AdamW with torch fused AdamW and DeepSpeedCPUAdam.",
    )
    parser.add_argument("--install", action="store_true",
                        help="create the venv, install torch/deepspeed/ninja/numpy/py-cpuinfo "
                             "into it, then run inside it (refused when CI=true)")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV,
                        help=f"virtual environment to use (default: {DEFAULT_VENV.name} "
                             "at the repository root)")
    parser.add_argument("--bench", type=Path, default=DEFAULT_BENCH,
                        help="path of ztier-bench (default: build/release/benchmarks/ztier-bench)")
    parser.add_argument("--params", action="append", metavar="N[,N...]",
                        help=f"parameter counts, K/M/G = 2^10/2^20/2^30; repeatable "
                             f"(default: {DEFAULT_PARAMS})")
    parser.add_argument("--threads", action="append", metavar="T[,T...]",
                        help=f"thread counts; repeatable (default: {DEFAULT_THREADS})")
    parser.add_argument("--runs", type=positive_int, default=5,
                        help="timed steps per process; the best is reported (default: 5)")
    parser.add_argument("--repeat", type=positive_int, default=3,
                        help="fresh processes per case and implementation; the fastest is "
                             "kept, which evens out slow spells of a shared machine (default: 3)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--beta1", type=float, default=0.9)
    parser.add_argument("--beta2", type=float, default=0.999)
    parser.add_argument("--eps", type=float, default=1e-8)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--skip-torch", action="store_true", help="do not run torch fused AdamW")
    parser.add_argument("--skip-deepspeed", action="store_true", help="do not run DeepSpeedCPUAdam")
    parser.add_argument("--skip-ztier", action="store_true", help="do not run ztier-bench")
    parser.add_argument("--json", action="store_true",
                        help="also print all rows as one JSON object on the last line")
    # Internal: run one timed case in this (fresh) process and print JSON.
    parser.add_argument("--worker", choices=["torch", "deepspeed"], help=argparse.SUPPRESS)
    return parser


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- environment


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def running_in(venv: Path) -> bool:
    try:
        return Path(sys.prefix).resolve() == venv.resolve()
    except OSError:
        return False


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def reexec_in(venv: Path, argv: list[str]) -> None:
    python = venv_python(venv)
    env = dict(os.environ, **{REEXEC_MARKER: "1"})
    log(f"re-executing in {venv}")
    os.execve(str(python), [str(python), str(Path(__file__).resolve()), *argv], env)


def install(venv: Path, argv: list[str]) -> None:
    """Create the venv, install the comparison packages, re-exec inside it."""
    if in_ci():
        log("refusing --install: CI is set; this benchmark is never run in CI")
        sys.exit(2)
    python = venv_python(venv)
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    steps = [
        ["bash", str(PYTHON_ENV_SCRIPT), *BASE_PACKAGES],
        [*pip, "setuptools", "wheel"],
        [*pip, "--no-build-isolation", *DEEPSPEED_PACKAGES],
    ]
    env = dict(os.environ, ZTIER_VENV=str(venv))
    for command in steps:
        log("$ " + " ".join(command))
        result = subprocess.run(command, env=env)
        if result.returncode != 0:
            log(f"pip failed with exit code {result.returncode}")
            sys.exit(result.returncode)
    reexec_in(venv, [arg for arg in argv if arg != "--install"])


def ensure_torch(args: argparse.Namespace, argv: list[str]) -> None:
    """Make sure this interpreter can import torch, re-executing in the venv if needed."""
    if importlib.util.find_spec("torch") is not None:
        return
    if (venv_python(args.venv).exists() and not running_in(args.venv)
            and not os.environ.get(REEXEC_MARKER)):
        reexec_in(args.venv, argv)
    log("torch is not importable here and the comparison venv is not usable.\n"
        "Install it once with:\n"
        "    python3 benchmarks/compare_adam.py --install\n"
        f"(makes {args.venv} with scripts/python_env.sh, then adds deepspeed, ninja and py-cpuinfo),\n"
        "then run:\n"
        "    python3 benchmarks/compare_adam.py")
    sys.exit(2)


# ---------------------------------------------------------------- workers
# These run in a fresh subprocess per case and print one JSON line last.


def time_steps(opt, param, out, runs: int) -> dict:
    """Warm up once, then return the best step and step+copy times."""
    opt.step()
    out.copy_(param.detach())
    best_step = best_step_copy = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        opt.step()
        t1 = time.perf_counter()
        out.copy_(param.detach())
        t2 = time.perf_counter()
        best_step = min(best_step, t1 - t0)
        best_step_copy = min(best_step_copy, t2 - t0)
    return {"step_seconds": best_step, "step_copy_seconds": best_step_copy}


def run_worker(args: argparse.Namespace, n: int, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)

    param = torch.nn.Parameter(torch.empty(n, dtype=torch.float32).uniform_(-1.0, 1.0))
    grad_bf16 = (torch.randn(n) * 1e-2).to(torch.bfloat16)
    param.grad = grad_bf16.to(torch.float32)
    del grad_bf16
    out = torch.empty(n, dtype=torch.bfloat16)
    betas = (args.beta1, args.beta2)

    result = {"impl": args.worker, "params": n, "threads": threads,
              "torch_threads": torch.get_num_threads(), "torch": torch.__version__}
    if args.worker == "torch":
        opt = torch.optim.AdamW([param], lr=args.lr, betas=betas, eps=args.eps,
                                weight_decay=args.weight_decay, fused=True)
        result["note"] = TORCH_GRAD_NOTE
    else:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam([param], lr=args.lr, betas=betas, eps=args.eps,
                               weight_decay=args.weight_decay, adamw_mode=True)
        result["deepspeed"] = deepspeed.__version__
        result["note"] = DEEPSPEED_GRAD_NOTE

    result.update(time_steps(opt, param, out, args.runs))
    result["step_params_per_s"] = n / result["step_seconds"]
    result["step_copy_params_per_s"] = n / result["step_copy_seconds"]
    print(json.dumps(result), flush=True)


# ---------------------------------------------------------------- driver


def last_json_line(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line:
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                return None
            return value if isinstance(value, dict) else None
    return None


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_json(command: list[str], env: dict, timeout: int) -> tuple[dict | None, str]:
    """Run a command; return (its last-line JSON object or None, error text)."""
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout} s"
    except OSError as error:
        return None, str(error)
    data = last_json_line(proc.stdout)
    if proc.returncode != 0 or data is None:
        return None, (f"exit code {proc.returncode}\n"
                      + tail(proc.stderr + "\n" + proc.stdout))
    return data, ""


def thread_env(threads: int, **extra: str) -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    env.update(extra)
    return env


def run_python_case(args, impl: str, n: int, threads: int, runs: int,
                    timeout: int = WORKER_TIMEOUT_S) -> tuple[dict | None, str]:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", impl,
               "--params", str(n), "--threads", str(threads), "--runs", str(runs),
               "--lr", repr(args.lr), "--beta1", repr(args.beta1), "--beta2", repr(args.beta2),
               "--eps", repr(args.eps), "--weight-decay", repr(args.weight_decay)]
    extra = {"DS_ACCELERATOR": "cpu"} if impl == "deepspeed" else {}
    return run_json(command, thread_env(threads, **extra), timeout)


def probe_deepspeed(args) -> str:
    """Import DeepSpeed and build/load cpu_adam once on a tiny case; '' if usable."""
    log("deepspeed: importing and building/loading cpu_adam (first time can take minutes)...")
    start = time.perf_counter()
    data, error = run_python_case(args, "deepspeed", 1 << 10, 1, 1,
                                  timeout=DEEPSPEED_BUILD_TIMEOUT_S)
    if data is None:
        return error
    log(f"deepspeed {data.get('deepspeed')} ready in {time.perf_counter() - start:.0f} s")
    return ""


def run_ztier(bench: Path, n: int, threads: int, runs: int) -> tuple[dict | None, str]:
    # Best of as many runs as the others get (it was ztier-bench's default
    # of 5 against torch's --runs).
    command = [str(bench), "adam", "--params", str(n), "--threads", str(threads),
               "--runs", str(runs), "--json"]
    return run_json(command, thread_env(threads), WORKER_TIMEOUT_S)


def faster(best: dict | None, result: dict) -> dict:
    """Keep the faster of two results of one case (fields compared separately)."""
    if best is None:
        return result
    if "step_seconds" in result:  # torch / deepspeed worker
        merged = dict(best)
        for key in ("step", "step_copy"):
            seconds = min(best[f"{key}_seconds"], result[f"{key}_seconds"])
            merged[f"{key}_seconds"] = seconds
            merged[f"{key}_params_per_s"] = result["params"] / seconds
        return merged
    return result if result.get("seconds", float("inf")) < best.get("seconds", float("inf")) else best


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def get(result: dict | None, key: str):
    return None if result is None else result.get(key)


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    for line in [headers, ["-" * w for w in widths], *rows]:
        print("  ".join(str(cell).rjust(w) for cell, w in zip(line, widths)))


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        params = parse_list(args.params, DEFAULT_PARAMS, parse_count)
        threads = parse_list(args.threads, DEFAULT_THREADS, positive_int)
    except (argparse.ArgumentTypeError, ValueError) as error:
        parser.error(str(error))
    if args.worker:
        run_worker(args, params[0], threads[0])
        return 0
    if args.install:
        install(args.venv, argv)

    if not (args.skip_torch and args.skip_deepspeed):
        ensure_torch(args, argv)
    cores = os.cpu_count() or 1
    if max(threads) > cores:
        log(f"warning: {max(threads)} threads on {cores} cores; figures will be oversubscribed")

    ztier_error = ""
    if args.skip_ztier:
        ztier_error = "skipped"
    elif not os.access(args.bench, os.X_OK):
        ztier_error = f"{args.bench} not found (build it first)"
        log(f"ztier-bench: {ztier_error}; ztier ratios are unavailable")

    deepspeed_error = "skipped" if args.skip_deepspeed else probe_deepspeed(args)
    if deepspeed_error and not args.skip_deepspeed:
        log(f"deepspeed unavailable, continuing without it:\n{deepspeed_error}")

    runners = []
    if not args.skip_torch:
        runners.append(("torch", lambda n, t: run_python_case(args, "torch", n, t, args.runs)))
    if not deepspeed_error:
        runners.append(("deepspeed",
                        lambda n, t: run_python_case(args, "deepspeed", n, t, args.runs)))
    if not ztier_error:
        runners.append(("ztier", lambda n, t: run_ztier(args.bench, n, t, args.runs)))

    rows = []
    for n in params:
        for t in threads:
            row = {"params": n, "threads": t}
            log(f"case params={format_count(n)} threads={t}")
            # Interleave the implementations so a slow spell on the machine
            # hits them alike; keep each one's fastest process.
            for _ in range(args.repeat):
                for name, runner in runners:
                    if row.get(f"{name}_error"):
                        continue
                    result, error = runner(n, t)
                    if error:
                        log(f"  {name} failed: {error}")
                        row[f"{name}_error"] = error
                        row.pop(name, None)
                    else:
                        row[name] = faster(row.get(name), result)
            ztier_rate = get(row.get("ztier"), "params_per_s")
            row["ratio_ztier_torch"] = ratio(
                ztier_rate, get(row.get("torch"), "step_copy_params_per_s"))
            row["ratio_ztier_deepspeed"] = ratio(
                ztier_rate, get(row.get("deepspeed"), "step_copy_params_per_s"))
            rows.append(row)

    print(f"\nTimings (best of {args.runs} steps x {args.repeat} processes; "
          "step+copy = opt.step() then bf16 out.copy_(param)):")
    print_table(
        ["params", "threads", "torch step", "torch step+copy",
         "ds step", "ds step+copy", "ztier step+copy"],
        [[format_count(r["params"]), r["threads"],
          format_seconds(get(r.get("torch"), "step_seconds")),
          format_seconds(get(r.get("torch"), "step_copy_seconds")),
          format_seconds(get(r.get("deepspeed"), "step_seconds")),
          format_seconds(get(r.get("deepspeed"), "step_copy_seconds")),
          format_seconds(get(r.get("ztier"), "seconds"))] for r in rows])

    print("\nThroughput (params/s, step+copy for torch and deepspeed):")
    print_table(
        ["params", "threads", "ztier", "torch fused", "deepspeed",
         "ztier/torch", "ztier/ds", "ztier of limit"],
        [[format_count(r["params"]), r["threads"],
          format_rate(get(r.get("ztier"), "params_per_s")),
          format_rate(get(r.get("torch"), "step_copy_params_per_s")),
          format_rate(get(r.get("deepspeed"), "step_copy_params_per_s")),
          format_ratio(r["ratio_ztier_torch"]),
          format_ratio(r["ratio_ztier_deepspeed"]),
          "n/a" if get(r.get("ztier"), "ratio_to_limit") is None
          else f"{r['ztier']['ratio_to_limit']:.0%}"] for r in rows])

    print("\nNotes:")
    if not args.skip_torch:
        print(f"  - {TORCH_GRAD_NOTE}.")
    if not deepspeed_error:
        print(f"  - {DEEPSPEED_GRAD_NOTE}.")
    print("  - ztier: bf16 grads, fp32 master/m/v, bf16 output copy in the same pass.")
    if ztier_error:
        print(f"  - ztier ratios unavailable: {ztier_error}.")
    failed = sorted({name for r in rows for name in ("torch", "deepspeed", "ztier")
                     if r.get(f"{name}_error")})
    if failed:
        print(f"  - failed for some cases (reasons above, on stderr): {', '.join(failed)}.")
    if deepspeed_error and not args.skip_deepspeed:
        print(f"  - deepspeed unavailable: {deepspeed_error.splitlines()[-1]}")

    if args.json:
        print(json.dumps({
            "runs": args.runs, "repeat": args.repeat, "lr": args.lr, "betas": [args.beta1, args.beta2],
            "eps": args.eps, "weight_decay": args.weight_decay,
            "ztier_error": ztier_error or None, "deepspeed_error": deepspeed_error or None,
            "rows": rows,
        }))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
