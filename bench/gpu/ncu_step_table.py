"""Sums Nsight Compute's per-kernel durations (ncu --csv --metrics gpu__time_duration.sum) over the
last runner step of a bench_runner --only run and prints them per kernel name, largest first, after
a summary by part of the step: GEMMs (cuBLAS/cuBLASLt and the skinny kernel), attention (the decode
and prefill attention kernels, the cache write and read-back, the softmax; the expanded prefill
attention's cuBLAS products count as GEMMs, their names do not tell) and the rest.

A step's kernels start at its embedding kernel, so the last step is the run of kernels from the last
`embed` launch on, up to the next kernel that is not the runner's (none, for bench_runner --only)."""
import csv
import sys
from collections import defaultdict

UNIT_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}

# Kernel-name fragments of each part (checked in order; anything else is "the rest").
PARTS = [
    ("attention", ("mla_decode", "mla_combine", "mla_write", "mla_gather", "flash_prefill",
                   "pack_queries")),
    ("GEMMs", ("nvjet", "gemm", "cublas", "splitKreduce", "skinny", "xmma", "internal::kernel")),
]


def part_of(name):
    for part, fragments in PARTS:
        if any(f in name for f in fragments):
            return part
    return "the rest"


def main(path):
    with open(path) as f:
        lines = [l for l in f if l.startswith('"')]
    rows = [r for r in csv.DictReader(lines) if r.get("Metric Name") == "gpu__time_duration.sum"]
    if not rows:
        print(f"no kernels in {path}")
        return
    starts = [i for i, r in enumerate(rows) if "embed" in r["Kernel Name"]]
    step = rows[starts[-1]:] if starts else rows
    total = defaultdict(float)
    count = defaultdict(int)
    for r in step:
        name = r["Kernel Name"].split("(")[0][:80]
        value = float(r["Metric Value"].replace(",", ""))
        total[name] += value * UNIT_US.get(r["Metric Unit"], 1.0)
        count[name] += 1
    grand = sum(total.values())
    print(f"last step: {len(step)} kernels, {grand:.1f} us of kernel time")
    parts = defaultdict(float)
    for name, us in total.items():
        parts[part_of(name)] += us
    print("  " + ", ".join(f"{part} {us:.1f} us ({100 * us / grand:.0f}%)"
                           for part, us in sorted(parts.items(), key=lambda kv: -kv[1])))
    for name, us in sorted(total.items(), key=lambda kv: -kv[1]):
        print(f"{us:10.1f} us {100 * us / grand:5.1f}%  {count[name]:5d}x  {name}")


if __name__ == "__main__":
    main(sys.argv[1])
