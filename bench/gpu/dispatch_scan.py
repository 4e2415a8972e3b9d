#!/usr/bin/env python3
"""Where the decode plan's own kernel lost to a kernel forced beside it.

bench_gpu_decode times each format with the plan's choice and, for the names ending in @KERNEL,
with that kernel forced (QUANTMLA_DECODE_KERNEL). Given its JSON files (or run.sh's
decode-v2-*.json) from one grid or several, prints each shape (format, heads, batch, context, s_q)
where a forced kernel took at most THRESHOLD of the plan's time, with every grid's times and how
many of the grids that timed the shape agree: where select_decode_kernel (decode.cu) may choose
better, to be timed again before the plan changes. A forced kernel that is the plan's own (the
rows' "kernel", where a file records it) is two runs of one kernel, listed as the grid's spread.

  python3 bench/gpu/dispatch_scan.py GRID.json [GRID.json ...] [--threshold 0.95]
"""
import argparse
import collections
import json
import sys


def shapes(path):
    """{(format, heads, batch, context, s_q): {"plan": (ms, kernel), KERNEL: ms}} of one file."""
    by = collections.defaultdict(dict)
    for r in json.load(open(path))["rows"]:
        base, _, forced = r["format"].partition("@")
        key = (base, r["heads"], r["batch"], r["context"], r.get("s_q", 1))
        if forced:
            by[key][forced] = r["ms"]
        else:
            by[key]["plan"] = (r["ms"], r.get("kernel"))
    return by


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("grids", nargs="+")
    ap.add_argument("--threshold", type=float, default=0.95,
                    help="a forced kernel's time over the plan's, at most (default 0.95)")
    args = ap.parse_args()
    grids = [shapes(path) for path in args.grids]
    found = []
    for key in sorted(set().union(*grids)):
        timed, lines, worst = 0, [], 0.0
        for n, grid in enumerate(grids):
            times = grid.get(key, {})
            if "plan" not in times or len(times) < 2:
                continue
            timed += 1
            plan_ms, plan_kernel = times["plan"]
            forced = {k: ms for k, ms in times.items() if k != "plan"}
            best = min(forced, key=forced.get)
            ratio = forced[best] / plan_ms
            if ratio > args.threshold:
                continue
            same = plan_kernel is not None and best == plan_kernel
            worst = max(worst, ratio)
            lines.append(f"    grid {n + 1}: plan {plan_kernel or '?'} {plan_ms:.4f} ms, {best} "
                         f"forced {forced[best]:.4f} ({ratio:.2f}x)" +
                         (" (the plan's own kernel: the spread)" if same else ""))
        if lines:
            found.append((len(lines) < timed, -len(lines), worst, key, timed, lines))
    if not found:
        print(f"dispatch_scan: no shape where a forced kernel took {args.threshold}x the plan's "
              f"time or less in {len(grids)} grid(s)")
        return 0
    print(f"shapes where a forced kernel took {args.threshold}x the plan's time or less "
          f"({len(grids)} grid(s); those in every grid that timed them first):")
    for _, _, _, key, timed, lines in sorted(found):
        fmt, heads, batch, ctx, s_q = key
        print(f"  {fmt} heads {heads} batch {batch} context {ctx} s_q {s_q}: "
              f"{len(lines)} of {timed} grid(s)")
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
