#!/usr/bin/env python3
"""PNG plots of what `ztier-bench <subcommand> --json` prints.

Usage, from anywhere:
    benchmarks/plot.py INPUT.json [INPUT.json ...] --out DIR

INPUT is the output of `ztier-bench nvme|pcie|adam|step --json`: the JSON object alone, or the
whole output (the object is its last line). The kind of plot comes from the object's "bench"
field, and each plot draws the limit the benchmark measured in the same run:

    nvme  swap-space throughput against queue depth ("qd_sweep"), write and read; fio's figures
          of the same run (same block size, queue depth, size and directories) as the limit
    pcie  copy bandwidth against transfer size ("sizes"), h2d, d2h and both at once; the limit
          of each size (memcpy between the same buffers, host backend) or the pinned
          cudaMemcpyAsync peak (cuda)
    adam  AdamW bandwidth against threads (or shard size when one thread count was run); the
          same-pattern memory kernel as the limit
    step  the timeline of the traced step ("timeline": read, compute and write-back of every
          unit); I/O alone and compute alone of the same run as the limits

It prints the path of every PNG it wrote. Exit codes: 0 done; 2 for an input that is not a
ztier-bench JSON (or lacks what its plot needs), with the reason; 1 when matplotlib is missing.
matplotlib comes with the project's Python environment (scripts/python_env.sh); run from
another Python, the script re-executes itself with the repository's .venv when it has one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
VENV_PYTHON = REPO_ROOT / ".venv" / "bin" / "python"
REEXEC_MARKER = "ZTIER_PLOT_REEXEC"  # set in a re-executed process, so it never loops
KINDS = ("nvme", "pcie", "adam", "step")
DPI = 100
SIZE = (8.0, 4.8)  # inches: 800 x 480 pixels at DPI


class InputError(Exception):
    """An input that is not a ztier-bench JSON, or lacks what its plot needs."""


def load(path: Path) -> dict:
    """The ztier-bench JSON object in `path`: the whole file, or its last line."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read it: {e}") from None
    candidates = [text] + [line for line in reversed(text.splitlines()) if line.strip()][:1]
    obj = None
    for c in candidates:
        try:
            obj = json.loads(c)
            break
        except json.JSONDecodeError:
            continue
    if obj is None:
        raise InputError("no JSON object in it, neither the whole file nor its last line "
                         "(want the output of ztier-bench nvme|pcie|adam|step --json)")
    if not isinstance(obj, dict) or "bench" not in obj:
        raise InputError("a JSON value without a 'bench' field: not ztier-bench --json output")
    if obj["bench"] not in KINDS:
        raise InputError(f"ztier-bench {obj['bench']} has no plot (plots: {', '.join(KINDS)})")
    return obj


def need(obj: dict, key: str, kind: type | tuple = (int, float)):
    """obj[key], which must exist and be of `kind`."""
    if key not in obj:
        raise InputError(f"ztier-bench {obj.get('bench', '?')} JSON without '{key}'")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise InputError(f"'{key}' is {type(value).__name__}, not {_kind_name(kind)}")
    return value


def _kind_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("a number" if k in (int, float) else k.__name__ for k in kinds)


def need_rows(obj: dict, key: str, fields: list[str], hint: str = "") -> list[dict]:
    """obj[key]: a non-empty list of objects that each have numeric `fields`."""
    rows = need(obj, key, list)
    if not rows:
        raise InputError(f"'{key}' is empty: nothing to plot" + (f" ({hint})" if hint else ""))
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise InputError(f"'{key}'[{i}] is not an object")
        for f in fields:
            if not isinstance(row.get(f), (int, float)) or isinstance(row.get(f), bool):
                raise InputError(f"'{key}'[{i}] has no number '{f}'")
    return rows


def size_label(n: float) -> str:
    """4096 -> 4K, 1048576 -> 1M (powers of 1024, as ztier-bench prints sizes)."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{int(n // scale)}{unit}"
    return f"{n:g}"


# ---------------------------------------------------------------- plots --
# Each takes the JSON object and returns [(file suffix, figure)].


def plot_nvme(plt, obj: dict):
    sweep = need_rows(obj, "qd_sweep", ["queue_depth", "write_bytes_per_s", "read_bytes_per_s"],
                      hint="run ztier-bench nvme without --no-sweep")
    paths = need(obj, "paths", list)
    qd = need(obj, "queue_depth")
    # null without fio (--no-fio, or none installed)
    fio_w, fio_r = obj.get("fio_write_bytes_per_s"), obj.get("fio_read_bytes_per_s")
    fig, ax = plt.subplots(figsize=SIZE)
    depths = [r["queue_depth"] for r in sweep]
    colors = {"write": "tab:red", "read": "tab:blue"}
    for what in ("write", "read"):
        ax.plot(depths, [r[f"{what}_bytes_per_s"] / 1e9 for r in sweep], "o-",
                color=colors[what], label=f"ztier {what} (sweep)")
        ax.plot([qd], [need(obj, f"{what}_bytes_per_s") / 1e9], "D", color=colors[what],
                markersize=8, markerfacecolor="none",
                label=f"ztier {what}, full size (best of the rounds)")
    fio = bool(fio_w) and bool(fio_r)
    if fio:
        engine = obj.get("fio_engine", "fio")
        ax.axhline(fio_w / 1e9, color=colors["write"], linestyle="--",
                   label=f"limit: fio write {fio_w / 1e9:.2f} GB/s")
        ax.axhline(fio_r / 1e9, color=colors["read"], linestyle="--",
                   label=f"limit: fio read {fio_r / 1e9:.2f} GB/s")
        limit = (f"limit: fio ({engine}, direct=1, qd {qd}, same size and directories), "
                 f"same run")
    else:
        limit = "limit: none (fio was skipped in this run)"
    ax.set_xscale("log", base=2)
    ax.set_xticks(depths, [str(d) for d in depths])
    ax.set_xlabel("queue depth per path")
    ax.set_ylabel("throughput (GB/s, 1e9 B/s)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.1)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    sweep_bytes = obj.get("total_bytes", 0) // 4
    ax.set_title(f"ztier-bench nvme ({obj.get('backend', '?')}): {len(paths)} path(s), stripe "
                 f"{size_label(obj.get('stripe_bytes', 0))}, sweep of "
                 f"{size_label(sweep_bytes) if sweep_bytes else '?'} a depth\n{limit}",
                 fontsize=10)
    return [("queue-depth", fig)]


def plot_pcie(plt, obj: dict):
    dirs = ("h2d", "d2h", "both")
    fields = ["bytes"] + [f"{d}_{k}" for d in dirs for k in ("gbps", "limit_gbps")]
    sizes = need_rows(obj, "sizes", fields)
    backend = need(obj, "backend", str)
    fig, ax = plt.subplots(figsize=SIZE)
    xs = [r["bytes"] for r in sizes]
    colors = {"h2d": "tab:blue", "d2h": "tab:red", "both": "tab:green"}
    names = {"h2d": "host to device", "d2h": "device to host", "both": "both at once"}
    cuda = backend == "cuda"
    for d in dirs:  # the measured lines first: the legend's first column
        ax.plot(xs, [r[f"{d}_gbps"] for r in sizes], "o-", color=colors[d], label=names[d])
    for d in dirs:
        if cuda:
            peak = need(obj, f"peak_{d}_gbps")
            ax.axhline(peak, color=colors[d], linestyle="--",
                       label=f"limit {d}: {peak:.1f} GB/s")
        else:
            ax.plot(xs, [r[f"{d}_limit_gbps"] for r in sizes], "--", color=colors[d],
                    alpha=0.8, label=f"limit {d} (memcpy)")
    if cuda:
        limit = (f"limit: pinned cudaMemcpyAsync peak ({size_label(obj.get('peak_bytes', 0))} "
                 f"copies) on {obj.get('device', '?')}, same run")
    else:
        limit = "limit: memcpy of the same size between the same buffers, same run"
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [size_label(x) for x in xs])
    ax.set_xlabel("transfer size (bytes)")
    ax.set_ylabel("bandwidth (GB/s, 1e9 B/s; both: the two directions added)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    ax.set_title(f"ztier-bench pcie ({backend} backend): engine publish buffer -> device -> grad "
                 f"inbox, median of {obj.get('reps', '?')}\n{limit}", fontsize=10)
    return [("transfer-size", fig)]


def plot_adam(plt, obj: dict):
    cases = need_rows(obj, "cases", ["params", "threads", "bytes_per_s", "limit_bytes_per_s"])
    threads = sorted({c["threads"] for c in cases})
    params = sorted({c["params"] for c in cases})
    by_threads = len(threads) > 1
    x_key = "threads" if by_threads else "params"
    group_key = "params" if by_threads else "threads"
    fig, ax = plt.subplots(figsize=SIZE)
    cmap = plt.get_cmap("tab10")
    groups = sorted({c[group_key] for c in cases})
    variants = sorted({(c.get("check", ""), c.get("store", "")) for c in cases})
    markers = ["o", "s", "^", "v", "D", "P"]
    styles = ["-", "-.", ":", (0, (5, 1))]
    for gi, g in enumerate(groups):
        color = cmap(gi % 10)
        label_g = f"{size_label(g)} params" if by_threads else f"{g} thread(s)"
        for vi, (check, store) in enumerate(variants):
            rows = sorted((c for c in cases if c[group_key] == g and c.get("check", "") == check
                           and c.get("store", "") == store), key=lambda c: c[x_key])
            if not rows:
                continue
            what = ", ".join(x for x in (check, store if len({v[1] for v in variants}) > 1
                                         else "") if x)
            ax.plot([c[x_key] for c in rows], [c["bytes_per_s"] / 1e9 for c in rows],
                    marker=markers[vi % len(markers)], linestyle=styles[vi % len(styles)],
                    color=color, label=f"AdamW {label_g}" + (f" ({what})" if what else ""))
        # The limit of a case does not depend on its check mode: one line per group.
        xs = sorted({c[x_key] for c in cases if c[group_key] == g})
        limit = [max(c["limit_bytes_per_s"] for c in cases
                     if c[group_key] == g and c[x_key] == x) / 1e9 for x in xs]
        ax.plot(xs, limit, "--", color=color, linewidth=2.5, alpha=0.5,
                label=f"limit {label_g}")
    if by_threads:
        ax.set_xticks(threads, [str(t) for t in threads])
        ax.set_xlabel("optimizer threads")
    else:
        ax.set_xscale("log", base=2)
        ax.set_xticks(params, [size_label(p) for p in params])
        ax.set_xlabel("shard size (params)")
    bpp = cases[0].get("bytes_per_param", 0)
    ax.set_ylabel(f"memory traffic (GB/s, 1e9 B/s; {bpp:g} B a param)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    first = cases[0]
    ax.set_title(f"ztier-bench adam ({obj.get('target', '?')}): grads {first.get('grad', '?')}, "
                 f"states {first.get('state_dtype', '?')}, out {first.get('out', '?')}\n"
                 "limit (dashed): a memory kernel of the same access pattern, same run",
                 fontsize=10)
    return [("threads" if by_threads else "params", fig)]


def _step_runs(obj: dict) -> list[dict]:
    if "runs" in obj:  # --state-dtype both: fp32 then int8
        runs = need(obj, "runs", list)
        if not runs or not all(isinstance(r, dict) for r in runs):
            raise InputError("'runs' is not a list of step results")
        return runs
    return [obj]


def plot_step(plt, obj: dict):
    from matplotlib.patches import Patch  # matplotlib is imported by now

    runs = _step_runs(obj)
    for run in runs:
        if "timeline" not in run:
            raise InputError("no 'timeline' (the traced step): run ztier-bench step --json "
                             "without --no-timeline")
        need_rows(need(run, "timeline", dict), "units", ["unit"])
    fig, axes = plt.subplots(len(runs), 1, figsize=(SIZE[0], SIZE[1] * (0.75 + 0.35 * len(runs))),
                             squeeze=False)
    colors = {"read": "tab:blue", "compute": "tab:orange", "write": "tab:green"}
    ranges = []  # of each run's times: one time axis for all (fp32 above int8)
    for ax, run in zip(axes[:, 0], runs):
        tl = run["timeline"]
        units = tl["units"]
        height = 0.8
        for u in units:
            y = u["unit"]
            for what in ("read", "compute", "write"):
                a, b = u.get(f"{what}_start"), u.get(f"{what}_end")
                if isinstance(a, (int, float)) and isinstance(b, (int, float)):
                    ax.broken_barh([(a, max(b - a, 0))], (y - height / 2, height),
                                   color=colors[what])
        names = {"read": "read from NVMe (queued to the drive until done)",
                 "compute": "AdamW", "write": "write-back"}
        handles = [Patch(color=colors[w], label=names[w]) for w in names
                   if any(isinstance(u.get(f"{w}_start"), (int, float)) for u in units)]
        # The last unit's publish ("step_seconds" in files of older versions).
        step = tl["published_seconds"] if "published_seconds" in tl else need(tl, "step_seconds")
        io_alone = need(run, "io_alone_seconds")
        compute_alone = need(run, "compute_alone_seconds")
        ax.axvline(step, color="black", linewidth=1.5, label=f"last unit published {step:.2f} s")
        done = tl.get("write_backs_done_seconds")
        if isinstance(done, (int, float)) and done > step * 1.005:
            ax.axvline(done, color="black", linestyle=":", label=f"write-backs done {done:.2f} s")
        if io_alone > 0:
            ax.axvline(io_alone, color="tab:blue", linestyle="--", linewidth=1.5,
                       label=f"limit: I/O alone {io_alone:.2f} s")
        ax.axvline(compute_alone, color="tab:orange", linestyle="--", linewidth=1.5,
                   label=f"limit: compute alone {compute_alone:.2f} s")
        starts = [u[k] for u in units for k in ("read_start", "compute_start")
                  if isinstance(u.get(k), (int, float))]
        right = max([step, io_alone, compute_alone] +
                    ([done] if isinstance(done, (int, float)) else []))
        left = min([0.0] + starts)
        ranges.append((left, right))
        ax.set_ylim(len(units) - 0.5, -0.5)  # unit 0 on top
        if len(units) <= 32:
            ax.set_yticks(range(len(units)))
            ax.tick_params(axis="y", labelsize=7)
        ax.set_ylabel("unit (forward order)")
        ax.grid(True, axis="x", alpha=0.3)
        lines, _ = ax.get_legend_handles_labels()
        ax.legend(handles=handles + lines, fontsize=7, loc="upper right")
        params = run.get("params", 0)
        states = f"states on {run.get('tier', '?')} ({run.get('state_dtype', '?')})"
        limits = (f"limits, same run: I/O alone {io_alone:.2f} s, compute alone "
                  f"{compute_alone:.2f} s" if io_alone > 0 else
                  f"limit, same run: compute alone {compute_alone:.3f} s (no I/O)")
        title = (f"ztier-bench step: {size_label(params)} params in {len(units)} units, {states}, "
                 f"params on {run.get('param_tier', '?')}\n{limits}; overlap efficiency "
                 f"{run.get('overlap_efficiency', 0):.2f} (mean of the timed steps)")
        if tl.get("note"):
            title += f"\n{tl['note']}"
        ax.set_title(title, fontsize=9)
    left, right = min(r[0] for r in ranges), max(r[1] for r in ranges)
    for ax in axes[:, 0]:
        ax.set_xlim(left - 0.02 * (right - left), right * 1.04)
    axes[-1, 0].set_xlabel("seconds from the step's start (its first grads handed over); "
                           "the traced step")
    fig.tight_layout()
    return [("timeline", fig)]


PLOTS = {"nvme": plot_nvme, "pcie": plot_pcie, "adam": plot_adam, "step": plot_step}


def import_pyplot():
    """matplotlib.pyplot with the file-only backend; re-executes in .venv when it is there."""
    try:
        import matplotlib
    except ImportError:
        in_venv = Path(sys.prefix).resolve() == VENV_PYTHON.parent.parent.resolve()
        if VENV_PYTHON.exists() and not in_venv and not os.environ.get(REEXEC_MARKER):
            os.environ[REEXEC_MARKER] = "1"
            os.execv(str(VENV_PYTHON), [str(VENV_PYTHON), __file__, *sys.argv[1:]])
        print("plot.py: matplotlib is not installed in this Python; scripts/python_env.sh "
              "makes .venv with it", file=sys.stderr)
        sys.exit(1)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description="PNG plots of ztier-bench nvme|pcie|adam|step --json output.")
    parser.add_argument("inputs", nargs="+", type=Path, metavar="INPUT.json",
                        help="ztier-bench --json output (the object, or the whole output)")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR",
                        help="directory for the PNG files (created)")
    args = parser.parse_args(argv)
    loaded = []
    for path in args.inputs:  # every input checked before anything is written
        try:
            loaded.append((path, load(path)))
        except InputError as e:
            print(f"plot.py: {path}: {e}", file=sys.stderr)
            return 2
    plt = import_pyplot()
    figures = []  # every plot made before any is written
    for path, obj in loaded:
        try:
            figures += [(path, suffix, fig) for suffix, fig in PLOTS[obj["bench"]](plt, obj)]
        except InputError as e:
            print(f"plot.py: {path}: {e}", file=sys.stderr)
            plt.close("all")
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    for path, suffix, fig in figures:
        out = args.out / f"{path.stem}-{suffix}.png"
        fig.savefig(out, dpi=DPI, bbox_inches="tight")
        plt.close(fig)
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
